"""Engine configuration: make every engine load the vllm-lens worker extension (runs in: front end).

``EngineArgs.create_engine_config`` is the one place every engine path (``LLM``, ``AsyncLLM``,
``vllm serve``) turns arguments into a ``VllmConfig``, which then travels to the engine-core
and worker processes. vllm-lens fills in ``worker_extension_cls`` there. It does not touch
``enforce_eager``: the taps are part of the compiled graph.

vLLM caches compiled models on disk under a hash of the config, which does not see that
vllm-lens swapped the decoder layers' classes: a tapped and an untapped compile of the same
model would share an entry, and an engine could load the other kind (then lens requests find
no taps, or plain vLLM meets ops it does not know). A marker in ``additional_config``, which
vLLM hashes, keeps the two apart.

Two vLLM defaults that vllm-lens cannot serve lens requests under are turned off here when
the user left them unset, and logged (``worker.runner`` refuses lens requests when the user
forced them on):

- Model Runner V2 (the CUDA default when Triton is present): ``VLLM_USE_V2_MODEL_RUNNER=0``
  is set in this process's environment, which the engine-core and worker processes inherit
  (taken back, and the config built again, when vLLM says the engine needs V2: then plain
  traffic runs on V2 and lens requests are refused). With an in-process engine core
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) vLLM caches its environment after the first engine
  starts; set the variable yourself before that if several engines share the process;
- async scheduling (the CUDA default): ``async_scheduling=False``.

On CUDA, vLLM replays steps from CUDA graphs, which would skip the taps' Python logic. Once
vLLM has resolved its compilation config, the tap ops are appended to its splitting ops (all
of vLLM's own stay) so the taps run eagerly between graph pieces, and full-graph modes are
reduced to piecewise (``cuda_graph_overrides``). That costs plain traffic the full-graph
speed-up of decode steps too: vLLM picks a step's graph before vllm-lens could tell whether
the step has lens work.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
from typing import Any

from vllm.engine.arg_utils import EngineArgs

from vllm_lens import envs
from vllm_lens.common.wrapping import wrap_attribute
from vllm_lens.common.tap_ops import TAP_OPS

logger = logging.getLogger(__name__)

__all__ = ["V2_RUNNER_ENV", "WORKER_EXTENSION", "cuda_graph_overrides", "install"]

WORKER_EXTENSION = "vllm_lens.worker.extension.LensWorkerExtension"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def install() -> None:
    wrap_attribute(EngineArgs, "create_engine_config", _wrap_create_engine_config)


def _wrap_create_engine_config(original):
    def create_engine_config(self: EngineArgs, *args, **kwargs):
        if not self.worker_extension_cls:
            self.worker_extension_cls = WORKER_EXTENSION
        elif self.worker_extension_cls != WORKER_EXTENSION:
            logger.warning(
                "vllm-lens: worker_extension_cls is already %s; lens requests will fail on "
                "this engine.", self.worker_extension_cls,
            )
        if self.async_scheduling is None:
            self.async_scheduling = False
            _log_once("vllm-lens: async scheduling is off (vllm-lens needs synchronous "
                      "scheduling; an explicit --async-scheduling refuses lens requests)")
        _mark_compile_cache(self)
        chose_v1 = _prefer_v1_runner(self)
        try:
            config = original(self, *args, **kwargs)
        except ValueError as exc:
            if not chose_v1:
                raise
            # Maybe a feature of this engine needs Model Runner V2 (vLLM's messages vary):
            # build it as vLLM alone would; plain traffic must still run. If that fails too,
            # its error is the user's to see.
            _release_v1_choice()
            logger.warning("vllm-lens: this engine needs Model Runner V2 (%s); lens requests "
                           "will be refused on it", exc)
            config = original(self, *args, **kwargs)
        if lens_possible(config):
            for name, value in cuda_graph_overrides(config.compilation_config).items():
                setattr(config.compilation_config, name, value)
        return config

    return create_engine_config


_logged: set[str] = set()
_v1_chosen_by_lens = False
"""Whether ``VLLM_USE_V2_MODEL_RUNNER=0`` in this process was set by vllm-lens (not the user)."""


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def _prefer_v1_runner(args: EngineArgs) -> bool:
    """Unless the user chose a runner, ask for vLLM's V1 model runner (the only one vllm-lens
    reads); the engine-core and worker processes inherit the environment. Returns whether this
    engine runs on vllm-lens's choice.

    Features that need V2 and fail only after the config is built (an encoder-cache transfer
    connector, DFlash drafts) keep vLLM's own choice; V2 engines refuse lens requests."""
    global _v1_chosen_by_lens
    current = os.environ.get(V2_RUNNER_ENV)
    if current is not None and not (_v1_chosen_by_lens and current == "0"):
        _v1_chosen_by_lens = False
        return False  # the user's choice
    speculative = args.speculative_config if isinstance(args.speculative_config, dict) else {}
    if args.ec_transfer_config is not None or speculative.get("method") == "dflash":
        _release_v1_choice()
        return False
    os.environ[V2_RUNNER_ENV] = "0"
    _v1_chosen_by_lens = True
    _log_once(f"vllm-lens: {V2_RUNNER_ENV}=0 (vllm-lens supports vLLM's V1 model runner; "
              f"setting {V2_RUNNER_ENV}=1 yourself refuses lens requests)")
    return True


