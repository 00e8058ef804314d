"""The examples in the docstrings run (issue 31): every ``>>>`` example in ``vllm_lens`` and
``inspect_provider`` — the public names' examples (``tests/unit/test_docstrings.py`` requires
them) and the internal modules' doctests alike — is a doctest run here, against the suite's
shared engines, so that none rots. (pytest's own ``--doctest-modules`` is not used: it would
run them without the engines.)

What an example may use without importing it:

- ``llm``: the suite's tiny engine (a random 4-layer Llama, hidden size 128, eager, chunked
  prefill; ``tests/integration/conftest.py``), with vllm-lens loaded;
- ``tiny_path``: that model's directory;
- ``tmp``: an empty directory of the example's own (a ``pathlib.Path``);
- ``server``: for the clients' examples only (``vllm_lens.client``), the base URL of the
  suite's SmolLM2 server (``smol_server``: presets ``calm`` and ``focus``, the SAE
  ``smol-l10``).

Anything else an example imports itself, so that it reads as a user would write it.
"""

from __future__ import annotations

import doctest
import importlib
import io
import pkgutil

import pytest

_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
_PACKAGES = ("vllm_lens", "inspect_provider")
_CLIENT = "vllm_lens.client"


def _module_names() -> list[str]:
    names = []
    for package in _PACKAGES:
        root = importlib.import_module(package)
        names.append(package)
        names += [info.name for info in pkgutil.walk_packages(root.__path__, package + ".")]
    return names


def _doctests(client: bool):
    finder = doctest.DocTestFinder()
    for name in _module_names():
        if (name == _CLIENT) != client:
            continue
        module = importlib.import_module(name)
        for test in sorted(finder.find(module, name), key=lambda t: t.name):
            if test.examples:
                yield pytest.param(test, id=test.name)


def _run(test: doctest.DocTest, globs: dict, tmp_path) -> None:
    test.globs = {**test.globs, **globs, "tmp": tmp_path}
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=_FLAGS)
    result = runner.run(test, out=out.write, clear_globs=True)
    assert result.failed == 0, f"{test.name}'s example failed:\n{out.getvalue()}"


def test_the_examples_are_found():
    """The walk reaches internal modules' doctests and the clients' (a broken walk would
    leave the tests below with nothing to run)."""
    found = [p.id for p in _doctests(client=False)]
    assert any(name.startswith("vllm_lens.common.points.") for name in found)
    assert any(name.startswith("vllm_lens.worker.plan.") for name in found)
    assert any(p.id.startswith(_CLIENT + ".") for p in _doctests(client=True))


@pytest.mark.parametrize("test", list(_doctests(client=False)))
def test_docstring_example(test, tiny_llm, tiny_path, tmp_path):
    _run(test, {"llm": tiny_llm, "tiny_path": tiny_path}, tmp_path)


@pytest.mark.parametrize("test", list(_doctests(client=True)))
def test_client_docstring_example(test, smol_server, tmp_path):
    _run(test, {"server": smol_server.base_url}, tmp_path)
