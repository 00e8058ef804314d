"""The worker extension: the only worker entry points the front end calls (runs in: worker).

vLLM mixes this class into its worker class (``worker_extension_cls``) and the front end
reaches every TP/PP rank through ``collective_rpc("lens_...")``. All names carry the ``lens_``
prefix so they can never collide with the worker's own attributes (vLLM asserts this).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_lens import handoff, wire
from vllm_lens.worker.capture import assemble
from vllm_lens.worker.runtime import LensRuntime
from vllm_lens.worker.taps import set_tap_handler, tap_info

__all__ = ["LensWorkerExtension"]

_runtime: LensRuntime | None = None


def _ranks() -> tuple[int, int]:
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), get_pp_group().rank_in_group


class LensWorkerExtension:
    """RPC surface of vllm-lens on each worker (mixed into vLLM's worker class)."""

    def lens_describe(self) -> dict[str, Any]:
        """Attach the tap handler (once) and report what this rank's model looks like."""
        global _runtime
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()
        info = tap_info(model)
        tp_rank, pp_rank = _ranks()
        if info is not None and (_runtime is None or _runtime.runner is not runner):
            # Every TP rank holds the full residual stream; rank 0 alone captures it.
            capture_layers = frozenset(info.local_layers) if tp_rank == 0 else frozenset()
            _runtime = LensRuntime(runner, capture_layers=capture_layers)
            set_tap_handler(_runtime.on_tap)
        model_config = runner.model_config
        return {
            "model_class": info.model_class if info else type(model).__name__,
            "mapped": info is not None,
            "n_layers": info.n_layers if info else 0,
            "local_layers": list(info.local_layers) if info else [],
            "hidden_size": model_config.get_hidden_size(),
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "max_model_len": model_config.max_model_len,
            "tp_rank": tp_rank,
            "pp_rank": pp_rank,
        }

    def lens_fetch(
        self, requests: list[tuple[str, dict[str, int]]], front_end_host: str | None = None
    ) -> dict[str, dict[str, handoff.Handoff]]:
        """Pop the rows of finished requests.

        Args:
            requests: ``(lens key, {request id prefix: valid positions})`` per finished request;
                positions at or past the valid count come from surplus steps and are dropped.
                The prefix is ``""`` for ``n == 1`` and ``"{index}_"`` for sampled children.
            front_end_host: the caller's ``handoff.host_id()``; on the same host large payloads
                are handed over through shared memory instead of the RPC result.

        Returns:
            ``{lens key: {engine request id: handoff}}`` where the handoff holds ``wire.dumps``
            of ``{"layers", "positions", "residual_stream"}``, trimmed and reduced here so that
            rows nobody asked for never leave the worker. Ranks that did not capture return
            nothing.
        """
        if _runtime is None:
            return {}
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()  # finish the asynchronous device->host copies
        out: dict[str, dict[str, bytes]] = {}
        for key, valid_lens in requests:
            for req_id, entry in _runtime.store.pop(key).items():
                valid = next((n for p, n in valid_lens.items() if req_id.startswith(p)), None)
                if valid is not None:
                    blob = wire.dumps(assemble(entry, valid))
                    out.setdefault(key, {})[req_id] = handoff.send(blob, front_end_host)
        return out

    def lens_release(self, keys: list[str]) -> None:
        """Drop the buffers of requests that will never be fetched (aborted, failed)."""
        if _runtime is not None:
            for key in keys:
                _runtime.store.pop(key)

    def lens_stats(self) -> dict[str, int]:
        """Buffered entries and bytes on this rank (for tests and monitoring)."""
        if _runtime is None:
            return {"entries": 0, "bytes": 0}
        return {"entries": len(_runtime.store), "bytes": _runtime.store.nbytes}