def _release_v1_choice() -> None:
    global _v1_chosen_by_lens
    if _v1_chosen_by_lens and os.environ.get(V2_RUNNER_ENV) == "0":
        del os.environ[V2_RUNNER_ENV]
    _v1_chosen_by_lens = False


def lens_possible(config: Any) -> bool:
    """Whether lens requests can be served on ``config`` at all. Engines that refuse them
    anyway (Model Runner V2, micro-batching, other speculative methods, LoRA, ...) keep
    vLLM's CUDA-graph settings untouched: plain traffic there pays nothing for vllm-lens."""
    from vllm_lens.common.engine_support import config_unsupported_reason

    try:
        if config.use_v2_model_runner:
            return False
    except ValueError:  # vLLM's own consistency checks: not a lens engine either way
        return False
    return config_unsupported_reason(config) is None


def cuda_graph_overrides(compilation: Any) -> dict[str, Any]:
    """What vllm-lens changes in a *resolved* ``CompilationConfig`` (empty: nothing).

    Without CUDA graphs (CPU, eager, ``cudagraph_mode`` NONE) the taps run inside the compiled
    graph and nothing changes. With them, the tap ops join vLLM's splitting ops (appended,
    vLLM's own kept in order) so piecewise graphs leave the taps out, and full graphs, which
    would replay a whole step without the taps, become piecewise ones. Where vLLM does not
    compile attention piecewise (e.g. ``splitting_ops=[]``, attention fusion), piecewise
    graphs are not allowed, and CUDA graphs are turned off instead.

    >>> from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode
    >>> cuda_graph_overrides(CompilationConfig(cudagraph_mode=CUDAGraphMode.NONE))
    {}
    """
    from vllm.config import CUDAGraphMode

    mode = compilation.cudagraph_mode
    if mode is None or mode == CUDAGraphMode.NONE:
        return {}
    if not compilation.is_attention_compiled_piecewise():
        # vLLM would not compile piecewise around attention (no Dynamo split at attention, no
        # Inductor partition): piecewise graphs around the taps alone are not a mode vLLM
        # accepts, so the taps get no CUDA graphs at all.
        return {"cudagraph_mode": CUDAGraphMode.NONE}
    overrides: dict[str, Any] = {}
    ops = list(compilation.splitting_ops or ())
    missing = [op for op in TAP_OPS if op not in ops]
    if missing:
        overrides["splitting_ops"] = [*ops, *missing]
    if mode.has_full_cudagraphs():
        overrides["cudagraph_mode"] = CUDAGraphMode.PIECEWISE
    return overrides


def _version() -> str:
    try:
        return importlib.metadata.version("vllm-lens")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "source"


def compile_cache_marker() -> tuple[str, str]:
    """``additional_config`` entry that separates tapped from untapped compile-cache entries;
    the version, the set of tap ops in the graph (inner taps on or off) and the layout table
    (where the ops go; it may change without a version change in a source checkout) keep a
    graph compiled with other taps from being loaded."""
    inner = "inner" if envs.inner_taps() else "outer"
    # The table, the derivation of layouts for classes without a row and a test's layout
    # change tap other modules: their sources are hashed, read without importing the worker
    # side into this process.
    sources = b"".join(_module_source(f"vllm_lens.worker.{name}")
                       for name in ("layouts", "layout_derivation"))
    table = hashlib.sha256(sources + repr(envs.test_layout()).encode()).hexdigest()[:12]
    return "vllm_lens", f"taps-{_version()}-{len(TAP_OPS)}ops-{inner}-{table}"


def _module_source(name: str) -> bytes:
    """A module's source, read without importing it (this process builds no model)."""
    spec = importlib.util.find_spec(name)
    with open(spec.origin, "rb") as f:
        return f.read()


def _mark_compile_cache(args: EngineArgs) -> None:
    key, value = compile_cache_marker()
    if isinstance(args.additional_config, dict):
        args.additional_config = {**args.additional_config, key: value}
    else:
        logger.warning("vllm-lens: additional_config is not a dict; disable vLLM's compile "
                       "cache (VLLM_DISABLE_COMPILE_CACHE=1) when this model is also served "
                       "without vllm-lens")
