"""The README's fenced code blocks and how the suite runs each (runs in: the test process,
and as a script for the offline blocks).

Every ``python`` and ``bash`` block in README.md is preceded by a directive comment:

- ``<!-- doc-test: run -->``: a Python block run as written, as a script's main module
  (``__name__ == "__main__"``), in a fresh namespace;
- ``<!-- doc-test: continue -->``: a Python block run after the blocks before it, in the
  namespace of the last ``run`` block (the README says which snippet it continues);
- ``<!-- doc-test: server -->``: the shell command that starts the OpenAI server;
- ``<!-- doc-test: client -->``: a Python block run, in a fresh process, against that server;
- ``<!-- doc-test: quickstart -->``: the set-up commands (``make demo``; ``make test`` is CI's
  own command);
- ``<!-- doc-test: skip — reason -->``: illustrative only, with the reason.

Run as a script, ``python tests/readme_blocks.py BLOCKS.json`` executes the given ``run`` /
``continue`` blocks in order in one process.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
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


def blocks(text: str | None = None) -> list[Block]:
    """Every fenced block with a language, with the directive just above it."""
    lines = (README.read_text() if text is None else text).splitlines()
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
                           "\n".join(body) + "\n"))
        i += 1
    return found


def run_in_order(chain: list[dict]) -> None:
    """Execute ``run`` / ``continue`` blocks as the README's reader would, one namespace per
    ``run`` block."""
    namespace: dict = {}
    for block in chain:
        if block["kind"] == "run":
            namespace = {"__name__": "__main__"}
        print(f"--- README.md line {block['line']} ---", flush=True)
        # Pad so that tracebacks give README.md's own line numbers.
        code = "\n" * block["line"] + block["code"]
        exec(compile(code, str(README), "exec"), namespace)


def dump(chain: list[Block], path: Path) -> None:
    path.write_text(json.dumps([asdict(b) for b in chain]))


if __name__ == "__main__":
    run_in_order(json.loads(Path(sys.argv[1]).read_text()))
