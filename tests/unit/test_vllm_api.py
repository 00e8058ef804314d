"""The registry of vLLM symbols: it matches the installed vLLM, it names what differs, and every
vLLM import or wrapped attribute of the package is in it."""

import ast
import dataclasses
import pathlib
import re
import sys

import pytest

import vllm_lens
from vllm_lens.common import vllm_api
from vllm_lens.common.vllm_api import KINDS, REGISTRY, Need, check

PACKAGE = pathlib.Path(vllm_lens.__file__).parent


def test_every_entry_resolves_on_the_installed_vllm():
    assert check() == []


def test_entries_are_well_formed_and_unique():
    symbols = [n.symbol for n in REGISTRY]
    assert len(symbols) == len(set(symbols))
    for need in REGISTRY:
        assert need.kind in KINDS, need
        assert need.module.split(".")[0] == "vllm", need
        assert bool(need.qualname) == (need.kind != "module"), need
        assert need.used_by and need.why, need
        assert not need.params or need.kind in ("function", "method"), need
    # Every module named in used_by exists (loosely: by its last name, so moves don't matter).
    names = {p.stem for p in PACKAGE.rglob("*.py")} | {p.name for p in PACKAGE.rglob("*")
                                                       if p.is_dir()}
    assert {u.rpartition(".")[2] for n in REGISTRY for u in n.used_by} <= names


def _entry(symbol: str, kind: str, params: tuple[str, ...] = ()) -> Need:
    return Need(symbol, kind, "read", ("tests",), "a test", params)  # type: ignore[arg-type]


@pytest.mark.parametrize("need, expected", [
    (_entry("vllm.v1.lens_gone", "module"), "vllm.v1.lens_gone (module): module"),
    (_entry("vllm.outputs:LensOutput", "class"), "vllm.outputs:LensOutput (class): not found"),
    (_entry("vllm.v1.engine.llm_engine:LLMEngine.add_request", "method",
            ("request_id", "lens_prompt")), "has no parameter lens_prompt"),
    (_entry("vllm.v1.worker.gpu_model_runner:GPUModelRunner.lens_batch", "instance attribute"),
     "GPUModelRunner and its bases neither define nor assign lens_batch"),
    (_entry("vllm.sampling_params:SamplingParams.lens_args", "instance attribute"),
     "neither define nor assign lens_args"),
    (_entry("vllm.forward_context:get_forward_context", "class"), "not a class"),
])
def test_a_missing_symbol_is_reported_by_name(need, expected):
    problems = check([need])
    assert len(problems) == 1 and problems[0].need is need
    assert expected in str(problems[0]) and need.symbol in str(problems[0])


def test_a_renamed_parameter_of_a_registered_entry_is_reported(monkeypatch):
    index, wrapped = next((i, n) for i, n in enumerate(REGISTRY)
                          if n.symbol.endswith("LLMEngine.abort_request"))
    renamed = dataclasses.replace(wrapped, params=("request_ids", "internal_only"))
    table = (*REGISTRY[:index], renamed, *REGISTRY[index + 1:])
    monkeypatch.setattr(vllm_api, "REGISTRY", table)
    vllm_api._reason.cache_clear()
    try:
        reason = vllm_api.unsupported_reason()
    finally:
        vllm_api._reason.cache_clear()
    assert reason is not None and "LLMEngine.abort_request" in reason
    assert "internal_only" in reason and reason.startswith("vLLM ")


def test_start_up_reason_is_none_and_optional_entries_never_refuse(monkeypatch):
    vllm_api._reason.cache_clear()
    assert vllm_api.unsupported_reason() is None
    gone = dataclasses.replace(REGISTRY[0], symbol="vllm:lens_gone", optional=True)
    monkeypatch.setattr(vllm_api, "REGISTRY", (*REGISTRY, gone))
    vllm_api._reason.cache_clear()
    try:
        assert vllm_api.unsupported_reason() is None
        assert [p.need for p in check()] == [gone]
    finally:
        vllm_api._reason.cache_clear()


def test_entries_of_modules_not_loaded_are_skipped_at_start_up_outside_a_worker():
    server_only = _entry("vllm.lens_not_a_module:X", "class")
    server_only = dataclasses.replace(server_only, startup="if loaded")
    worker_only = dataclasses.replace(server_only, startup="worker")
    assert check([server_only, worker_only], in_worker=False) == []
    assert [p.need for p in check([server_only, worker_only], in_worker=True)] == [worker_only]


