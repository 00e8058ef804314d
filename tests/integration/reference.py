"""The transformers reference: decoder-layer outputs and greedy generation in float32."""

from __future__ import annotations

import contextlib

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText


#: Where each transformers family keeps what the tap points read (dotted paths; the layers
#: from the model, the rest from a layer): ``attn_out`` / ``mlp_out`` are the outputs of the
#: modules whose results are added to the stream, ``mlp_post`` / ``attn_z`` the inputs of the
#: MLP's and attention's output projections, ``router`` an MoE gate (logits, scores, indices).
_LLAMA_MODULES = dict(layers="model.layers", attn_in="input_layernorm", attn_out="self_attn",
                      mlp_out="mlp", mlp="mlp",
                      down="mlp.down_proj", o_proj="self_attn.o_proj", router=None)
#: Sandwich and post-norm families: the attention block's and the MLP's own outputs, before
#: the norm after each (``attn_out_pre_norm``, ``mlp_out_pre_norm``).
_RAW = dict(attn_raw="self_attn", mlp_raw="mlp")
_MODULES = {
    "gemma2": {**_LLAMA_MODULES, "attn_out": "post_attention_layernorm",
               "mlp_out": "post_feedforward_layernorm", **_RAW},
    "gpt2": dict(layers="transformer.h", attn_in="ln_1", attn_out="attn", mlp_out="mlp",
                 mlp="mlp",
                 down="mlp.c_proj",
                 o_proj="attn.c_proj", router=None),
    "mixtral": {**_LLAMA_MODULES, "down": None, "router": "mlp.gate"},
    "qwen2_moe": {**_LLAMA_MODULES, "down": None, "router": "mlp.gate"},
    "gpt_neox": dict(layers="gpt_neox.layers", attn_in="input_layernorm",
                     attn_out="attention", mlp_out="mlp", mlp="mlp",
                     down="mlp.dense_4h_to_h", o_proj="attention.dense", router=None),
    "olmo2": {**_LLAMA_MODULES, "attn_in": None, "attn_out": "post_attention_layernorm",
              "mlp_out": "post_feedforward_layernorm", **_RAW},
}
_MODULES["gemma3_text"] = _MODULES["gemma2"]
_MODULES["olmo3"] = _MODULES["olmo2"]
# Families served through derived layouts (``tests/integration/test_derived_layouts.py``).
_MODULES["glm4"] = {**_LLAMA_MODULES, "attn_out": "post_self_attn_layernorm",
                    "mlp_out": "post_mlp_layernorm", **_RAW}
_MODULES["gemma4_text"] = {**_MODULES["gemma2"], "mlp": "mlp"}  # sandwich, layers scaled
_MODULES["qwen3_moe"] = {**_LLAMA_MODULES, "down": None}
_MODULES["olmoe"] = _MODULES["qwen3_moe"]
_MODULES["glm4_moe"] = _MODULES["qwen3_moe"]  # a dense first layer, MoE after
_MODULES["deepseek_v2"] = _MODULES["qwen3_moe"]
_MODULES["gpt_oss"] = _MODULES["qwen3_moe"]  # experts, no single down projection
_MODULES["granitemoe"] = {**_LLAMA_MODULES, "mlp_out": "block_sparse_moe",
                           "mlp": "block_sparse_moe", "down": None}
# Llama 4: the MLP (dense or MoE) is ``feed_forward``.
_MODULES["llama4_text"] = {**_LLAMA_MODULES, "mlp_out": "feed_forward", "mlp": "feed_forward",
                           "down": None}
_MODULES["deepseek_v3"] = _MODULES["qwen3_moe"]
_MODULES["exaone4"] = _MODULES["olmo2"]  # post-norm
_MODULES["idefics3"] = {**_LLAMA_MODULES, "layers": "model.text_model.layers"}
# transformers' BLOOM adds the residual inside its attention and MLP modules: what each
# sublayer adds is its output projection's (dropout is off in eval).
_MODULES["bloom"] = dict(layers="transformer.h", attn_in="input_layernorm",
                         attn_out="self_attention.dense",
                         mlp_out="mlp.dense_4h_to_h", mlp="mlp", down="mlp.dense_4h_to_h",
                         o_proj="self_attention.dense", router=None,
                         # no eager_attention_forward: V from the fused projection, whose
                         # columns run per head (query, key, value), as its _reshape reads them
                         qkv_per_head="self_attention.query_key_value")


