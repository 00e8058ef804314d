"""The examples answer ``--help`` without starting (or importing) vLLM, and every option says
what it does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))

# Run the example as __main__ with --help, recording every parser it builds.
_PROBE = """
import argparse, json, runpy, sys
parsers = []
original = argparse.ArgumentParser.parse_known_args
def spy(self, *args, **kwargs):
    parsers.append(self)
    return original(self, *args, **kwargs)
argparse.ArgumentParser.parse_known_args = spy
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exc:
    code = exc.code
else:
    code = "no exit"
print(json.dumps({
    "code": code,
    "no_help": [a.dest for p in parsers for a in p._actions if not a.help],
    "heavy": sorted(m for m in ("vllm", "matplotlib") if m in sys.modules),
}))
"""


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_help_is_immediate_and_complete(example):
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(example)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["code"] == 0
    assert report["no_help"] == [], f"options without help text: {report['no_help']}"
    assert report["heavy"] == [], f"--help imported {report['heavy']}"
