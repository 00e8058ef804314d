"""``vllm-lens extract --ray``'s checks before anything starts, and the writer names its
engine actors claim: each the first one free, held while it runs, free again after."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from vllm_lens.cli.extract.ray_actors import MAX_ENGINES, check_ray_args, claim_writer


def _args(**fields):
    base = dict(ray=True, num_engines=None, ray_address=None, server=None,
                data_parallel_size=1)
    return SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize("fields, problem", [
    ({"ray": False, "num_engines": 2}, "go with --ray"),
    ({"ray": False, "ray_address": "ray://head:10001"}, "go with --ray"),
    ({"server": "http://127.0.0.1:8000"}, "drop --server"),
    ({"num_engines": 0}, f"1 to {MAX_ENGINES}"),
    ({"num_engines": MAX_ENGINES + 1}, f"1 to {MAX_ENGINES}"),
    ({"data_parallel_size": 2}, "instead of --data-parallel-size"),
])
def test_flags_ray_cannot_honour_are_refused(fields, problem):
    with pytest.raises(SystemExit, match=problem):
        check_ray_args(_args(**fields))


def test_one_engine_unless_told():
    args = _args()
    check_ray_args(args)
    assert args.num_engines == 1


def test_each_actor_claims_the_first_free_writer_name_until_it_lets_go(tmp_path):
    first, held_first = claim_writer(tmp_path)
    second, held_second = claim_writer(tmp_path)
    assert (first, second) == ("ray0", "ray1")
    # Another process (another actor) sees both taken.
    other = subprocess.run(
        [sys.executable, "-c", "import sys, pathlib; from vllm_lens.cli.extract.ray_actors import "
         "claim_writer; print(claim_writer(pathlib.Path(sys.argv[1]))[0])", str(tmp_path)],
        capture_output=True, text=True, check=True)
    assert other.stdout.strip() == "ray2"
    held_first.close()  # an actor that ended: a re-run's actor takes its name again
    again, held_again = claim_writer(tmp_path)
    assert again == "ray0"
    for held in (held_second, held_again):
        held.close()


def test_a_second_job_on_the_same_output_is_refused_while_the_first_runs(tmp_path):
    """The first job holds the output from before its engines start (which take their own
    locks only minutes later) until it exits."""
    from vllm_lens.cli.extract.output import _hold_job_lock

    first = subprocess.Popen(
        [sys.executable, "-c", "import sys, pathlib; from vllm_lens.cli.extract.output import "
         "_hold_job_lock; _hold_job_lock(pathlib.Path(sys.argv[1])); print('held', flush=True);"
         " sys.stdin.read()", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit, match="another job is writing"):
            _hold_job_lock(tmp_path)
    finally:
        first.communicate("")  # the first job ends
    _hold_job_lock(tmp_path)  # and the output is free again
