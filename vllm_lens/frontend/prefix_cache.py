"""Keep steered and unsteered requests from sharing prefix-cache blocks (runs in: front end).

vLLM hashes KV blocks together with the request's ``cache_salt``. Every steered request gets a
salt derived from its steering (``LensRequest.cache_salt``), so it reuses blocks only from
requests steered identically, and unsteered requests never see its blocks. The salt is applied
where vLLM turns inputs into an ``EngineCoreRequest`` (``InputProcessor.process_inputs``),
the one step the sync and async engines share; a caller's own salt is kept and extended.
"""

from __future__ import annotations

from vllm.v1.engine.input_processor import InputProcessor

from vllm_lens._patching import wrap_attribute
from vllm_lens.spec import PAYLOAD_KEY

__all__ = ["install"]


def install() -> None:
    wrap_attribute(InputProcessor, "process_inputs", _wrap_process_inputs)


def _wrap_process_inputs(original):
    def process_inputs(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        params = request.sampling_params
        payload = (params.extra_args or {}).get(PAYLOAD_KEY) if params is not None else None
        salt = payload.get("salt") if isinstance(payload, dict) else None
        if salt:
            request.cache_salt = f"{request.cache_salt}|{salt}" if request.cache_salt else salt
        return request

    return process_inputs
