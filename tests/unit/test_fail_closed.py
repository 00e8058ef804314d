"""Fail closed: the configuration checks, the CUDA compilation overrides and the per-request
worker records, without an engine."""

import os

import pytest
from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode
from vllm.engine.arg_utils import EngineArgs

from vllm_lens import LensRequestError, UnsupportedConfigError
from vllm_lens.frontend import engine_args
from vllm_lens.frontend.engine_args import V2_RUNNER_ENV, cuda_graph_overrides
from vllm_lens.spec import LensRequest, ModelFacts, parse_extra_args
from vllm_lens.worker.request_records import RequestTable
from vllm_lens.worker.runner import unsupported_reason
from vllm_lens.common.tap_ops import TAP_OPS

FACTS = ModelFacts(model_class="LlamaForCausalLM", n_layers=4, hidden_size=128,
                   max_model_len=1024, mapped=True)


# -- CUDA graphs -------------------------------------------------------------------------------
def _resolved(**kwargs) -> CompilationConfig:
    """A compilation config as vLLM resolves it for a CUDA engine (its own default ops)."""
    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, **kwargs)
    config.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    return config


def test_full_and_piecewise_keeps_vllms_ops_and_appends_the_taps():
    config = _resolved(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    vllm_ops = list(config.splitting_ops)
    assert "vllm::unified_kv_cache_update" in vllm_ops  # one of vLLM's own defaults
    overrides = cuda_graph_overrides(config)
    assert overrides["splitting_ops"] == [*vllm_ops, *TAP_OPS]
    assert overrides["cudagraph_mode"] == CUDAGraphMode.PIECEWISE


def test_piecewise_only_gains_the_taps_and_applying_twice_changes_nothing():
    config = _resolved(cudagraph_mode=CUDAGraphMode.PIECEWISE)
    overrides = cuda_graph_overrides(config)
    assert set(overrides) == {"splitting_ops"}
    for name, value in overrides.items():
        setattr(config, name, value)
    assert cuda_graph_overrides(config) == {}


def test_without_piecewise_attention_cuda_graphs_are_turned_off():
    # An empty split list (or attention fusion) compiles attention into the graph: vLLM's
    # dispatcher refuses piecewise graphs then, so no CUDA graphs instead of a broken mode.
    config = _resolved(cudagraph_mode=CUDAGraphMode.FULL, splitting_ops=[])
    assert not config.is_attention_compiled_piecewise()
    assert cuda_graph_overrides(config) == {"cudagraph_mode": CUDAGraphMode.NONE}


def test_full_graphs_without_piecewise_compilation_are_turned_off():
    config = CompilationConfig(mode=CompilationMode.NONE,
                               cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY)
    assert cuda_graph_overrides(config) == {"cudagraph_mode": CUDAGraphMode.NONE}


def test_no_cuda_graphs_no_change():
    assert cuda_graph_overrides(_resolved(cudagraph_mode=CUDAGraphMode.NONE)) == {}


def test_cpu_engine_config_is_left_as_vllm_resolved_it(tiny_path):
    import vllm_lens.plugin

    vllm_lens.plugin.register()
    config = EngineArgs(model=tiny_path).create_engine_config()
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert not set(TAP_OPS) & set(config.compilation_config.splitting_ops or ())
    assert config.scheduler_config.async_scheduling is False


# -- runner and scheduling defaults ------------------------------------------------------------
def test_v2_runner_is_turned_off_only_when_the_user_left_it_unset(monkeypatch):
    monkeypatch.setenv(V2_RUNNER_ENV, "unset below; restored after the test")
    monkeypatch.delenv(V2_RUNNER_ENV)
    monkeypatch.setattr(engine_args, "_v1_chosen_by_lens", False)
    assert engine_args._prefer_v1_runner(EngineArgs(model="m")) is True
    assert os.environ[V2_RUNNER_ENV] == "0"
    assert engine_args._prefer_v1_runner(EngineArgs(model="m")) is True  # still ours
    # Features that need V2 and fail only later keep vLLM's own choice.
    dflash = EngineArgs(model="m", speculative_config={"method": "dflash"})
    assert engine_args._prefer_v1_runner(dflash) is False
    assert V2_RUNNER_ENV not in os.environ
    assert engine_args._prefer_v1_runner(EngineArgs(model="m")) is True
    monkeypatch.setenv(V2_RUNNER_ENV, "1")  # the user's choice, even after one of ours
    assert engine_args._prefer_v1_runner(EngineArgs(model="m")) is False
    engine_args._release_v1_choice()
    assert os.environ[V2_RUNNER_ENV] == "1"


@pytest.fixture(scope="module")
def cpu_config(tiny_path):
    return EngineArgs(model=tiny_path).create_engine_config()


def _runner(qualname: str):
    """An instance of a real vLLM runner class, never initialised: only its class is read."""
    import importlib

    module, _, name = qualname.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    return object.__new__(cls)


V1_CPU = "vllm.v1.worker.cpu_model_runner.CPUModelRunner"


def test_v1_runner_with_synchronous_scheduling_is_supported(cpu_config):
    assert unsupported_reason(cpu_config, _runner(V1_CPU)) is None


def test_model_runner_v2_is_refused_naming_the_setting(cpu_config):
    reason = unsupported_reason(cpu_config, _runner("vllm.v1.worker.cpu.model_runner.CPUModelRunner"))
    assert "Model Runner V2" in reason and V2_RUNNER_ENV in reason


@pytest.mark.parametrize(("setting", "change", "named"), [
    ("async scheduling", lambda c: setattr(c.scheduler_config, "async_scheduling", True),
     "--async-scheduling"),
    ("dual-batch overlap", lambda c: setattr(c.parallel_config, "enable_dbo", True),
     "enable_dbo"),
    ("pooling", lambda c: setattr(c.model_config, "runner_type", "pooling"), "pooling"),
])
def test_unproven_configurations_are_refused_naming_the_setting(cpu_config, setting, change,
                                                                named, monkeypatch):
    import copy

    config = copy.copy(cpu_config)
    for part in ("scheduler_config", "parallel_config", "model_config"):
        object.__setattr__(config, part, copy.copy(getattr(cpu_config, part)))
    change(config)
    reason = unsupported_reason(config, _runner(V1_CPU))
    assert reason is not None and named in reason, setting


def test_other_vllm_versions_and_encoder_decoder_models_are_refused(cpu_config, monkeypatch):
    import copy
    from types import SimpleNamespace

    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    assert "vLLM 0.33.0 is not supported" in unsupported_reason(cpu_config, _runner(V1_CPU))
    monkeypatch.undo()
    config = copy.copy(cpu_config)
    object.__setattr__(config, "model_config",
                       SimpleNamespace(runner_type="generate", is_encoder_decoder=True))
    assert "encoder-decoder" in unsupported_reason(config, _runner(V1_CPU))


def test_speculative_methods_other_than_ngram_are_refused(cpu_config):
    import copy
    from types import SimpleNamespace

    config = copy.copy(cpu_config)
    object.__setattr__(config, "speculative_config", SimpleNamespace(method="eagle3"))
    assert "'eagle3'" in unsupported_reason(config, _runner(V1_CPU))
    object.__setattr__(config, "speculative_config", SimpleNamespace(method="ngram"))
    assert unsupported_reason(config, _runner(V1_CPU)) is None


# -- the front end refuses up front ------------------------------------------------------------
def test_unsupported_engine_refuses_lens_requests_naming_the_reason_and_key():
    facts = ModelFacts(**{**FACTS.__dict__, "unsupported": "this engine runs Model Runner V2"})
    with pytest.raises(UnsupportedConfigError, match="Model Runner V2") as info:
        parse_extra_args({"apply_steering_vectors": "[]"}, lambda: facts)
    assert info.value.field == "apply_steering_vectors"
    rest, lens = parse_extra_args({"other": 1}, lambda: facts)  # plain requests pass
    assert rest == {"other": 1} and lens is None


def test_hooks_are_refused_under_speculative_decoding():
    facts = ModelFacts(**{**FACTS.__dict__, "speculative": True})
    with pytest.raises(UnsupportedConfigError, match="speculative") as info:
        parse_extra_args({"apply_hooks": '[{"name": "linear_probe", "layer_indices": [0], '
                                         '"args": {"weight": [0.0]}}]'}, lambda: facts)
    assert info.value.field == "apply_hooks"
    _, lens = parse_extra_args({"output_residual_stream": [1]}, lambda: facts)
    assert lens.capture.layers == (1,)


def test_fault_key_needs_the_test_switch(monkeypatch):
    monkeypatch.setenv("VLLM_LENS_TEST_FAULTS", "0")
    with pytest.raises(LensRequestError, match="test suite only") as info:
        parse_extra_args({"output_residual_stream": [0], "lens_test_fault": "plan"},
                         lambda: FACTS)
    assert info.value.field == "lens_test_fault"
    monkeypatch.setenv("VLLM_LENS_TEST_FAULTS", "1")
    _, lens = parse_extra_args({"output_residual_stream": [0], "lens_test_fault": "steer"},
                               lambda: FACTS)
    assert LensRequest.from_payload(lens.to_payload()).fault == "steer"


# -- worker records ----------------------------------------------------------------------------
def _payload(key: str) -> dict:
    return LensRequest(key=key).to_payload()


def test_record_lifecycle_created_finished_removed():
    table = RequestTable(finished_ttl_s=60)
    assert table.lookup("plain", None) is None and len(table) == 0
    record = table.lookup("r1", _payload("k1"))
    assert table.lookup("r1", None) is record  # created once, on the first step
    record.steer = []
    table.finish_gone(live={"r1"})
    assert record.finished_at is None
    table.finish_gone(live=set())  # the runner dropped it: finished, device state freed
    assert record.finished_at is not None and record.steer is None and len(table) == 1
    assert table.pop("k1") == {"r1": record} and len(table) == 0
    assert table.lookup("r1", _payload("k1")) is None  # a surplus step after the fetch


def test_unclaimed_finished_records_expire():
    table = RequestTable(finished_ttl_s=0)
    table.lookup("r1", _payload("k1"))
    table.finish_gone(live=set())
    table.finish_gone(live=set())
    assert len(table) == 0


def test_capture_reservations_refuse_the_newcomer_and_come_back_when_records_go():
    table = RequestTable(finished_ttl_s=60, max_bytes=100)

    def lens(key: str, size: int) -> dict:
        return LensRequest(key=key, reserve_bytes=size).to_payload()

    first = table.lookup("r1", lens("k1", 60))
    steered_only = table.lookup("r0", lens("k0", 0))  # no capture: reserves nothing
    assert first.error is None and steered_only.error is None and table.reserved_bytes == 60
    late = table.lookup("r2", lens("k2", 41))  # 60 + 41 > 100: the newcomer is refused
    assert "could hold up to 41 bytes" in late.refused and late.error is None
    assert "reserved 60 of VLLM_LENS_WORKER_MAX_BYTES (100 bytes)" in late.refused
    assert late.capacity == "VLLM_LENS_WORKER_MAX_BYTES"
    # It runs without its captures (its steering and hooks still run) and reserves nothing.
    assert late.running_lens.reserve_bytes == 41 and not late.running_lens.captures
    assert first.refused is None and first.running_lens is first.lens
    assert table.reserved_bytes == 60  # the running one keeps its share
    assert table.lookup("r3", lens("k3", 40)).refused is None and table.reserved_bytes == 100
    table.finish_gone(live={"r3"})  # finished, not yet fetched: its rows are still held
    assert table.reserved_bytes == 100
    table.pop("k1")  # fetched: its reservation comes back
    assert table.lookup("r4", lens("k4", 60)).refused is None and table.reserved_bytes == 100
    # A failed record keeps its share until it is fetched or expires: every rank counts the
    # same records, whichever rank the failure happened on.
    table.records["r4"].fail("boom", "capture")
    assert table.reserved_bytes == 100
    table.pop("k4")
    assert table.reserved_bytes == 40


def test_missing_rows_are_an_error_unless_a_worker_saw_the_request():
    from vllm_lens.frontend.collator import _missing_rows

    import torch

    assert _missing_rows((1, 3), None, seen=True) is None  # nothing selected
    assert "lost" in _missing_rows((1, 3), None, seen=False)
    one_stage = [({"layers": [1]}, torch.zeros(1, 2, 4))]
    assert "layers [3]" in _missing_rows((1, 3), one_stage, seen=True)
    both = one_stage + [({"layers": [3]}, torch.zeros(1, 2, 4))]
    assert _missing_rows((1, 3), both, seen=True) is None