# -- completeness: every vLLM import / wrapped attribute of the package is registered ----------
def _covered(symbol: str) -> bool:
    """``symbol`` (``module:name.attr``) is an entry, a prefix of one, or a module of one
    (``from m import n`` may import module ``m.n``)."""
    module, _, qualname = symbol.partition(":")
    dotted = f"{module}.{qualname}" if qualname else module
    for need in REGISTRY:
        if need.symbol == symbol or need.symbol.startswith(symbol + "."):
            return True
        if need.module == dotted or need.module.startswith(dotted + "."):
            return True
        full = f"{need.module}.{need.qualname}" if need.qualname else need.module
        if full == dotted or full.startswith(dotted + "."):
            return True
    return False


def _is_vllm(module: str | None) -> bool:
    return module is not None and (module == "vllm" or module.startswith("vllm."))


def _uses(path: pathlib.Path) -> list[tuple[str, int]]:
    """(symbol, line) for each vLLM import, wrapped attribute and vLLM dotted name in
    ``path``."""
    tree = ast.parse(path.read_text())
    local: dict[str, str] = {}  # local name -> symbol it was imported as
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_vllm(node.module):
            for alias in node.names:
                local[alias.asname or alias.name] = f"{node.module}:{alias.name}"
                found.append((f"{node.module}:{alias.name}", node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_vllm(alias.name):
                    local[alias.asname or alias.name] = alias.name
                    found.append((alias.name, node.lineno))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "wrap_attribute"
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Name)
                and node.args[0].id in local and isinstance(node.args[1], ast.Constant)):
            owner = local[node.args[0].id]
            sep = "." if ":" in owner else ":"
            found.append((f"{owner}{sep}{node.args[1].value}", node.lineno))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and re.fullmatch(r"vllm(\.\w+)+\.?", node.value)):
            found.append((node.value.rstrip("."), node.lineno))
    return found


def test_every_vllm_use_in_the_package_is_registered():
    missing = [f"{path.relative_to(PACKAGE.parent)}:{line}: {symbol}"
               for path in sorted(PACKAGE.rglob("*.py"))
               for symbol, line in _uses(path) if not _covered(symbol)]
    assert not missing, "register these in vllm_lens/common/vllm_api.py:\n" + "\n".join(missing)


def test_the_completeness_scan_sees_imports_wraps_and_names(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        "from vllm.v1.engine.llm_engine import LLMEngine as E\n"
        "import vllm.lens_new\n"
        "wrap_attribute(E, 'lens_step', None)\n"
        "NAME = 'vllm.v1.lens.Runner'\n")
    symbols = [s for s, _ in _uses(source)]
    assert symbols == ["vllm.v1.engine.llm_engine:LLMEngine", "vllm.lens_new",
                       "vllm.v1.engine.llm_engine:LLMEngine.lens_step", "vllm.v1.lens.Runner"]
    assert [s for s in symbols if not _covered(s)] == symbols[1:]


# -- the static reading (tools/vllm_api_diff.py) -------------------------------------------------
def _diff_tool():
    import importlib.util

    path = PACKAGE.parent / "tools" / "vllm_api_diff.py"
    spec = importlib.util.spec_from_file_location("vllm_api_diff", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_static_reading_of_the_installed_vllm_finds_nothing(capsys):
    import vllm

    assert _diff_tool().main([str(pathlib.Path(vllm.__file__).parents[1])]) == 0
    assert f"0 of {len(REGISTRY)} entries differ" in capsys.readouterr().out


def test_the_static_reading_names_a_moved_function_and_a_renamed_parameter(tmp_path):
    tool = _diff_tool()
    (tmp_path / "vllm" / "engine").mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("from .engine.core import Engine\n")
    (tmp_path / "vllm" / "engine" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "engine" / "core.py").write_text(
        "class Base:\n    def __init__(self):\n        self.batch = None\n"
        "class Engine(Base):\n    def step(self, request_ids, internal_only): ...\n"
        "def setup(): ...\n")
    tree = tool.Tree(tmp_path)
    assert tool.diff_one(tree, _entry("vllm:Engine.batch", "instance attribute")) is None
    renamed = _entry("vllm:Engine.step", "method", ("request_ids", "internal"))
    assert "has no parameter internal" in tool.diff_one(tree, renamed)
    moved = _entry("vllm.old:setup", "function")
    assert tool.diff_one(tree, moved) == ("module vllm.old is gone; setup is defined in "
                                          "vllm.engine.core")
