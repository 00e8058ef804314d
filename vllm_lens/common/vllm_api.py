"""Everything vllm-lens needs from vLLM, in one table, checked once at start-up (runs in: any).

vllm-lens imports, wraps, patches, subclasses and reads vLLM symbols that vLLM does not
promise to keep: a vLLM upgrade breaks exactly these. ``REGISTRY`` names each one (the
``module:qualname`` of the symbol, what it is, the vllm-lens modules that use it, and why),
with the parameters vllm-lens passes or receives by name. ``check`` compares the table with the
vLLM this process imported and returns what differs; ``unsupported_reason`` does that once
per process and says, naming the first missing symbol, why lens requests must be refused
(plain traffic is not vllm-lens's to refuse).

What each check proves:

- ``module``: the module imports.
- ``class`` / ``function`` / ``method`` / ``attribute``: the dotted name resolves by ``getattr``
  from the module (a class, something callable, anything); for callables, every name in
  ``params`` is a parameter of ``inspect.signature`` (present by name, nothing about types or
  defaults).
- ``instance attribute``: the class, or one of its bases defined in vLLM, declares the name: a
  class attribute or property, an annotation (dataclass, msgspec and pydantic fields), or an
  assignment ``self.<name> = ...`` / ``self.<name>: T = ...`` in one of its methods, read from
  the class's source with ``ast`` (``declared_members``). This proves the class's code sets it
  on some path, not that every instance has it when vllm-lens reads it.

``startup`` says where ``unsupported_reason`` checks an entry: ``"always"`` entries (modules
every process that registers the plugin imports anyway) everywhere; ``"worker"`` entries (the
runner's and the model's internals) in a worker, importing them, and elsewhere only if their
module is already imported (the front end would pay seconds to import the worker stack);
``"if loaded"`` entries (the HTTP server stack, vllm-lens's own commands, backends of one
platform) only in a process that already imported their module. ``optional`` entries are used
only where present (vllm-lens checks for them first): ``check`` reports them,
``unsupported_reason`` does not refuse for them.

The table is long because it is the whole list; a new use of vLLM joins it (a unit test scans
the package's imports and fails on one that is missing).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import sys
import textwrap
from collections.abc import Iterable
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["KINDS", "REGISTRY", "Need", "Problem", "check", "check_one", "declared_members",
           "resolve", "unsupported_reason"]

Kind = Literal["module", "class", "function", "method", "attribute", "instance attribute"]
Use = Literal["import", "call", "wrap", "patch", "subclass", "read"]
KINDS: tuple[str, ...] = ("module", "class", "function", "method", "attribute",
                          "instance attribute")


@dataclass(frozen=True)
class Need:
    """One vLLM symbol vllm-lens depends on."""

    symbol: str
    """``module:qualname`` (``module`` alone for a module), e.g.
    ``vllm.v1.worker.gpu_model_runner:GPUModelRunner.input_batch``."""
    kind: Kind
    use: Use
    """How vllm-lens depends on it: imports it, calls it, wraps it (``_patching``), adds
    attributes to it (patch), subclasses it, or reads it."""
    used_by: tuple[str, ...]
    """vllm-lens modules that use it (relative to ``vllm_lens``)."""
    why: str
    params: tuple[str, ...] = ()
    """Parameters vllm-lens passes or receives by name (callables only)."""
    startup: Literal["always", "worker", "if loaded"] = "always"
    optional: bool = False

    @property
    def module(self) -> str:
        return self.symbol.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.symbol.partition(":")[2]


@dataclass(frozen=True)
class Problem:
    """What differs between one entry and the vLLM at hand."""

    need: Need
    problem: str

    def __str__(self) -> str:
        return f"{self.need.symbol} ({self.need.kind}): {self.problem}"


def _n(symbol: str, kind: Kind, use: Use, used_by: str, why: str, params: str = "",
       **options: Any) -> Need:
    return Need(symbol, kind, use, tuple(used_by.split()), why, tuple(params.split()),
                **options)


_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_BATCH = "vllm.v1.worker.gpu_input_batch"
_LLM = "vllm.entrypoints.llm:LLM"
_ASYNC = "vllm.v1.engine.async_llm:AsyncLLM"
_SYNC = "vllm.v1.engine.llm_engine:LLMEngine"
_CORE = "vllm.v1.engine.core:EngineCore"
_CLIENT = "vllm.v1.engine.core_client"
_ARGS = "vllm.engine.arg_utils:EngineArgs"
_CFG = "vllm.config"
_ATTN = "vllm.model_executor.layers.attention.attention:Attention"
_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl"
_FLASH = "vllm.v1.attention.backends.flash_attn:FlashAttentionImpl"
_SERVE = "vllm.entrypoints.cli.serve"
_LOADED = {"startup": "if loaded"}
_WORKER = {"startup": "worker"}

#: Every vLLM symbol vllm-lens depends on.
REGISTRY: tuple[Need, ...] = (
    # -- the package itself --------------------------------------------------------------------
    _n("vllm:__version__", "attribute", "read", "worker.runner worker.sink_writes",
       "the release series vllm-lens supports; written into each dataset's settings"),
    _n("vllm:LLM", "class", "import", "frontend.engine_methods frontend.patching_sweep cli.main "
       "cli.extract.ray_actors",
       "the offline engine vllm-lens adds methods to and that its commands run"),
    _n("vllm:SamplingParams", "class", "import", "frontend.session frontend.offline "
       "frontend.patching_sweep cli.main cli.extract.ray_actors",
       "requests carry lens keys in its extra_args"),
    # -- requests and outputs ------------------------------------------------------------------
    _n("vllm.sampling_params:SamplingParams.extra_args", "instance attribute", "read",
       "frontend.session frontend.prefix_cache worker.runner",
       "the lens keys going in, the validated payload going to the worker"),
    _n("vllm.sampling_params:SamplingParams.n", "instance attribute", "read",
       "frontend.session", "samples per request (streaming and sinks need one)"),
    _n("vllm.sampling_params:SamplingParams.max_tokens", "instance attribute", "read",
       "frontend.session", "bounds a capture's reservation"),
    _n("vllm.sampling_params:SamplingParams.output_kind", "instance attribute", "read",
       "frontend.async_engine", "DELTA outputs need a running token count"),
    _n("vllm.sampling_params:SamplingParams.skip_reading_prefix_cache", "instance attribute",
       "read", "frontend.session", "prompt rows must be computed, not read from the cache"),
    _n("vllm.sampling_params:SamplingParams.clone", "method", "call", "frontend.session",
       "the engine gets a copy; the caller's params are never changed"),
    _n("vllm.sampling_params:RequestOutputKind.DELTA", "attribute", "read",
       "frontend.async_engine", "recognises streamed deltas"),
    _n("vllm.outputs:RequestOutput", "class", "patch", "frontend.collator frontend.async_engine",
       "gets the lens output fields (activations, ...) as class attributes"),
    *(_n(f"vllm.outputs:RequestOutput.{name}", "instance attribute", "read",
         "frontend.offline frontend.async_engine", "finished requests' ids and token counts")
      for name in ("request_id", "finished", "prompt_token_ids", "outputs")),
    _n("vllm.outputs:CompletionOutput", "class", "patch", "frontend.collator",
       "gets the lens output fields as class attributes"),
    *(_n(f"vllm.outputs:CompletionOutput.{name}", "instance attribute", "read",
         "frontend.offline frontend.async_engine", "each sample's index and generated tokens")
      for name in ("index", "token_ids")),
    _n("vllm.v1.engine:EngineCoreRequest", "class", "import",
       "frontend.offline frontend.async_engine", "an input already processed into a request"),
    _n("vllm.v1.engine:EngineCoreRequest.sampling_params", "instance attribute", "read",
       "frontend.offline frontend.async_engine frontend.prefix_cache",
       "the params of a processed request (replaced by the validated copy)"),
    _n("vllm.v1.engine:EngineCoreRequest.cache_salt", "instance attribute", "read",
       "frontend.prefix_cache", "steered requests' prefix-cache salt"),
    _n("vllm.inputs:TokensPrompt", "class", "call", "frontend.patching_sweep",
       "patching sweeps send token ids"),
    _n("vllm.inputs:TokensPrompt.prompt_token_ids", "instance attribute", "read",
       "frontend.patching_sweep frontend.session", "the key of a tokenized prompt"),
    # -- offline engine ------------------------------------------------------------------------
    _n(f"{_LLM}.generate", "method", "call", "frontend.patching_sweep", "runs a sweep's requests",
       "prompts sampling_params use_tqdm"),
    _n(f"{_LLM}.get_tokenizer", "method", "call", "frontend.patching_sweep",
       "tokenizes a sweep's prompt"),
    _n(f"{_LLM}.llm_engine", "instance attribute", "read",
       "frontend.offline frontend.patching_sweep cli.extract.engine_stop",
       "the engine behind an LLM"),
    _n("vllm.entrypoints.common.offline:OfflineInferenceMixin._render_and_add_requests",
       "method", "wrap", "frontend.offline",
       "checks every request of an LLM.generate call before any runs", "prompts params"),
    _n(f"{_SYNC}.add_request", "method", "wrap", "frontend.offline",
       "validates lens keys before a request enters the engine", "request_id prompt params"),
    _n(f"{_SYNC}.step", "method", "wrap", "frontend.offline",
       "fetches finished requests' rows in the step that finishes them"),
    _n(f"{_SYNC}.abort_request", "method", "wrap", "frontend.offline",
       "releases aborted requests' rows", "request_ids internal"),
    _n(f"{_SYNC}.collective_rpc", "method", "call", "frontend.offline frontend.patching_sweep",
       "reaches the workers' lens_* methods", "method args"),
    _n(f"{_SYNC}.model_config", "instance attribute", "read", "frontend.patching_sweep",
       "the model a sweep runs on"),
    _n(f"{_SYNC}.engine_core", "instance attribute", "read", "cli.extract.engine_stop",
       "the engine-core client to shut down"),
    # -- async engine --------------------------------------------------------------------------
    _n(_ASYNC, "class", "patch", "frontend.async_engine frontend.engine_methods "
       "frontend.patching_sweep cli.extract.dp", "gets lens methods; serves lens requests"),
    _n(f"{_ASYNC}.generate", "method", "wrap", "frontend.async_engine",
       "validates lens keys and attaches rows to outputs", "prompt sampling_params request_id"),
    _n(f"{_ASYNC}.collective_rpc", "method", "call", "frontend.rpc",
       "reaches the workers' lens_* methods", "method args"),
    _n(f"{_ASYNC}.from_engine_args", "method", "call", "cli.extract.dp",
       "starts a data-parallel extraction engine"),
    _n(f"{_ASYNC}.get_tokenizer", "method", "call", "frontend.patching_sweep",
       "tokenizes a sweep's prompt"),
    _n(f"{_ASYNC}.shutdown", "method", "wrap", "cli.extract.engine_stop frontend.async_engine",
       "stops an engine; a stop on purpose is marked, so the lens calls it cuts end cancelled",
       "timeout"),
    *(_n(f"{_ASYNC}.{name}", "instance attribute", "read", "frontend.rpc frontend.patching_sweep "
         "cli.extract.engine_stop", "the engine-core client, model and output task")
      for name in ("engine_core", "model_config", "output_handler")),
    *(_n(f"{_ASYNC}.{name}", "attribute", "read", "frontend.rpc",
         "a pipelined call ends once the engine is dead") for name in ("errored", "dead_error")),
    _n(f"{_CLIENT}:AsyncMPClient.call_utility_async", "method", "call", "frontend.rpc",
       "the engine core's lens_pipelined_rpc"),
    _n(f"{_CLIENT}:AsyncMPClient.call_utility_all_async", "method", "call", "frontend.rpc",
       "every data-parallel engine's workers"),
    _n(f"{_CLIENT}:MPClient.core_engines", "instance attribute", "read", "frontend.rpc",
       "how many data-parallel engines answer"),
    _n("vllm.v1.engine.exceptions:EngineDeadError", "class", "import", "frontend.async_engine",
       "a lens call that finds the engine stopped"),
    _n(f"{_CLIENT}:MPClient.shutdown", "method", "call", "cli.extract.engine_stop",
       "stops an engine",
       "timeout", **_LOADED),
    _n(f"{_CLIENT}:MPClient.resources", "instance attribute", "read", "cli.extract.engine_stop",
       "what is left to release after a failed shutdown", **_LOADED),
    _n(f"{_CLIENT}:BackgroundResources.engine_manager", "instance attribute", "read",
       "cli.extract.engine_stop", "the engine processes to kill", **_LOADED),
    _n("vllm.v1.engine.utils:CoreEngineProcManager.processes", "instance attribute", "read",
       "cli.extract.engine_stop", "the engine processes to kill", **_LOADED),
    _n("vllm.utils.async_utils:cancel_task_threadsafe", "function", "call",
       "cli.extract.engine_stop",
       "stops an AsyncLLM's output task after a failed shutdown", **_LOADED),
    # -- prefix cache --------------------------------------------------------------------------
    _n("vllm.v1.engine.input_processor:InputProcessor.process_inputs", "method", "wrap",
       "frontend.prefix_cache", "salts steered requests' prefix-cache hashes"),
    *(_n(f"{module}:generate_block_hash_extra_keys", "function", "wrap",
         "frontend.prefix_cache", "decode-steered blocks get a hash of their own (the name "
         "this module bound)", "request start_token_idx end_token_idx start_mm_idx")
      for module in ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.block_pool")),
    _n("vllm.v1.simple_kv_offload.manager:generate_block_hash_extra_keys", "function", "wrap",
       "frontend.prefix_cache", "the KV offload manager reports the same keys",
       "request start_token_idx end_token_idx start_mm_idx", optional=True, **_LOADED),
    *(_n(f"vllm.v1.request:Request.{name}", "instance attribute", "read",
         "frontend.prefix_cache", "the block hasher's request: prompt length and payload")
      for name in ("num_prompt_tokens", "sampling_params")),
    # -- engine core ---------------------------------------------------------------------------
    _n(_CORE, "class", "patch", "engine_core.pipelined_rpc", "gets lens_pipelined_rpc"),
    *(_n(f"{_CORE}.{name}", "instance attribute", "read", "engine_core.pipelined_rpc",
         "the executor, scheduler and idle callbacks a pipelined call uses")
      for name in ("model_executor", "scheduler", "_idle_state_callbacks")),
    _n(f"{_CORE}.is_scheduler_paused", "method", "call", "engine_core.pipelined_rpc",
       "a paused engine does not step: the call blocks"),
    _n("vllm.v1.core.sched.interface:SchedulerInterface.has_requests", "method", "call",
       "engine_core.pipelined_rpc", "an engine without requests does not step: the call blocks"),
    _n("vllm.v1.executor.multiproc_executor:MultiprocExecutor", "class", "import",
       "engine_core.pipelined_rpc", "the one executor whose non-blocking RPC is pipelined",
       **_LOADED),
    _n("vllm.v1.executor.multiproc_executor:MultiprocExecutor.collective_rpc", "method",
       "call", "engine_core.pipelined_rpc", "a future for the workers' answers",
       "method args non_block",
       **_LOADED),
    _n("vllm.v1.executor.abstract:Executor.is_sleeping", "attribute", "read",
       "engine_core.pipelined_rpc", "a sleeping engine does not step"),
    # -- engine configuration ------------------------------------------------------------------
    _n(f"{_ARGS}.create_engine_config", "method", "wrap", "frontend.engine_args",
       "every engine gets the worker extension; V2 runner and async scheduling off"),
    _n(f"{_ARGS}.add_cli_args", "method", "call", "cli.main cli.extract.args",
       "vllm-lens extract takes every engine flag"),
    *(_n(f"{_ARGS}.{name}", "instance attribute", "read", "frontend.engine_args",
         "the settings vllm-lens fills in or reads before the config is built")
      for name in ("worker_extension_cls", "async_scheduling", "speculative_config",
                   "ec_transfer_config")),
    _n("vllm.engine.arg_utils:AsyncEngineArgs", "class", "call", "cli.extract.dp",
       "the data-parallel extraction engine's arguments"),
    _n("vllm.utils.argparse_utils:FlexibleArgumentParser", "class", "call",
       "cli.main cli.extract.args cli.serve", "vLLM's own flag parser for its flags"),
    _n(f"{_CFG}:CUDAGraphMode", "class", "import", "frontend.engine_args",
       "CUDA graphs must leave the taps out"),
    *(_n(f"{_CFG}:CUDAGraphMode.{name}", "attribute", "read", "frontend.engine_args",
         "the CUDA graph modes vllm-lens sets") for name in ("NONE", "PIECEWISE")),
    _n(f"{_CFG}:CUDAGraphMode.has_full_cudagraphs", "method", "call", "frontend.engine_args",
       "full graphs become piecewise"),
    *(_n(f"{_CFG}:CompilationConfig.{name}", "instance attribute", "read",
         "frontend.engine_args", "the tap ops join the splitting ops")
      for name in ("cudagraph_mode", "splitting_ops")),
    _n(f"{_CFG}:CompilationConfig.is_attention_compiled_piecewise", "method", "call",
       "frontend.engine_args", "whether piecewise graphs are allowed at all"),
    _n(f"{_CFG}:VllmConfig.use_v2_model_runner", "attribute", "read", "frontend.engine_args",
       "Model Runner V2 engines refuse lens requests"),
    *(_n(f"{_CFG}:VllmConfig.{name}", "instance attribute", "read",
         "frontend.engine_args common.engine_support worker.extension worker.taps",
         "the parts of the engine config vllm-lens judges")
      for name in ("compilation_config", "scheduler_config", "model_config",
                   "parallel_config", "speculative_config")),
    _n(f"{_CFG}:CompilationMode", "class", "import", "worker.block_inputs",
       "a model compiled whole cannot have its blocks' inputs recorded"),
    _n(f"{_CFG}:CompilationMode.STOCK_TORCH_COMPILE", "attribute", "read",
       "worker.block_inputs", "the mode that compiles the whole model with torch.compile"),
    _n(f"{_CFG}:CompilationConfig.mode", "instance attribute", "read", "worker.block_inputs",
       "whether the runner compiles the whole model"),
    _n("vllm.compilation.decorators:support_torch_compile", "function", "patch",
       "worker.block_inputs",
       "its modules' do_not_compile is set for the start-up check's eager pass, then reset"),
    _n(f"{_CFG}:get_current_vllm_config_or_none", "function", "call", "worker.taps",
       "tells a draft model from the target"),
    *(_n(f"{_CFG}:SpeculativeConfig.{name}", "instance attribute", "read",
         "common.engine_support worker.taps",
         "only n-gram drafts are supported; drafts stay untapped")
      for name in ("method", "draft_model_config", "target_model_config")),
    _n(f"{_CFG}:SchedulerConfig.async_scheduling", "instance attribute", "read",
       "common.engine_support", "async scheduling is refused"),
    *(_n(f"{_CFG}:ModelConfig.{name}", "instance attribute", "read",
         "common.engine_support worker.describe",
         "supported model kinds; the model's facts sent to the front end")
      for name in ("runner_type", "dtype", "max_model_len", "hf_text_config", "model")),
    _n(f"{_CFG}:ModelConfig.is_encoder_decoder", "attribute", "read", "common.engine_support",
       "encoder-decoder models are refused"),
    *(_n(f"{_CFG}:ModelConfig.{name}", "method", "call", "worker.describe",
         "the model's facts sent to the front end", params)
      for name, params in (("get_hidden_size", ""),
                           ("get_num_attention_heads", "parallel_config"),
                           ("get_total_num_kv_heads", ""))),
    _n(f"{_CFG}:ParallelConfig.use_ubatching", "attribute", "read", "common.engine_support",
       "micro-batching is refused"),
    *(_n(f"{_CFG}:ParallelConfig.{name}", "instance attribute", "read",
         "worker.extension worker.sink_writes", "ranks and the dataset writer's name")
      for name in ("data_parallel_size", "data_parallel_index", "data_parallel_external_lb",
                   "data_parallel_hybrid_lb", "pipeline_parallel_size")),
    # -- worker: runner internals (read by worker.runner alone) --------------------------------
    _n("vllm.v1.worker.gpu_worker:Worker.model_runner", "instance attribute", "read",
       "worker.extension", "the runner the extension reads"),
    _n("vllm.v1.worker.worker_base:WorkerBase.vllm_config", "instance attribute", "read",
       "worker.extension", "the engine config the worker judges"),
    _n(_RUNNER, "class", "read", "worker.runner", "the V1 runner whose state is read"),
    _n(f"{_RUNNER}._dummy_run", "method", "call", "worker.layout_check",
       "the layout check's forward pass on the model's own weights",
       "num_tokens cudagraph_runtime_mode force_attention randomize_inputs skip_eplb",
       **_WORKER),
    _n("vllm.distributed.parallel_state:GroupCoordinator.is_last_rank", "attribute", "read",
       "worker.layout_check", "only the last pipeline stage holds the final norm", **_WORKER),
    _n("vllm.v1.worker.gpu", "module", "read", "worker.runner",
       "Model Runner V2's package: its runners are refused by name", optional=True,
       **_LOADED),
    _n("vllm.v1.worker.cpu_model_runner:CPUModelRunner", "class", "read", "worker.runner",
       "the V1 runner of the CPU build", **_LOADED),
    *(_n(f"{_RUNNER}.{name}", "instance attribute", "read",
         "worker.runner worker.extension worker.sink_writes",
         "the running step's batch, row offsets and request states; the model and config")
      for name in ("input_batch", "query_start_loc", "requests", "model_config",
                   "vllm_config")),
    _n(f"{_RUNNER}.get_model", "method", "call", "worker.extension worker.tap_handler",
       "the loaded model (taps, parameters)"),
    _n("vllm.v1.utils:CpuGpuBuffer.np", "instance attribute", "read", "worker.runner",
       "host mirror of query_start_loc: reading it never syncs"),
    *(_n(f"{_BATCH}:InputBatch.{name}", "attribute", "read", "worker.runner",
         "the scheduled requests in row order") for name in ("req_ids", "num_reqs")),
    _n(f"{_BATCH}:InputBatch.num_computed_tokens_cpu", "instance attribute", "read",
       "worker.runner", "each request's first absolute position in the step"),
    _n(f"{_BATCH}:InputBatch.req_id_to_index", "instance attribute", "read", "worker.runner",
       "a request's row in the logits its step samples from (monitors)"),
    _n(f"{_RUNNER}._sample", "method", "wrap", "worker.runner",
       "a stop monitor forces the end-of-sequence token before the step samples",
       "logits"),
    _n("vllm.sampling_params:SamplingParams.eos_token_id", "attribute", "read",
       "worker.runner", "the token a stop monitor ends a generation with"),
    *(_n(f"{_BATCH}:CachedRequestState.{name}", "instance attribute", "read",
         "worker.runner", "a request's payload and prompt length")
      for name in ("sampling_params", "num_prompt_tokens")),
    _n("vllm.forward_context:get_forward_context", "function", "call", "worker.tap_handler",
       "one forward context per step marks the step"),
    _n("vllm.forward_context:is_forward_context_available", "function", "call",
       "worker.tap_handler", "taps outside a step do nothing"),
    *(_n(f"vllm.distributed:{name}", "function", "call", "worker.extension",
         "this worker's tensor- and pipeline-parallel ranks")
      for name in ("get_pp_group", "get_tensor_model_parallel_rank",
                   "get_tensor_model_parallel_world_size")),
    _n("vllm.distributed.parallel_state:GroupCoordinator.rank_in_group", "instance attribute",
       "read", "worker.extension", "this worker's pipeline stage"),
    _n("vllm.distributed:tensor_model_parallel_all_gather", "function", "call",
       "worker.hooks", "whole parameters for hooks under tensor parallelism", "dim"),
    # -- worker: the model -----------------------------------------------------------------------
    _n("vllm.model_executor.model_loader.utils:get_model_architecture", "function", "wrap",
       "worker.taps", "every model class vLLM builds becomes its tapped subclass",
       "model_config"),
    _n("vllm.model_executor.models.utils:PPMissingLayer", "class", "import", "worker.taps",
       "layers another pipeline stage owns"),
    _n(_ATTN, "class", "import", "worker.taps", "the attention module whose kernel is tapped"),
    _n("vllm.model_executor.layers.attention.mla_attention:MLAAttention", "class", "import",
       "worker.layout_derivation worker.layout_check",
       "latent attention locates a derived layout's attention block"),
    _n("vllm.model_executor.layers.attention.mla_attention:MLAAttention.forward_impl",
       "method", "wrap", "worker.layout_check",
       "the latent kernel's output in the start-up check's pass (wrapped per instance)",
       "q k_c_normed k_pe kv_cache attn_metadata output"),
    _n("vllm.model_executor.layers.mamba.abstract:MambaBase", "class", "import",
       "worker.layout_derivation",
       "layers with recurrent state: no layout derived, the start-up check does not run"),
    *(_n(f"{_ATTN}.{name}", "instance attribute", "read", "worker.taps worker.attention_taps",
         "the kernel, K sharing, query quantization, layer name, KV cache dtype")
      for name in ("impl", "kv_sharing_target_layer_name", "query_quant", "layer_name",
                   "kv_cache_dtype")),
    _n("vllm.v1.attention.backend:AttentionImpl.forward", "method", "wrap",
       "worker.attention_taps", "Q, K and the kernel's output (wrapped per instance)",
       "layer query key value kv_cache attn_metadata output output_scale"),
    *(_n(f"{impl}.{name}", "instance attribute", "read", "worker.attention_taps",
         "what rebuilding the attention pattern needs", **options)
      for impl, options in ((_CPU_ATTN, _LOADED), (_FLASH, _LOADED))
      for name in ("scale", "num_heads", "num_kv_heads", "head_size")),
    *(_n(f"{_CPU_ATTN}.{name}", "instance attribute", "read", "worker.attention_taps",
         "windows, ALiBi, sinks and soft caps of the attention pattern", optional=True,
         **_LOADED)
      for name in ("sliding_window", "alibi_slopes", "sinks", "logits_soft_cap")),
    *(_n(f"vllm.model_executor.layers.linear:{name}", "class", "import", "worker.hooks",
         "the dimension a tensor-parallel weight is split along")
      for name in ("ColumnParallelLinear", "RowParallelLinear")),
    *(_n(f"vllm.model_executor.layers.linear:LinearBase.{name}", "instance attribute", "read",
         "worker.taps", "d_mlp and whether the input is quantized")
      for name in ("input_size", "quant_method")),
    _n("vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding", "class",
       "import", "worker.hooks", "vocab-parallel weights are split on dim 0"),
    _n("vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding"
       ".org_vocab_size", "instance attribute", "read", "worker.hooks",
       "the padding to cut after gathering"),
    _n("vllm.model_executor.layers.fusion.quant_activation:get_input_quant_key", "function",
       "call", "worker.taps", "a fused act+quant kernel skips the activation module",
       optional=True),
    # -- LoRA: vLLM's PyTorch ops skip tokens without an adapter (common.lora_guard) ----------
    _n("vllm.platforms:current_platform", "attribute", "read", "common.lora_guard",
       "which LoRA wrapper this platform runs"),
    _n("vllm.platforms.interface:Platform.get_punica_wrapper", "method", "call",
       "common.lora_guard", "the qualified name of the platform's LoRA wrapper"),
    _n("vllm.utils.import_utils:resolve_obj_by_qualname", "function", "call",
       "common.lora_guard", "resolves that name as vLLM does", "qualname"),
    _n("vllm.lora.punica_wrapper.punica_cpu:PunicaWrapperCPU", "class", "read",
       "common.lora_guard", "platforms whose wrapper is (a subclass of) it run the PyTorch ops"),
    *(_n(f"{home}:{op}", "function", "wrap", "common.lora_guard",
         "indexes the adapter weights with the slot -1 of a token without an adapter",
         f"inputs lora_b_weights output_tensor lora_indices_tensor {rest}")
      for home in ("vllm.lora.ops.torch_ops.lora_ops", "vllm.lora.ops.torch_ops",
                   "vllm.lora.punica_wrapper.punica_cpu")
      for op, rest in (("bgmv_shrink", "scaling"), ("bgmv_expand", "add_inputs"),
                       ("bgmv_expand_slice", "slice_offset slice_size add_inputs"))),
    # -- the OpenAI server (only where it runs) ------------------------------------------------
    _n("vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion.create_completion",
       "method", "wrap", "frontend.http.endpoints", "completions return activations",
       "request raw_request", **_LOADED),
    _n("vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat"
       ".create_chat_completion", "method", "wrap", "frontend.http.endpoints",
       "chat completions return activations", "request raw_request", **_LOADED),
    *(_n(f"{cls}.engine_client", "instance attribute", "read", "frontend.http.endpoints",
         "the engine a route validates against", **_LOADED)
      for cls in ("vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion",
                  "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat")),
    *(_n(f"vllm.entrypoints.openai.{mod}.protocol:{cls}.vllm_xargs", "instance attribute",
         "read", "frontend.http.endpoints", "lens keys of an HTTP request", **_LOADED)
      for mod, cls in (("completion", "CompletionRequest"),
                       ("chat_completion", "ChatCompletionRequest"))),
    _n("vllm.entrypoints.openai.responses.serving:OpenAIServingResponses.create_responses",
       "method", "wrap", "frontend.http.install", "refuses lens keys it would drop",
       "request raw_request", **_LOADED),
    _n("vllm.entrypoints.anthropic.serving:AnthropicServingMessages.create_messages",
       "method", "wrap", "frontend.http.install", "refuses lens keys it would drop",
       "request raw_request", **_LOADED),
    _n("vllm.entrypoints.launchers.app:register_api_routers", "function", "wrap",
       "frontend.http.install", "adds the /v1/lens, hooks and steering routes", "args app",
       **_LOADED),
    _n("vllm.entrypoints.launchers.api_server.entry:build_async_engine_client", "function",
       "wrap", "frontend.http.install", "checks the SAE file before the engine starts",
       **_LOADED),
    _n("vllm.entrypoints.launchers.api_server.entry:init_app_state", "function", "wrap",
       "frontend.http.install", "registers SAEs and presets before serving",
       "engine_client state args", **_LOADED),
    _n(_SERVE, "module", "import", "frontend.http.install cli.serve", "vLLM's serve command",
       **_LOADED),
    _n(f"{_SERVE}:run_multi_api_server", "function", "wrap", "frontend.http.install",
       "API processes share one directory", "args", **_LOADED),
    _n(f"{_SERVE}:ServeSubcommand", "class", "call", "cli.serve", "vllm-lens serve runs it",
       **_LOADED),
    *(_n(f"{_SERVE}:ServeSubcommand.{name}", "method", "wrap" if name == "validate" else "call",
         "frontend.http.install cli.serve", "vllm-lens serve runs vLLM's serve command", params,
         **_LOADED)
      for name, params in (("validate", "args"), ("cmd", "args"),
                           ("subparser_init", "subparsers"))),
    _n("vllm.entrypoints.serve.utils.api_utils:cli_env_setup", "function", "call", "cli.serve",
       "what vllm serve sets up first", **_LOADED),
    _n("vllm.entrypoints.serve.exception_handling.error_response:create_error_response",
       "function", "call", "frontend.http.errors", "vLLM's error bodies",
       "message err_type status_code param"),
    _n("vllm.entrypoints.serve.engine.protocol:ErrorResponse", "class", "import",
       "frontend.http.endpoints frontend.http.errors", "recognises vLLM's error answers"),
    _n("vllm.logger:init_logger", "function", "call", "frontend.http.install",
       "the server logs under vLLM's logger"),
    _n("vllm.logger:configure_logging_from_args", "function", "call", "cli.serve",
       "vllm-lens serve logs as vllm serve does", **_LOADED),
    _n("vllm.ray.ray_env:get_env_vars_to_copy", "function", "call", "cli.extract.ray_actors",
       "Ray actors get vLLM's environment", "exclude_vars destination", **_LOADED),
)

#: Modules of the worker stack: their entries are ``startup="worker"``.
_WORKER_MODULES = frozenset({
    "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner", _BATCH, "vllm.v1.utils",
    "vllm.model_executor.models.utils", "vllm.model_executor.layers.attention.attention",
    "vllm.v1.attention.backend", "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.vocab_parallel_embedding", "vllm.distributed",
    "vllm.distributed.parallel_state", "vllm.forward_context",
})
REGISTRY = tuple(dataclasses.replace(n, startup="worker")
                 if n.module in _WORKER_MODULES and n.startup == "always" else n
                 for n in REGISTRY)


# -- checking against the vLLM this process imported ---------------------------------------------
def resolve(need: Need) -> Any:
    """The object ``need`` names, or for an instance attribute its class.

    Raises:
        ImportError: the module is missing. AttributeError: a name on the way is.
    """
    obj: Any = importlib.import_module(need.module)
    parts = need.qualname.split(".") if need.qualname else []
    if need.kind == "instance attribute":
        parts = parts[:-1]
    for part in parts:
        obj = getattr(obj, part)
    return obj


def declared_members(tree: ast.ClassDef) -> set[str]:
    """Names the class body ``tree`` declares: assignments, annotations, methods and
    properties, and every ``self.<name>`` assigned (or annotated) inside its methods (bases
    not included)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for func in tree.body:
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or not func.args.args:
            continue
        self_name = func.args.args[0].arg
        for node in ast.walk(func):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                       else [])
            for target in targets:
                for t in ast.walk(target):
                    if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                            and t.value.id == self_name):
                        names.add(t.attr)
    return names


