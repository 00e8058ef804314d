"""The fenced code blocks of the README and of every documentation page (``docs/**/*.md``),
and how the suite runs each (runs in: the test process, and as a script for the offline
blocks).

Every ``python`` and ``bash`` block on every page is preceded by a directive comment:

- ``<!-- doc-test: run -->``: a Python block run as written, as a script's main module
  (``__name__ == "__main__"``), in a fresh namespace;
- ``<!-- doc-test: continue -->``: a Python block run after the blocks before it *on the same
  page*, in the namespace of that page's last ``run`` block (the page says which snippet it
  continues);
- ``<!-- doc-test: server -->``: the shell command that starts the OpenAI server (one, on any
  page);
- ``<!-- doc-test: client -->``: a Python block run, in a fresh process, against that server
  (on any page);
- ``<!-- doc-test: quickstart -->``: the set-up commands (``make demo``; ``make test`` is CI's
  own command);
- ``<!-- doc-test: skip — reason -->``: illustrative only, with the reason.

A page's ``run`` and ``continue`` blocks form its *chain*, run in one process. A chain whose
blocks are, to the letter, the first blocks of another page's chain (the README's first
example opens other pages too) is run as part of that one (``chains_to_run``).

Run as a script, ``python tests/readme_blocks.py BLOCKS.json`` executes the given ``run`` /
``continue`` blocks in order in one process.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
KINDS = ("run", "continue", "server", "client", "quickstart", "skip")
_DIRECTIVE = re.compile(r"<!-- doc-test: (\w+)(.*?)-->", re.S)


@dataclass(frozen=True)
class Block:
    line: int
    """1-based line of the opening fence."""
    lang: str
    kind: str | None
    """The directive's kind, or ``None`` when the block has none."""
    reason: str
    code: str
    path: str = "README.md"
    """The page, relative to the repository root."""

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def pages() -> list[Path]:
    """The README, then every page of the documentation site, in path order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def blocks(text: str | None = None, path: Path = README) -> list[Block]:
    """Every fenced block with a language on one page, with the directive just above it."""
    lines = (path.read_text() if text is None else text).splitlines()
    name = path.relative_to(ROOT).as_posix()
    found = []
    i = 0
    while i < len(lines):
        fence = re.fullmatch(r"```(\w+)\s*", lines[i])
        if fence is None:
            if lines[i].startswith("```"):  # a block without a language: skip past it
                i += 1
                while i < len(lines) and not lines[i].startswith("```"):
                    i += 1
            i += 1
            continue
        start = i
        i += 1
        body = []
        while not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        # The directive may span lines; it ends on the line just above the fence.
        above = "\n".join(lines[max(0, start - 3):start])
        match = None
        if lines[start - 1].rstrip().endswith("-->"):
            matches = list(_DIRECTIVE.finditer(above))
            match = matches[-1] if matches else None
        kind = match.group(1) if match else None
        reason = match.group(2).strip(" —-\n") if match else ""
        found.append(Block(start + 1, fence.group(1), kind, " ".join(reason.split()),
                           "\n".join(body) + "\n", name))
        i += 1
    return found


def all_blocks() -> list[Block]:
    """Every page's blocks, the README's first."""
    return [block for page in pages() for block in blocks(path=page)]


def chains() -> dict[str, list[Block]]:
    """Each page's ``run`` / ``continue`` blocks, in order, for the pages that have any."""
    found: dict[str, list[Block]] = {}
    for block in all_blocks():
        if block.kind in ("run", "continue"):
            found.setdefault(block.path, []).append(block)
    return found


def chains_to_run() -> tuple[dict[str, list[Block]], dict[str, str]]:
    """The chains the suite runs, and for each other page the page whose chain runs its
    blocks: a chain whose code is a prefix of another's is run as part of the longer one."""
    every = chains()
    covered = {}
    for path, chain in every.items():
        codes = [b.code for b in chain]
        for other, longer in every.items():
            if other != path and len(longer) > len(chain) \
                    and [b.code for b in longer[:len(chain)]] == codes:
                covered[path] = other
                break
    return {p: c for p, c in every.items() if p not in covered}, covered


def run_in_order(chain: list[dict]) -> None:
    """Execute ``run`` / ``continue`` blocks as the page's reader would, one namespace per
    ``run`` block."""
    namespace: dict = {}
    for block in chain:
        if block["kind"] == "run":
            namespace = {"__name__": "__main__"}
        print(f"--- {block['path']} line {block['line']} ---", flush=True)
        # Pad so that tracebacks give the page's own line numbers.
        code = "\n" * block["line"] + block["code"]
        exec(compile(code, str(ROOT / block["path"]), "exec"), namespace)


def dump(chain: list[Block], path: Path) -> None:
    path.write_text(json.dumps([asdict(b) for b in chain]))


if __name__ == "__main__":
    run_in_order(json.loads(Path(sys.argv[1]).read_text()))
