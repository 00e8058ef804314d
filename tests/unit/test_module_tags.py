"""Every module of the package says where it runs, in one form and from one vocabulary.

The form: the first paragraph of the module docstring ends with ``(runs in: PLACES).``, where
PLACES is one place or several, comma-separated, each one of ``caller`` (the user's process:
the clients, the command line, a script reading datasets), ``front end`` (the process that owns
``LLM`` / ``AsyncLLM`` or the OpenAI server), ``engine core``, ``worker`` (one per TP/PP rank)
or ``any``. The modules are read as text, not imported: a module that needs vLLM is checked
like the others."""

import ast
import pathlib
import re

import pytest

PLACES = ("caller", "front end", "engine core", "worker", "any")
PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "vllm_lens"
MODULES = sorted(PACKAGE.rglob("*.py"))
TAG = re.compile(r"\(runs in: ([a-z ,]+)\)\.$")


def _summary(path: pathlib.Path) -> str:
    """The first paragraph of the module docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc, f"{path.relative_to(PACKAGE.parent)} has no module docstring"
    return " ".join(doc.split("\n\n", 1)[0].split())


def test_the_walk_finds_the_whole_package():
    names = {p.relative_to(PACKAGE).as_posix() for p in MODULES}
    assert {"__init__.py", "plugin.py", "worker/extension.py", "frontend/session.py"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_the_summary_ends_with_where_the_module_runs(path):
    summary = _summary(path)
    found = TAG.search(summary)
    assert found, f"the first paragraph must end with '(runs in: PLACES).': {summary!r}"
    places = [place.strip() for place in found.group(1).split(",")]
    wrong = [place for place in places if place not in PLACES]
    assert not wrong, f"{wrong} are not among {PLACES}"
    assert len(set(places)) == len(places), f"a place named twice: {places}"
    assert "any" not in places or places == ["any"], "'any' stands alone"
    assert summary.count("runs in:") == 1, "one tag per summary"


def test_the_vocabulary_check_refuses_a_place_outside_it():
    found = TAG.search("Something (runs in: the user's process).")
    assert found is None
    found = TAG.search("Something (runs in: api server).")
    assert [p for p in found.group(1).split(", ") if p not in PLACES] == ["api server"]


def _imported(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


@pytest.mark.parametrize("room", ["frontend", "engine_core", "spec", "common"])
def test_no_room_outside_the_worker_imports_the_worker(room):
    """The worker's modules load torch ops and run beside the model; the front end learns what
    they know only through the typed answers of ``common.messages``."""
    found = {p.relative_to(PACKAGE).as_posix(): sorted(
        n for n in _imported(p) if n == "vllm_lens.worker" or n.startswith("vllm_lens.worker."))
        for p in (PACKAGE / room).rglob("*.py")}
    assert not {k: v for k, v in found.items() if v}
