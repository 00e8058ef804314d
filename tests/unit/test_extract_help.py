"""``vllm-lens extract --help``: its own flags first, each described once, then how to list
vLLM's engine flags (answered by vLLM's parser)."""

import re

import pytest

from vllm_lens.cli.extract.args import extract_help


def test_own_flags_come_first_each_with_a_description():
    text = extract_help()
    own, engine = text.split("vLLM engine options:", 1)
    flags = re.findall(r"^  (--[a-z-]+)", own, flags=re.M)
    assert flags[:4] == ["--model", "--input", "--split", "--output"]
    assert {"--layers", "--points", "--positions", "--sae", "--ray", "--num-engines",
            "--reduce", "--rows-per-shard"} <= set(flags)
    # Every flag of its own is described (argparse puts the text after the flag, or on the
    # next line for long ones), and no default is stated twice.
    for block in re.split(r"\n(?=  --)", own.split("extract options:", 1)[1])[1:]:
        assert len(block.split(None, 2)) == 3 or "\n" in block, block
        assert block.count("default") <= 1, block
    assert "--help=all" in engine and "ParallelConfig" in engine
    assert "--tensor-parallel-size" not in text  # vLLM's flags: one group at a time


def test_the_command_prints_it_and_vllm_answers_a_group(capsys):
    from vllm_lens.cli import main as cli

    assert cli.main(["extract", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: vllm-lens extract --model")
    with pytest.raises(SystemExit) as done:
        cli.main(["extract", "--help=ParallelConfig"])
    assert done.value.code == 0 and "--tensor-parallel-size" in capsys.readouterr().out


def test_serve_help_lists_every_setting_before_vllms_flags():
    """``vllm-lens serve --help`` (in a process of its own, as a user runs it): the vllm-lens
    settings (every ``VLLM_LENS_*`` variable the package reads), then vLLM's own serve help."""
    import pathlib
    import subprocess
    import sys

    import vllm_lens

    read = set()
    for path in pathlib.Path(vllm_lens.__file__).parent.rglob("*.py"):
        read |= set(re.findall(r"[\"'](VLLM_LENS_[A-Z0-9_]+)[\"']", path.read_text()))
    done = subprocess.run([sys.executable, "-c", "import sys; from vllm_lens.cli import main as cli; "
                           "sys.exit(cli.main(['serve', '--help']))"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    settings, vllm_help = done.stdout.split("usage: vllm serve", 1)
    listed = set(re.findall(r"^  (VLLM_LENS_[A-Z0-9_]+):", settings, flags=re.M))
    assert read - {"VLLM_LENS_"} <= listed, sorted(read - listed)
    assert "--help=all" in vllm_help
