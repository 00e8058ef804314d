"""The one module that knows vLLM's model-runner internals (runs in: worker).

Everything else in the worker asks this module which requests the running step holds, where
their rows are in the batched hidden states, and at which absolute positions. It also decides,
once when the worker extension starts, whether this engine's configuration is one vllm-lens
has proven; anything else is refused up front (``unsupported_reason``), so no lens request
can reach a forward pass on a runner whose state this module cannot read.

Supported: vLLM 0.32.x with the V1 model runner (``vllm.v1.worker.gpu_model_runner``'s
``GPUModelRunner`` and its CPU subclass) and synchronous scheduling. The positions come from
``input_batch.num_computed_tokens_cpu``, which is exactly what the V1 runner adds to the
query offsets to build the model's positions when async scheduling is off (with async
scheduling the runner corrects it on the device only, so the host copy can run ahead).
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from dataclasses import dataclass
from typing import Any

from vllm_lens.common.engine_support import config_unsupported_reason
from vllm_lens.spec import PAYLOAD_KEY

__all__ = [
    "SUPPORTED_RUNNERS", "SUPPORTED_VLLM", "RunnerView", "ScheduledRequest",
    "unsupported_reason",
]

#: vLLM release series whose runner internals this module reads.
SUPPORTED_VLLM = ("0.32.",)
#: Fully qualified names of the V1 runner classes this module reads.
SUPPORTED_RUNNERS = (
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
    "vllm.v1.worker.cpu_model_runner.CPUModelRunner",
)


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of the running step."""

    req_id: str
    start: int
    """First row of the request in the batched hidden states."""
    end: int
    pos0: int
    """Absolute token position of row ``start``."""
    n_prompt: int
    payload: Any
    """The request's vllm-lens payload (``extra_args["vllm_lens"]``), or ``None``."""


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def unsupported_reason(vllm_config: Any, runner: Any) -> str | None:
    """Why lens requests must be refused on this engine, or ``None`` when it is supported.

    The message names the setting to change. Plain requests are served either way.
    """
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(SUPPORTED_VLLM):
        return (f"vLLM {version} is not supported by this vllm-lens (supported: "
                f"{', '.join(v + 'x' for v in SUPPORTED_VLLM)})")
    name = _qualname(type(runner))
    if name not in SUPPORTED_RUNNERS:
        if any(c.__module__.startswith("vllm.v1.worker.gpu.") for c in type(runner).__mro__):
            return _V2_REASON
        return f"model runner {name} is not supported (supported: V1 GPUModelRunner)"
    return config_unsupported_reason(vllm_config)


_V2_REASON = ("this engine runs vLLM's Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, or a "
              "feature that requires it), which vllm-lens does not support yet; unset "
              "VLLM_USE_V2_MODEL_RUNNER or set it to 0")


class RunnerView:
    """Read-only view of a V1 model runner's state for the running step.

    Only host-side state is read, so nothing here waits on the device. Requests without a
    lens payload are remembered, so a plain request costs one set lookup per step.
    """

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._plain: dict[str, Any] = {}
        """Request id -> the runner's state object of a request without a lens payload (an id
        vLLM reuses for a new request comes with a new state object)."""

    def scheduled(self, *, plain: bool = False) -> Iterator[ScheduledRequest]:
        """The running step's lens requests (and plain ones too with ``plain``) in batch
        order, i.e. the order of their rows."""
        runner = self.runner
        batch = runner.input_batch
        req_ids = batch.req_ids
        query_start = runner.query_start_loc.np  # host mirror: reading it never syncs
        computed = batch.num_computed_tokens_cpu
        states = runner.requests
        known_plain = self._plain
        if len(known_plain) > 2 * len(states) + 64:
            self._plain = known_plain = {r: st for r, st in known_plain.items()
                                         if states.get(r) is st}
        for i in range(batch.num_reqs):
            req_id = req_ids[i]
            state = states[req_id]
            if known_plain.get(req_id) is state:
                if not plain:
                    continue
                payload = None
            else:
                extra_args = state.sampling_params.extra_args
                payload = extra_args.get(PAYLOAD_KEY) if extra_args else None
                if payload is None:
                    known_plain[req_id] = state
                    if not plain:
                        continue
            yield ScheduledRequest(
                req_id=req_id, start=int(query_start[i]), end=int(query_start[i + 1]),
                pos0=int(computed[i]), n_prompt=int(state.num_prompt_tokens),
                payload=payload,
            )

    def eos_token_id(self, req_id: str) -> int | None:
        """The request's end-of-sequence token as vLLM's scheduler stops on it (``None``
        with ``ignore_eos`` or a tokenizer without one)."""
        return self.runner.requests[req_id].sampling_params.eos_token_id

    def logits_row(self, req_id: str) -> int | None:
        """The request's row in the logits the step samples from (one row per request:
        speculative decoding is refused with monitors), or ``None`` if it is not in the batch."""
        return self.runner.input_batch.req_id_to_index.get(req_id)

    def wrap_sample(self, before: Any) -> None:
        """Have ``before(logits)`` change the logits in place before each step samples (the
        V1 runner's ``_sample``; outside any compiled graph or CUDA graph)."""
        runner = self.runner
        original = runner._sample
        if getattr(original, "_vllm_lens", False):
            return

        def _sample(logits: Any, *args: Any, **kwargs: Any) -> Any:
            if logits is not None:
                before(logits)
            return original(logits, *args, **kwargs)

        _sample._vllm_lens = True  # type: ignore[attr-defined]
        runner._sample = _sample

    def live(self) -> Container[str]:
        """Ids of the requests the runner still holds: running, waiting or preempted. vLLM
        removes a request from it when the scheduler reports it finished or aborted."""
        return self.runner.requests
