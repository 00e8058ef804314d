"""The lens keys a request may carry, and the reserved key of the validated payload (runs in: any).

Plain constants, no imports."""

#: Capture the residual stream after chosen layers: ``true``, a list of layers, or
#: ``{"layers", "positions", "reduce"}``.
CAPTURE_KEY = "output_residual_stream"
#: Capture at any tap point: ``{point: layers | true | {"layers", "positions", "reduce"}}``.
ACTIVATIONS_KEY = "output_activations"
#: Post-RoPE Q and K of chosen layers (vllm-lens 1.3.0's key): ``true``, a list of layers, or
#: ``{"layers", "heads"}`` (only those query heads returned).
QK_KEY = "output_qk"
#: Steering vectors: a list of ``SteeringVector`` objects, their dicts or wire strings.
STEER_KEY = "apply_steering_vectors"
#: An ``apply_steering_vectors`` item selecting a named preset the operator registered.
PRESET_PREFIX = "preset:"
#: How the OpenAI server returns activations (``"json"`` inline, ``"binary"`` by handle,
#: ``"lists"`` inline as plain numbers). Offline engines return tensors and only validate it.
TRANSPORT_KEY = "activations_transport"
TRANSPORTS = ("json", "binary", "lists")
#: Hooks run inside the forward pass: ``Hook`` / ``NamedHook`` objects or their JSON forms.
HOOKS_KEY = "apply_hooks"
#: Write the captured rows to an operator's sink (``vllm_lens.sinks``) instead of returning
#: them: ``{"sink", "dataset", "key"}``.
SINK_KEY = "capture_sink"
#: Return the rows computed so far with every streamed output (``AsyncLLM``, SSE).
STREAM_KEY = "stream_activations"
#: SAE features at the SAE's own point and layer: ``{"sae", "positions", "top_k",
#: "reconstruction", "hook_point"}`` or a list of them (``vllm_lens.saes``).
SAE_KEY = "output_sae_features"
#: Probes read while the model generates, that stop it or report (``spec.monitors``).
MONITORS_KEY = "monitors"
#: Attention steering: in chosen heads, emphasise a span of keys (PASTA) or bias chosen keys'
#: scores (``spec.attention_steering``).
ATTENTION_STEER_KEY = "steer_attention"
#: Layers whose MLP a transcoder stands in for: ``[{"transcoder", "keep_error", "clamp",
#: "hook_point"}]`` (``spec.replacement``).
REPLACE_KEY = "replace_mlp"
#: Direct logit attribution of the embedding and each layer's attn_out and mlp_out:
#: ``true`` or ``{"layers", "positions", "attribution_token"}`` (``spec.logit_attribution``).
LOGIT_KEY = "output_logit_attribution"
#: Every key vllm-lens reads from ``extra_args``; near-misses of these are reported as typos.
LENS_KEYS = (CAPTURE_KEY, ACTIVATIONS_KEY, QK_KEY, STEER_KEY, HOOKS_KEY, TRANSPORT_KEY,
             SINK_KEY, STREAM_KEY, SAE_KEY, MONITORS_KEY, ATTENTION_STEER_KEY, REPLACE_KEY,
             LOGIT_KEY)
#: The reserved ``extra_args`` entry that carries the validated spec to the workers.
PAYLOAD_KEY = "vllm_lens"
PAYLOAD_VERSION = 1
REDUCTIONS = (None, "mean", "last")
#: Largest JSON form of one named hook's arguments (a probe's weights for hidden 65536 fit);
#: they travel to every worker with the request.
MAX_HOOK_ARGS_BYTES = 4 << 20
