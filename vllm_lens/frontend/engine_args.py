"""Engine configuration: make every engine load the vllm-lens worker extension (runs in: the
process that builds the engine config, i.e. the front end).

``EngineArgs.create_engine_config`` is the one place every engine path (``LLM``, ``AsyncLLM``,
``vllm serve``) turns arguments into a ``VllmConfig``, which then travels to the engine-core
and worker processes. vllm-lens fills in ``worker_extension_cls`` there. It does not touch
``enforce_eager``: the taps are part of the compiled graph.

vLLM caches compiled models on disk under a hash of the config, which does not see that
vllm-lens swapped the decoder layers' classes: a tapped and an untapped compile of the same
model would share an entry, and an engine could load the other kind (then lens requests find
no taps, or plain vLLM meets ops it does not know). A marker in ``additional_config``, which
vLLM hashes, keeps the two apart.

On CUDA, vLLM replays decode steps from CUDA graphs, which would skip the taps' Python
logic; the tap ops are therefore added to the compilation's splitting ops (it then runs
eagerly between graph pieces) and full-graph modes are reduced to piecewise.
"""

from __future__ import annotations

import importlib.metadata
import logging

from vllm.engine.arg_utils import EngineArgs

from vllm_lens._patching import wrap_attribute
from vllm_lens.worker.taps import TAP_OPS

logger = logging.getLogger(__name__)

__all__ = ["WORKER_EXTENSION", "install"]

WORKER_EXTENSION = "vllm_lens.worker.extension.LensWorkerExtension"


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
        _keep_taps_out_of_cuda_graphs(self)
        _mark_compile_cache(self)
        return original(self, *args, **kwargs)

    return create_engine_config


def _version() -> str:
    try:
        return importlib.metadata.version("vllm-lens")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "source"


#: ``additional_config`` entry that separates tapped from untapped compile-cache entries; the
#: version keeps a graph compiled with an older release's tap ops from being loaded.
COMPILE_CACHE_MARKER = ("vllm_lens", f"taps-{_version()}")


def _mark_compile_cache(args: EngineArgs) -> None:
    key, value = COMPILE_CACHE_MARKER
    if isinstance(args.additional_config, dict):
        args.additional_config = {**args.additional_config, key: value}
    else:
        logger.warning("vllm-lens: additional_config is not a dict; disable vLLM's compile "
                       "cache (VLLM_DISABLE_COMPILE_CACHE=1) when this model is also served "
                       "without vllm-lens")


def _keep_taps_out_of_cuda_graphs(args: EngineArgs) -> None:
    from vllm.config import CompilationConfig, CUDAGraphMode
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike() or args.enforce_eager:
        return
    compilation = args.compilation_config
    if isinstance(compilation, dict):
        compilation = args.compilation_config = CompilationConfig(**compilation)
    # None means "vLLM's default", which is the attention ops: keep them, add the taps.
    ops = list(compilation.splitting_ops if compilation.splitting_ops is not None
               else CompilationConfig._attention_ops)
    missing = [op for op in TAP_OPS if op not in ops]
    if missing:
        compilation.splitting_ops = [*ops, *missing]
    mode = compilation.cudagraph_mode
    if mode is None or mode.has_full_cudagraphs():
        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