def _get(root, path: str):
    for name in path.split("."):
        root = getattr(root, name)
    return root


class HFReference:
    def __init__(self, path: str) -> None:
        # Eager attention: the only implementation that returns attention weights.
        auto = AutoModelForCausalLM
        if AutoConfig.from_pretrained(path).model_type == "idefics3":
            auto = AutoModelForImageTextToText  # run on text alone here
        self.model = auto.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager").eval()
        self.modules = _MODULES.get(self.model.config.model_type, _LLAMA_MODULES)
        self.layers = _get(self.model, self.modules["layers"])
        config = self.model.config.get_text_config()
        try:
            head_dim = getattr(config, "head_dim", None)
        except Exception:  # noqa: BLE001 -- Gemma 4: per layer; its Q/K are not compared
            head_dim = None
        self.head_dim = head_dim or config.hidden_size // config.num_attention_heads

    @torch.no_grad()
    def residual_stream(self, token_ids: list[int], layers: list[int]) -> torch.Tensor:
        """``[len(layers), len(token_ids), hidden]``: each listed decoder layer's output.

        Taken with forward hooks, so the last layer is its raw output (transformers'
        ``hidden_states[-1]`` is after the final norm).
        """
        seen: dict[int, torch.Tensor] = {}
        handles = [
            self.layers[layer].register_forward_hook(
                lambda _m, _i, out, layer=layer: seen.__setitem__(
                    layer, out[0] if isinstance(out, tuple) else out)
            )
            for layer in layers
        ]
        try:
            self.model(torch.tensor([token_ids]))
        finally:
            for h in handles:
                h.remove()
        return torch.stack([seen[layer][0] for layer in layers])

    @torch.no_grad()
    def hidden_states(self, token_ids: list[int]) -> tuple[torch.Tensor, ...]:
        out = self.model(torch.tensor([token_ids]), output_hidden_states=True)
        return tuple(h[0] for h in out.hidden_states)

    def steered_greedy(self, prompt_ids: list[int], max_new_tokens: int, vectors) -> list[int]:
        """Greedy generation with ``SteeringVector``s added to layer outputs."""
        by_layer: dict[int, list] = {}
        for sv in vectors:
            for i, layer in enumerate(sv.layer_indices):
                by_layer.setdefault(layer, []).append((sv, i))

        def adder(layer):
            def add(h: torch.Tensor) -> torch.Tensor:
                total = torch.zeros_like(h)
                for sv, i in by_layer[layer]:
                    total += _steering_delta(sv, i, h)
                return h + total
            return add

        return self.hooked_greedy(prompt_ids, max_new_tokens,
                                  {layer: adder(layer) for layer in by_layer})

    @torch.no_grad()
    def hooked_greedy(self, prompt_ids: list[int], max_new_tokens: int,
                      edits: dict[int, object]) -> list[int]:
        """Greedy generation with ``edits[layer](stream [T, hidden]) -> stream`` applied to
        decoder-layer outputs by forward hooks.

        Recomputes the whole sequence every step (no KV cache), so every position is edited
        exactly as its absolute position says.
        """
        def hook(layer):
            def edit(_module, _inputs, out):
                h = out[0] if isinstance(out, tuple) else out  # [1, T, hidden]
                edited = edits[layer](h[0])[None]
                return (edited, *out[1:]) if isinstance(out, tuple) else edited
            return edit

        handles = [self.layers[layer].register_forward_hook(hook(layer)) for layer in edits]
        ids = list(prompt_ids)
        try:
            for _ in range(max_new_tokens):
                logits = self.model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
        finally:
            for h in handles:
                h.remove()
        return ids[len(prompt_ids):]

    @contextlib.contextmanager
    def point_hooks(self, edits: dict | None = None):
        """Record every tap point of every layer into the yielded dict
        ``{(point, layer): [T, ...]}``; ``edits[(point, layer)](value [T, d]) -> value``
        replaces a stream point (``resid_pre``, ``attn_out``, ``resid_mid``, ``mlp_out``,
        ``resid_post``, and ``attn_in``/``mlp_in``: what attention and the MLP read) as
        vllm-lens does. MoE layers also
        record ``router_logits`` and ``router_experts`` (the experts chosen per token), and
        every layer whose attention calls its module's ``eager_attention_forward`` records
        ``value``: the V that function receives, ``[T, kv_heads, head_dim]``; and
        ``final_norm`` (at the last layer): what the LM head reads."""
        edits = edits or {}
        seen: dict = {}
        handles = []
        layer_of = {id(m): i for i, layer in enumerate(self.layers) for m in layer.modules()}

        def put(point, i, value):
            edit = edits.get((point, i))
            if edit is not None:
                value = edit(value)
            seen[(point, i)] = value
            return value

        for i, layer in enumerate(self.layers):
            def pre(_m, args, kwargs, i=i):
                h = args[0] if args else kwargs["hidden_states"]
                new = put("resid_pre", i, h[0])[None]
                if args:
                    return (new, *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": new}

            def attn(_m, _inp, out, i=i):
                value = out[0] if isinstance(out, tuple) else out
                attn_out = put("attn_out", i, value[0])
                mid = seen[("resid_pre", i)] + attn_out
                new_mid = put("resid_mid", i, mid)
                if new_mid is not mid:
                    attn_out = new_mid - seen[("resid_pre", i)]
                return (attn_out[None], *out[1:]) if isinstance(out, tuple) else attn_out[None]

            def attn_in(_m, _inp, out, i=i):  # what attention reads: its norm's output
                value = out[0] if isinstance(out, tuple) else out
                new = put("attn_in", i, value[0])[None]
                return (new, *out[1:]) if isinstance(out, tuple) else new

            def mlp(_m, _inp, out, i=i):
                value = out[0] if isinstance(out, tuple) else out
                if value.dim() == 2:  # Llama 4's MoE returns its rows flattened: [T, d]
                    new = put("mlp_out", i, value)
                    return (new, *out[1:]) if isinstance(out, tuple) else new
                new = put("mlp_out", i, value[0])[None]
                return (new, *out[1:]) if isinstance(out, tuple) else new

            def mlp_in(_m, args, kwargs, i=i):
                h = args[0] if args else next(iter(kwargs.values()))
                new = put("mlp_in", i, h[0])[None]
                if args:
                    return (new, *args[1:]), kwargs
                first = next(iter(kwargs))
                return args, {**kwargs, first: new}

            def raw(point, i=i):  # a block's own output, before the norm after it
                def hook(_m, _inp, out):
                    value = out[0] if isinstance(out, tuple) else out
                    seen[(point, i)] = value.reshape(-1, value.shape[-1])
                return hook

            def qk_norm(q_or_k, i=i):  # Q or K per head before and after a family's norm
                def hook(_m, inp, out):
                    n_tokens = seen[("resid_pre", i)].shape[0]
                    for point, value in ((f"{q_or_k}_pre_norm", inp[0]), (f"{q_or_k}_normed", out)):
                        value = value[0]  # the batch of one
                        if value.dim() == 3 and value.shape[0] != n_tokens:  # [heads, T, d]
                            value = value.transpose(0, 1)
                        seen[(point, i)] = value.reshape(n_tokens, -1)
                return hook

            def router(_m, _inp, out, i=i):
                seen[("router_logits", i)] = out[0].reshape(-1, out[0].shape[-1])
                seen[("router_experts", i)] = out[2].reshape(-1, out[2].shape[-1])

            def post(_m, _inp, out, i=i):
                h = out[0] if isinstance(out, tuple) else out
                new = put("resid_post", i, h[0])[None]
                return (new, *out[1:]) if isinstance(out, tuple) else new

            def down(_m, inp, i=i):
                seen[("mlp_post", i)] = inp[0][0]

            def o_proj(_m, inp, i=i):
                z = inp[0][0]
                seen[("attn_z", i)] = z.reshape(z.shape[0], -1, self.head_dim)

            def qkv_per_head(_m, _inp, out, i=i):
                fused = out[0]
                seen[("value", i)] = fused.view(fused.shape[0], -1, 3, self.head_dim)[:, :, 2]

            where = self.modules
            handles += [
                layer.register_forward_pre_hook(pre, with_kwargs=True),
                layer.register_forward_hook(post),
                _get(layer, where["attn_out"]).register_forward_hook(attn),
                _get(layer, where["mlp_out"]).register_forward_hook(mlp),
                _get(layer, where["o_proj"]).register_forward_pre_hook(o_proj),
            ]
            if where.get("attn_in"):
                handles.append(_get(layer, where["attn_in"]).register_forward_hook(attn_in))
            mlp_module = getattr(layer, where.get("mlp", "mlp"), None)
            if isinstance(mlp_module, torch.nn.Module):  # what the MLP reads: mlp_in
                handles.append(mlp_module.register_forward_pre_hook(mlp_in, with_kwargs=True))
            for point, key in (("attn_out_pre_norm", "attn_raw"), ("mlp_out_pre_norm", "mlp_raw")):
                if where.get(key):
                    handles.append(_get(layer, where[key]).register_forward_hook(raw(point)))
            attention = _get(layer, where["o_proj"].rpartition(".")[0])
            for q_or_k in ("q", "k"):
                norm = getattr(attention, f"{q_or_k}_norm", None)
                if isinstance(norm, torch.nn.Module):
                    handles.append(norm.register_forward_hook(qk_norm(q_or_k)))
            if where["down"]:
                handles.append(_get(layer, where["down"]).register_forward_pre_hook(down))
            if where["router"]:
                handles.append(_get(layer, where["router"]).register_forward_hook(router))
            if where.get("qkv_per_head"):
                handles.append(_get(layer, where["qkv_per_head"]).register_forward_hook(
                    qkv_per_head))
        def lm_head(_m, inp):  # what the LM head reads: the final norm's output
            seen[("final_norm", len(self.layers) - 1)] = inp[0][0]

        handles.append(self.model.get_output_embeddings().register_forward_pre_hook(lm_head))
        with self._recorded_values(layer_of, seen):
            try:
                yield seen
            finally:
                for h in handles:
                    h.remove()

    @contextlib.contextmanager
    def _recorded_values(self, layer_of: dict, seen: dict):
        """Within the block, each decoder layer's eager attention function records the value
        it is handed as ``seen[("value", layer)]`` (and otherwise runs as it was)."""
        import sys

        modules = {sys.modules[type(m).__module__] for m in self.model.modules()
                   if id(m) in layer_of and hasattr(sys.modules[type(m).__module__],
                                                    "eager_attention_forward")}
        originals = {m: m.eager_attention_forward for m in modules}

        def recording(original):
            def forward(module, query, key, value, *args, **kwargs):
                layer = layer_of.get(id(module))
                if layer is not None:  # [1, kv_heads, T, d] -> [T, kv_heads, d]
                    seen[("value", layer)] = value[0].transpose(0, 1)
                return original(module, query, key, value, *args, **kwargs)
            return forward

        for m, original in originals.items():
            m.eager_attention_forward = recording(original)
        try:
            yield
        finally:
            for m, original in originals.items():
                m.eager_attention_forward = original

    @torch.no_grad()
    def points(self, token_ids: list[int], edits: dict | None = None,
               attentions: bool = False) -> dict:
        """Every tap point of every layer for ``token_ids`` (with ``edits``); with
        ``attentions`` also ``("attn", layer)``: eager attention weights [heads, T, T]."""
        with self.point_hooks(edits) as seen:
            out = self.model(torch.tensor([token_ids]), output_attentions=attentions)
        if attentions:
            for i, weights in enumerate(out.attentions):
                seen[("attn", i)] = weights[0]
        return seen

    @torch.no_grad()
    def point_greedy(self, prompt_ids: list[int], max_new_tokens: int,
                     edits: dict) -> list[int]:
        """Greedy generation with ``edits`` (see ``point_hooks``), recomputing every step."""
        ids = list(prompt_ids)
        with self.point_hooks(edits):
            for _ in range(max_new_tokens):
                ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt_ids):]

    @contextlib.contextmanager
    def attention_edits(self, edits: list[dict]):
        """Within the block, eager attention applies ``steer_attention`` edits (the request's
        dicts; ``layers`` a list, ``heads`` global query heads or ``None``), written here
        from the issue's definition: biases added to the masked scores, softmax (a row with
        no key left attends to nothing), then the emphases' weights (1 inside ``[start, end)``,
        ``alpha`` outside) multiply the probabilities, and each row is renormalised once (left
        as it was where no key keeps weight)."""
        import sys

        modules = {sys.modules[type(m).__module__] for m in self.model.modules()
                   if hasattr(m, "layer_idx") and hasattr(sys.modules[type(m).__module__],
                                                          "eager_attention_forward")}
        assert modules, "no eager attention function to edit"
        originals = {m: m.eager_attention_forward for m in modules}

        def steered(original):
            def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        softcap=None, **kwargs):
                mine = [e for e in edits if module.layer_idx in e["layers"]]
                if not mine:
                    return original(module, query, key, value, attention_mask, dropout=dropout,
                                    scaling=scaling, softcap=softcap, **kwargs)
                if scaling is None:
                    scaling = query.shape[-1] ** -0.5
                groups = query.shape[1] // key.shape[1]
                k = key.repeat_interleave(groups, dim=1).float()
                v = value.repeat_interleave(groups, dim=1).float()
                scores = query.float() @ k.transpose(2, 3) * scaling  # [1, h, q, k]
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                n_keys = scores.shape[-1]
                if attention_mask is not None:
                    hidden = (attention_mask < -1e30) if attention_mask.dtype.is_floating_point \
                        else ~attention_mask
                    scores = scores.masked_fill(hidden[..., :n_keys], float("-inf"))
                every = range(query.shape[1])
                for e in mine:
                    if "key_positions" in e:
                        heads = every if e["heads"] is None else set(e["heads"])
                        bias = float(e["bias"])
                        for h in heads:
                            for p in set(e["key_positions"]):
                                if p < n_keys:
                                    scores[0, h, :, p] = scores[0, h, :, p] + bias
                probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
                weights = torch.ones(query.shape[1], n_keys)  # the emphases' product
                for e in mine:
                    if "emphasize" in e:
                        start, end = e["emphasize"]
                        for h in sorted(set(every if e["heads"] is None else e["heads"])):
                            w = torch.full((n_keys,), float(e["alpha"]))
                            w[start:end] = 1.0
                            weights[h] *= w
                for h in every:
                    row = probs[0, h].clone()
                    weighted = row * weights[h]
                    total = weighted.sum(-1, keepdim=True)
                    probs[0, h] = torch.where(total > 0, weighted / total, row)
                out = (probs @ v).to(query.dtype).transpose(1, 2).contiguous()
                return out, probs
            return forward

        for m, original in originals.items():
            m.eager_attention_forward = steered(original)
        try:
            yield
        finally:
            for m, original in originals.items():
                m.eager_attention_forward = original

    @torch.no_grad()
    def attention_greedy(self, prompt_ids: list[int], max_new_tokens: int,
                         edits: list[dict]) -> list[int]:
        """Greedy generation under ``attention_edits``, recomputing every step."""
        ids = list(prompt_ids)
        with self.attention_edits(edits):
            for _ in range(max_new_tokens):
                ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt_ids):]

    @torch.no_grad()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        out = self.model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )
        return out[0, len(prompt_ids):].tolist()


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest per-row ``|actual - expected| / |expected|`` (L2 norms over the hidden dim)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = (actual.float() - expected.float()).norm(dim=-1) / expected.float().norm(dim=-1)
    return float(err.max())


def _steering_delta(sv, i: int, h: torch.Tensor) -> torch.Tensor:
    """What ``sv`` adds at its ``i``-th layer to the stream ``h`` ``[T, hidden]``."""
    T = h.shape[0]
    delta = torch.zeros_like(h)
    acts = sv.activations.float()
    if acts.dim() == 2:
        delta[:] = acts[i]
    else:
        positions = sv.position_indices or list(range(acts.shape[1]))
        for j, p in enumerate(positions):
            if p < T:
                delta[p] = acts[i, j]
    if sv.norm_match:
        direction = delta / delta.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        delta = torch.where(delta.norm(dim=-1, keepdim=True) > 0,
                            h.norm(dim=-1, keepdim=True) * direction, delta)
    return sv.scale * delta
