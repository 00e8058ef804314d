"""Engine configuration: the worker extension, and compile-cache entries of their own."""

from vllm.engine.arg_utils import EngineArgs

from vllm_lens.frontend.engine_args import WORKER_EXTENSION, compile_cache_marker


def test_tapped_engines_get_the_extension_and_their_own_compile_cache_key(tiny_path):
    import vllm_lens.plugin

    vllm_lens.plugin.register()  # what vLLM does at start-up (idempotent)
    config = EngineArgs(model=tiny_path, additional_config={"mine": 1}).create_engine_config()
    assert config.parallel_config.worker_extension_cls == WORKER_EXTENSION
    key, value = compile_cache_marker()
    assert key == "vllm_lens" and value.startswith("taps-") and "-inner-" in value
    assert config.additional_config == {"mine": 1, key: value}
    tapped_hash = config.compute_hash()
    config.additional_config = {"mine": 1}  # what the same engine without vllm-lens gets
    assert config.compute_hash() != tapped_hash


def test_inner_taps_off_is_another_compile_cache_entry(monkeypatch):
    inner = compile_cache_marker()
    monkeypatch.setenv("VLLM_LENS_INNER_TAPS", "0")
    assert compile_cache_marker() != inner and "-outer-" in compile_cache_marker()[1]
