"""Compare vllm-lens's registry of vLLM symbols with a vLLM source tree, statically (runs in:
caller; nothing of that vLLM is imported or run).

    python tools/vllm_api_diff.py SOURCE_DIR [--json]

SOURCE_DIR holds the ``vllm`` package's Python files (an unzipped wheel or sdist). For each
entry of ``vllm_lens.common.vllm_api.REGISTRY`` it reads the sources with ``ast``: the module
file exists; the first name of the qualname is defined in it (a class, a function, an
assignment, or an import followed to its module, ``vllm/__init__.py``'s lazy ``MODULE_ATTRS``
table included); members are looked up in the class body and in its bases that are defined in
vLLM (methods, properties, class-level assignments and annotations, and ``self.<name>``
assigned in any method: ``vllm_api.declared_members``); the parameters of a function or
method defined with ``def`` are compared by name. A member of a non-vLLM base (``nn.Module``,
``msgspec.Struct``, pydantic) is not seen: run it on the installed vLLM's own sources first to
see what this reading cannot judge (it should find nothing there). For a missing name it lists
where the tree defines a class or function of that name now.

The exit status is 1 when an entry differs.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys
from dataclasses import dataclass, field

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from vllm_lens.common.vllm_api import REGISTRY, Need, declared_members  # noqa: E402


@dataclass
class Module:
    name: str
    tree: ast.Module
    names: dict[str, ast.AST] = field(default_factory=dict)
    """Top-level name -> its definition (ClassDef, FunctionDef, Assign, or ImportFrom)."""
    stars: list[ast.ImportFrom] = field(default_factory=list)
    """``from x import *`` statements, searched for names not defined here."""


class Tree:
    """A vLLM source tree, parsed on demand."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.modules: dict[str, Module | None] = {}
        self._index: dict[str, list[str]] | None = None

    def module(self, name: str) -> Module | None:
        if name not in self.modules:
            base = self.root / name.replace(".", "/")
            path = next((p for p in (base.with_suffix(".py"), base / "__init__.py")
                         if p.is_file()), None)
            self.modules[name] = None if path is None else _parse(name, path)
        return self.modules[name]

    def lookup(self, module: str, name: str, depth: int = 0) -> tuple[Module, ast.AST] | None:
        """The definition ``name`` has in ``module``, following imports."""
        mod = self.module(module)
        if mod is None or depth > 8:
            return None
        node = mod.names.get(name)
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, node, is_package=self._is_package(module))
            original = next(a.name for a in node.names if (a.asname or a.name) == name)
            return (self.lookup(source, original, depth + 1)
                    or self._module_node(f"{source}.{original}"))
        if isinstance(node, ast.Import):
            return self._module_node(name)
        if node is None:
            for star in mod.stars:
                source = _absolute(module, star, is_package=self._is_package(module))
                if (found := self.lookup(source, name, depth + 1)) is not None:
                    return found
            lazy = _lazy_attr(mod, name)
            if lazy is not None:
                return self.lookup(_absolute_name(module, lazy[0], self._is_package(module)),
                                   lazy[1], depth + 1)
            return self._module_node(f"{module}.{name}")
        return mod, node

    def _module_node(self, name: str) -> tuple[Module, ast.AST] | None:
        mod = self.module(name)
        return None if mod is None else (mod, mod.tree)

    def _is_package(self, module: str) -> bool:
        return (self.root / module.replace(".", "/") / "__init__.py").is_file()

    def members(self, mod: Module, cls: ast.ClassDef, seen: set[int] | None = None
                ) -> dict[str, ast.AST]:
        """Member name -> its node (a def, or the class for assigned attributes), bases
        defined in vLLM included."""
        seen = set() if seen is None else seen
        if id(cls) in seen:
            return {}
        seen.add(id(cls))
        found: dict[str, ast.AST] = {}
        for base in cls.bases:
            base = base.value if isinstance(base, ast.Subscript) else base
            resolved = None
            if isinstance(base, ast.Name):
                resolved = self.lookup(mod.name, base.id)
            if resolved is not None and isinstance(resolved[1], ast.ClassDef):
                found.update(self.members(resolved[0], resolved[1], seen))
        found.update({name: cls for name in declared_members(cls)})
        found.update({n.name: n for n in cls.body
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))})
        return found

    def defined_in(self, name: str) -> list[str]:
        """Modules that define a class or function ``name`` at top level."""
        if self._index is None:
            self._index = {}
            for path in sorted(self.root.rglob("*.py")):
                rel = path.relative_to(self.root).with_suffix("")
                modname = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
                try:
                    tree = ast.parse(path.read_text(encoding="utf-8"))
                except (SyntaxError, UnicodeDecodeError):
                    continue
                for node in tree.body:
                    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                        self._index.setdefault(node.name, []).append(modname)
        return self._index.get(name, [])


