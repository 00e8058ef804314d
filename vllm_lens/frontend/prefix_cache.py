"""Keep steered and unsteered requests from sharing prefix-cache blocks they should not share (runs
in: front end, engine core).

Requests get their salt in the front end; blocks are hashed in the engine core.

vLLM hashes KV blocks together with the request's ``cache_salt``, which it mixes into the first
block's hash (later blocks chain on it). A request whose steering may touch a prompt position
gets a salt derived from its steering (``LensRequest.cache_salt``), so it reuses blocks only
from requests steered identically, and unsteered requests never see its blocks. The salt is
applied where vLLM turns inputs into an ``EngineCoreRequest``
(``InputProcessor.process_inputs``), the one step the sync and async engines share; a caller's
own salt is kept and extended.

Steering of generated positions only (``phase="decode"``) leaves the prompt's KV exactly as
an unsteered request computes it, so its prompt blocks stay shared. Its generated tokens' KV
is steered, though, and vLLM caches full blocks of generated tokens too: a later prompt that
repeats them (the next turn of a chat) would reuse steered KV. So the engine core's block
hasher (``kv_cache_utils.generate_block_hash_extra_keys``) adds the request's
``LensRequest.decode_salt`` to the extra keys of every block that reaches past the prompt.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from vllm.v1.engine.input_processor import InputProcessor

from vllm_lens.common.wrapping import wrap_attribute
from vllm_lens.spec import PAYLOAD_KEY

__all__ = ["install"]

#: Modules that bind vLLM's extra-key function by name (the block hasher's, and the KV-event
#: publishers' that must report the same keys); the last is wrapped only if it is loaded.
_EXTRA_KEY_USERS = ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.block_pool")
_OPTIONAL_USERS = ("vllm.v1.simple_kv_offload.manager",)
_EXTRA_KEYS = "generate_block_hash_extra_keys"


def install() -> None:
    wrap_attribute(InputProcessor, "process_inputs", _wrap_process_inputs)
    modules = [importlib.import_module(name) for name in _EXTRA_KEY_USERS]
    modules += [sys.modules[name] for name in _OPTIONAL_USERS if name in sys.modules]
    for module in modules:
        if hasattr(module, _EXTRA_KEYS):
            wrap_attribute(module, _EXTRA_KEYS, _wrap_extra_keys)


def _payload(params: Any) -> dict[str, Any] | None:
    payload = (getattr(params, "extra_args", None) or {}).get(PAYLOAD_KEY)
    return payload if isinstance(payload, dict) else None


def _wrap_process_inputs(original):
    def process_inputs(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        payload = _payload(request.sampling_params)
        salt = payload.get("salt") if payload is not None else None
        if salt:
            request.cache_salt = f"{request.cache_salt}|{salt}" if request.cache_salt else salt
        return request

    return process_inputs


def _wrap_extra_keys(original):
    def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx):
        keys, next_mm_idx = original(request, start_token_idx, end_token_idx, start_mm_idx)
        if end_token_idx <= request.num_prompt_tokens:
            return keys, next_mm_idx
        payload = _payload(request.sampling_params)
        salt = payload.get("decode_salt") if payload is not None else None
        if not salt:
            return keys, next_mm_idx
        return (*(keys or ()), ("vllm_lens_decode_salt", salt)), next_mm_idx

    return generate_block_hash_extra_keys
