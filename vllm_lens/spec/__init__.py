"""Lens request keys -> validated, typed specs (runs in: front end, worker).

The front end parses; workers decode the payload.

Users put lens keys in ``SamplingParams.extra_args`` (offline) or ``vllm_xargs`` (HTTP). The
front end validates them here, before the request reaches the engine, so a bad request fails
alone with an error naming the key. One module per job:

- ``keys``: the key names and the reserved payload key;
- ``facts``: ``ModelFacts``, what the model and engine allow;
- ``fields``: validators every key shares (layers, positions, sites, JSON strings);
- ``capture``: captures at the residual stream, tap points and Q/K;
- ``steering``: steering vectors, presets, replacements, conditions;
- ``hooks``: hooks, named and pickled;
- ``monitors``: probes that stop a generation or report;
- ``attention_steering``: edits of chosen heads' attention (PASTA, key biases);
- ``outputs``: capture sinks and streamed rows;
- ``request``: ``LensRequest``, ``parse_extra_args`` and the engine-wide checks.
"""

from vllm_lens.common.positions import NAMED as POSITION_SELECTORS
from vllm_lens.spec.attention_steering import AttentionEdit
from vllm_lens.spec.capture import CaptureSpec
from vllm_lens.spec.facts import ModelFacts
from vllm_lens.spec.hooks import HookSpec, parse_hooks
from vllm_lens.spec.keys import (
    ACTIVATIONS_KEY,
    ATTENTION_STEER_KEY,
    CAPTURE_KEY,
    HOOKS_KEY,
    LENS_KEYS,
    LOGIT_KEY,
    MONITORS_KEY,
    PAYLOAD_KEY,
    PRESET_PREFIX,
    QK_KEY,
    REDUCTIONS,
    REPLACE_KEY,
    SAE_KEY,
    SINK_KEY,
    STEER_KEY,
    STREAM_KEY,
    TRANSPORT_KEY,
    TRANSPORTS,
)
from vllm_lens.spec.monitors import MonitorSpec
from vllm_lens.spec.request import (
    LensRequest,
    asks_for_work,
    check_engine,
    has_lens_keys,
    parse_extra_args,
    reuse_parsed,
)
from vllm_lens.spec.steer_records import SteerSpec
from vllm_lens.spec.steering import parse_steering

__all__ = [
    "ACTIVATIONS_KEY",
    "CAPTURE_KEY",
    "QK_KEY",
    "SAE_KEY",
    "LENS_KEYS",
    "MONITORS_KEY",
    "ATTENTION_STEER_KEY",
    "REPLACE_KEY",
    "LOGIT_KEY",
    "AttentionEdit",
    "MonitorSpec",
    "SINK_KEY",
    "STREAM_KEY",
    "STEER_KEY",
    "SteerSpec",
    "TRANSPORT_KEY",
    "TRANSPORTS",
    "PAYLOAD_KEY",
    "PRESET_PREFIX",
    "POSITION_SELECTORS",
    "REDUCTIONS",
    "CaptureSpec",
    "HOOKS_KEY",
    "HookSpec",
    "LensRequest",
    "ModelFacts",
    "asks_for_work",
    "check_engine",
    "has_lens_keys",
    "parse_extra_args",
    "parse_hooks",
    "parse_steering",
    "reuse_parsed",
]