def _declares(cls: type, name: str) -> bool:
    if hasattr(cls, name):
        return True
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}):
            return True
        if klass.__module__.startswith("vllm") and name in _source_members(klass):
            return True
    return False


@functools.cache
def _source_members(klass: type) -> frozenset[str]:
    """``declared_members`` of ``klass``'s own source (parsed once per class)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return frozenset()
    return frozenset(declared_members(tree)) if isinstance(tree, ast.ClassDef) else frozenset()


def _parameters(obj: Any) -> list[str] | None:
    try:
        return list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return None


def check_one(need: Need) -> str | None:
    """What differs for ``need`` (one entry) in the installed vLLM, or ``None``."""
    try:
        obj = resolve(need)
    except ImportError as exc:
        return f"module {need.module} cannot be imported ({exc})"
    except AttributeError:
        return "not found"
    if need.kind == "class" and not isinstance(obj, type):
        return f"is a {type(obj).__name__}, not a class"
    if need.kind in ("function", "method"):
        if not callable(obj):
            return "is not callable"
        found = _parameters(obj)
        missing = [p for p in need.params if found is not None and p not in found]
        if missing:
            return f"has no parameter {', '.join(missing)} (parameters: {', '.join(found)})"
    if need.kind == "instance attribute":
        name = need.qualname.rpartition(".")[2]
        if not isinstance(obj, type):
            return f"{need.qualname.rpartition('.')[0]} is not a class"
        if not _declares(obj, name):
            return f"{obj.__name__} and its bases neither define nor assign {name}"
    return None


def _checked_here(need: Need, in_worker: bool) -> bool:
    return (need.startup == "always" or (need.startup == "worker" and in_worker)
            or need.module in sys.modules)


def check(needs: Iterable[Need] | None = None, *, in_worker: bool | None = None
          ) -> list[Problem]:
    """What differs between ``needs`` and the installed vLLM.

    Args:
        needs: the entries to check; ``None``: ``REGISTRY``.
        in_worker: ``None`` checks every entry, importing its module. ``True`` / ``False``:
            only the entries start-up checks in a worker / another process (see ``startup``
            in the module docstring).

    Returns:
        One ``Problem`` per entry that differs, in table order (empty: everything matches).
    """
    problems = []
    for need in REGISTRY if needs is None else needs:
        if in_worker is not None and not _checked_here(need, in_worker):
            continue
        try:
            found = check_one(need)
        except Exception as exc:  # noqa: BLE001 - an entry that cannot be judged is a problem
            found = f"cannot be checked ({exc!r})"
        if found is not None:
            problems.append(Problem(need, found))
    return problems


def unsupported_reason() -> str | None:
    """Why lens requests must be refused on this vLLM (naming the first symbol that differs),
    or ``None``. Checked once per process, and once more when the process has become a worker
    since (an in-process engine: the front end asks before its worker exists)."""
    return _reason(_in_worker())


def _in_worker() -> bool:
    """Whether this process holds a vLLM worker: every worker, even alone, initializes
    ``torch.distributed``; a front end never does."""
    import torch.distributed

    return torch.distributed.is_available() and torch.distributed.is_initialized()


@functools.cache
def _reason(in_worker: bool) -> str | None:
    problems = [p for p in check(in_worker=in_worker) if not p.need.optional]
    if not problems:
        return None
    import vllm

    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return (f"vLLM {getattr(vllm, '__version__', '?')} lacks what vllm-lens needs: "
            f"{problems[0]}{more}")
