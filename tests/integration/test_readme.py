"""The README and the documentation pages as a new user meets them: every Python block and
shell command on every page runs as written (``tests/readme_blocks.py`` says how each kind of
block is run)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.readme_blocks import KINDS, ROOT, all_blocks, blocks, chains, chains_to_run, dump

RUNNER = ROOT / "tests" / "readme_blocks.py"


def _of_kind(*kinds: str):
    return [b for b in all_blocks() if b.kind in kinds]


def _run(cmd, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          **kwargs)


def _show(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n" \
           f"--- stderr ---\n{proc.stderr[-6000:]}"


def test_every_code_block_says_how_it_is_tested():
    found = [b for b in all_blocks() if b.lang in ("python", "bash", "sh", "shell", "console")]
    assert len(found) >= 8
    assert len({b.path for b in found}) > 5, "the documentation pages were not read"
    for block in found:
        assert block.kind in KINDS, f"{block.where}: no <!-- doc-test: ... --> above"
        if block.kind == "skip":
            assert len(block.reason) > 20, f"{block.where}: say why it is skipped"
    first = found[0]
    assert first.where.startswith("README.md:") and first.kind == "run" and first.lang == "python"
    assert [b.kind for b in found if b.lang == "bash"].count("server") == 1
    assert [b.kind for b in found].count("quickstart") == 1
    for chain in chains().values():  # a page's continue blocks follow its own run block
        assert chain[0].kind == "run", f"{chain[0].where}: continues nothing on its own page"
    # A page that shows the README's server or quickstart commands without running them
    # shows them as the README has them.
    for kind in ("server", "quickstart"):
        (original,) = _of_kind(kind)
        for block in found:
            if block.kind == "skip" and f"the README's {kind} block" in block.reason:
                assert block.code == original.code, f"{block.where}: differs from {original.where}"


def test_every_chain_runs_or_is_run_as_part_of_another():
    runs, covered = chains_to_run()
    assert "README.md" in runs or "README.md" in covered
    for path, by in covered.items():
        assert by in runs and chains()[path][0].code == runs[by][0].code, (path, by)


def test_directives_are_parsed_from_the_line_above():
    text = ("x\n<!-- doc-test: skip — a reason that is long enough\n  to wrap -->\n"
            "```python\nprint(1)\n```\n\n```bash\nls\n```\n")
    first, second = blocks(text)
    assert (first.kind, first.reason, first.code) == (
        "skip", "a reason that is long enough to wrap", "print(1)\n")
    assert second.kind is None and second.line == 8


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(chains_to_run()[0]))
def test_offline_snippets_run_as_written(tmp_path, page):
    """Each page's chain in a process of its own (each starts the engine its first block
    starts)."""
    chain = chains_to_run()[0][page]
    spec = tmp_path / "blocks.json"
    dump(chain, spec)
    proc = _run([sys.executable, str(RUNNER), str(spec)], timeout=1200)
    assert proc.returncode == 0, _show(proc)
    out = proc.stdout
    if chain[0].code == _of_kind("run")[0].code:            # opens with the README's example
        assert "torch.Size([2, " in out, _show(proc)         # the first snippet's capture
    if page == "docs/capturing.md":
        assert "torch.Size([1, 576])" in out, _show(proc)    # the sink example's reduced mean
        ratio = float(out.split("tensor(")[1].split(")")[0])
        assert ratio > 20, f"the sink example's claim: position 0 / median norm = {ratio}"


def _port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_server_command_and_client_snippets(tmp_path):
    (server,) = _of_kind("server")
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("the README's server command uses .venv (make demo / make test build it)")
    if _port_in_use(8000):
        pytest.skip("port 8000, which the README's commands use, is taken")
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(["bash", "-c", server.code], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-6000:]
            try:
                if httpx.get("http://127.0.0.1:8000/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the README's server did not start in 600 s"
            time.sleep(2)
        models = httpx.get("http://127.0.0.1:8000/v1/models").json()
        assert models["data"], models
        for block in _of_kind("client"):
            script = tmp_path / f"block_{block.path.replace('/', '_')}_{block.line}.py"
            script.write_text(block.code)
            result = _run([sys.executable, str(script)], timeout=300)
            assert result.returncode == 0, f"{block.where}\n{_show(result)}"
            assert "torch.Size([" in result.stdout, f"{block.where}\n{_show(result)}"
        log_text = (tmp_path / "server.log").read_text()
        assert "float32" in log_text  # the dtype the README says the server runs in
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.mark.slow
def test_quickstart_make_demo():
    (quickstart,) = _of_kind("quickstart")
    commands = [line.split("#")[0].strip() for line in quickstart.code.splitlines()]
    assert commands == ["make demo", "make test"]  # make test is what CI (.ci/run) runs
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    stamp = ROOT / ".venv" / ".installed-cpu"
    if _run(["make", "-q", str(stamp.relative_to(ROOT))], timeout=60).returncode != 0:
        pytest.skip(".venv is not set up from this checkout (make demo would install it)")
    proc = _run(["make", "demo"], timeout=900)
    assert proc.returncode == 0, _show(proc)
    assert "Paris" in proc.stdout, _show(proc)
