"""vllm-lens: read and change a model's internals per request, inside vLLM (runs in: any).

Install next to vLLM and every request can ask, through ``SamplingParams.extra_args``, for
residual-stream activations::

    sp = SamplingParams(max_tokens=8, extra_args={"output_residual_stream": [3, 7]})
    out = llm.generate(["Hello"], sp)[0]
    out.activations["residual_stream"]   # [n_layers, n_positions, hidden], CPU, model dtype

and for steering vectors added to the residual stream::

    sv = SteeringVector(activations=direction[None], layer_indices=[10], scale=4.0)
    SamplingParams(max_tokens=20, extra_args={"apply_steering_vectors": [sv]})

The plugin itself loads through vLLM's ``vllm.general_plugins`` entry point; this package's
public names are the helpers a user imports.
"""

from vllm_lens.errors import (
    CapacityError,
    LensError,
    LensExecutionError,
    LensRequestError,
    RemoteCodeRefusedError,
    SinkRefusedError,
    UnsupportedConfigError,
    UnsupportedModelError,
    WireError,
    WorkerCapacityError,
)
from vllm_lens.hooks import Hook, HookContext, HookError, NamedHook
from vllm_lens.spec import CaptureSpec
from vllm_lens.activations import decode_activations
from vllm_lens.steering import SteeringVector
from vllm_lens.frontend.sink_control import flush_sinks

__all__ = [
    "CapacityError",
    "CaptureSpec",
    "Hook",
    "HookContext",
    "HookError",
    "LensError",
    "LensExecutionError",
    "LensRequestError",
    "NamedHook",
    "RemoteCodeRefusedError",
    "SinkRefusedError",
    "SteeringVector",
    "UnsupportedConfigError",
    "UnsupportedModelError",
    "WireError",
    "WorkerCapacityError",
    "decode_activations",
    "flush_sinks",
]