def _parse(name: str, path: pathlib.Path) -> Module:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    mod = Module(name, tree)

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                mod.names.setdefault(node.name, node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        mod.names.setdefault(t.id, node)
            elif isinstance(node, ast.ImportFrom) and node.names[0].name == "*":
                mod.stars.append(node)
            elif isinstance(node, (ast.ImportFrom, ast.Import)):
                for alias in node.names:
                    local = alias.asname or alias.name.split(".")[0]
                    mod.names.setdefault(local, node)
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)

    visit(tree.body)
    return mod


def _absolute_name(module: str, relative: str, is_package: bool) -> str:
    if not relative.startswith("."):
        return relative
    level = len(relative) - len(relative.lstrip("."))
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (level - 1)]
    rest = relative[level:]
    return ".".join([*base, rest] if rest else base)


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    return _absolute_name(module, "." * node.level + (node.module or ""), is_package)


def _lazy_attr(mod: Module, name: str) -> tuple[str, str] | None:
    """``vllm/__init__.py``'s ``MODULE_ATTRS = {"LLM": ".entrypoints.llm:LLM", ...}``."""
    node = mod.names.get("MODULE_ATTRS")
    if not isinstance(node, (ast.Assign, ast.AnnAssign)) or not isinstance(node.value, ast.Dict):
        return None
    for key, value in zip(node.value.keys, node.value.values):
        if (isinstance(key, ast.Constant) and key.value == name
                and isinstance(value, ast.Constant) and ":" in str(value.value)):
            target, _, attr = str(value.value).partition(":")
            return target, attr
    return None


def _params(node: ast.AST) -> list[str] | None:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return names


def diff_one(tree: Tree, need: Need) -> str | None:
    """What differs for ``need`` in ``tree``, or ``None``."""
    if tree.module(need.module) is None:
        moved = [m for m in tree.defined_in(need.qualname.split(".")[0])] if need.qualname else []
        where = f"; {need.qualname.split('.')[0]} is defined in {', '.join(moved)}" if moved else ""
        return f"module {need.module} is gone{where}"
    if need.kind == "module":
        return None
    first, *rest = need.qualname.split(".")
    found = tree.lookup(need.module, first)
    if found is None:
        moved = tree.defined_in(first)
        where = f" (defined in {', '.join(moved)})" if moved else ""
        return f"{first} is not defined in {need.module}{where}"
    mod, node = found
    for i, part in enumerate(rest):
        if not isinstance(node, ast.ClassDef):
            return f"{'.'.join([first, *rest[:i]])} is not a class here: cannot read .{part}"
        members = tree.members(mod, node)
        if part not in members:
            return f"{node.name} and its vLLM bases neither define nor assign {part}"
        node = members[part]
        if isinstance(node, ast.ClassDef) and part != node.name:
            node = None  # an attribute assigned in the class: nothing more to read
            if i < len(rest) - 1:
                return f"{part} is an attribute: cannot read further"
    if need.kind == "class" and not isinstance(node, ast.ClassDef):
        return f"{need.qualname} is not a class here ({type(node).__name__})"
    if need.kind in ("function", "method") and need.params:
        params = _params(node) if node is not None else None
        if params is None:
            return None  # not a plain def (an assignment, a decorator's product): unjudged
        missing = [p for p in need.params if p not in params]
        if missing:
            return f"has no parameter {', '.join(missing)} (parameters: {', '.join(params)})"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=pathlib.Path, help="directory holding the vllm package")
    parser.add_argument("--json", action="store_true", help="print the differences as JSON")
    args = parser.parse_args(argv)
    tree = Tree(args.source)
    if tree.module("vllm") is None:
        parser.error(f"no vllm package under {args.source}")
    found = [(need, problem) for need in REGISTRY
             if (problem := diff_one(tree, need)) is not None]
    if args.json:
        print(json.dumps([{"symbol": n.symbol, "kind": n.kind, "use": n.use,
                           "used_by": list(n.used_by), "optional": n.optional,
                           "problem": p} for n, p in found], indent=1))
    else:
        for need, problem in found:
            flag = " [optional]" if need.optional else ""
            print(f"{need.symbol} ({need.kind}, {need.use}){flag}: {problem}")
        print(f"{len(found)} of {len(REGISTRY)} entries differ")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
