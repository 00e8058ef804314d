"""Two recipes researchers write first, as functions over an engine: a steering vector from
contrastive prompt pairs, and TransformerLens' ``run_with_cache`` (runs in: caller).

Both drive an offline ``vllm.LLM`` (with the plugin loaded) through the lens keys every
client has, so what they return is what ``output_activations`` returns, arranged the way the
recipe wants it:

- ``contrastive_vector(llm, positive, negative, layers)``: the mean over the positive prompts
  of the stream at the chosen positions, less the negatives' mean (CAA, Rimsky et al. 2024;
  RepE's difference of means), optionally normalised per layer: a ``SteeringVector`` ready
  for ``apply_steering_vectors``;
- ``run_with_cache(llm, prompts, points)``: per prompt, ``{"blocks.L.hook_<point>": [n,
  ...]}`` as TransformerLens names its cache, with the prompt's token ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vllm_lens.common import points as tap_points
from vllm_lens.steering import SteeringVector

__all__ = ["contrastive_vector", "run_with_cache"]


def _generate(llm: Any, prompts: Sequence[Any], extra_args: dict[str, Any],
              max_tokens: int = 1) -> list[Any]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra_args)
    outs = llm.generate(list(prompts), sp, use_tqdm=False)
    for i, out in enumerate(outs):
        if out.lens_error is not None:
            raise out.lens_error
        if out.activations is None:
            raise RuntimeError(f"prompt {i} came back without activations")
    return outs


def _point(name: str) -> str:
    """The tap point ``name`` names, in any spelling the engine accepts (``"hook_z"``,
    ``"post_block"`` ...), without a layer (the layers are given apart)."""
    try:
        point, layer = tap_points.resolve(name)
    except KeyError as exc:
        raise ValueError(str(exc).strip("'\"")) from None
    if layer is not None:
        raise ValueError(f"{name!r} names layer {layer}: name the point alone and give the "
                         "layers apart")
    return point


def _mean_rows(llm: Any, prompts: Sequence[Any], layers: list[int], point: str,
               positions: Any) -> torch.Tensor:
    """``[len(layers), hidden]``: each prompt's rows at ``positions`` averaged, then averaged
    over the prompts (each prompt weighs the same), in float32."""
    if not prompts:
        raise ValueError("each prompt set needs at least one prompt")
    outs = _generate(llm, prompts, {"output_activations": {point: {
        "layers": layers, "positions": positions, "reduce": "mean"}}})
    rows = torch.stack([out.activations[point].float() for out in outs])  # [P, L, hidden]
    if rows.isnan().any():
        raise ValueError(f"positions {positions!r} selected no row of some prompt")
    return rows.mean(dim=0)


def contrastive_vector(llm: Any, positive: Sequence[Any], negative: Sequence[Any],
                       layers: Sequence[int], *, positions: Any = "last_prompt",
                       point: str = "resid_post", normalize: bool = False,
                       **vector_fields: Any) -> SteeringVector:
    """A steering vector from contrastive prompts: at each of ``layers``, the mean of the
    ``positive`` prompts' ``point`` rows at ``positions`` less the ``negative`` prompts'.

    Args:
        llm: an offline ``vllm.LLM`` with the plugin loaded.
        positive: prompts (strings, or what ``LLM.generate`` takes) showing the behaviour
            (pairs need not be matched: each set's mean is taken).
        negative: prompts without it.
        layers: the decoder layers to read and steer.
        positions: the positions averaged within each prompt, a selector as for captures
            (default ``"last_prompt"``: the last prompt token, CAA's answer position;
            ``"prompt"``: every prompt token).
        point: where the rows are read and the vector is added (default ``"resid_post"``,
            the stream after the layer).
        normalize: divide each layer's difference by its norm (then ``scale`` is the length
            added, or with ``norm_match`` the share of the stream's norm); default ``False``:
            the raw difference of means, whose ``scale=1`` moves a negative mean onto the
            positive one.
        **vector_fields: more ``SteeringVector`` fields (``scale``, ``norm_match``,
            ``phase``, ...).

    Returns:
        A ``SteeringVector`` of ``[len(layers), hidden]`` float32 rows at ``layers`` and
        ``point``.

    Raises:
        ValueError: a prompt set is empty, its positions select nothing, or a difference is
            zero with ``normalize``.
        LensRequestError: the engine refused the capture (naming the field).

    Examples:
        >>> from vllm_lens.recipes import contrastive_vector
        >>> sv = contrastive_vector(llm, ["I love this.", "What a joy!"],
        ...                         ["I hate this.", "What a pain!"], layers=[2], scale=4.0)
        >>> tuple(sv.activations.shape), sv.layer_indices, sv.hook_point   # hidden 128
        ((1, 128), [2], 'resid_post')
    """
    layers = sorted(set(int(layer) for layer in layers))
    point = _point(point)
    difference = (_mean_rows(llm, positive, layers, point, positions)
                  - _mean_rows(llm, negative, layers, point, positions))
    if normalize:
        norms = difference.norm(dim=-1, keepdim=True)
        if bool((norms == 0).any()):
            raise ValueError("the two sets' means are equal at some layer: nothing to "
                             "normalise")
        difference = difference / norms
    return SteeringVector(activations=difference, layer_indices=layers, hook_point=point,
                          **vector_fields)


def run_with_cache(llm: Any, prompts: Sequence[Any], points: Mapping[str, Any], *,
                   positions: Any = "prompt", max_tokens: int = 1) -> list[dict[str, Any]]:
    """TransformerLens' ``run_with_cache`` on a vLLM engine: the chosen points of every chosen
    layer for each prompt, keyed by TransformerLens' hook names.

    Args:
        llm: an offline ``vllm.LLM`` with the plugin loaded.
        prompts: what ``LLM.generate`` takes.
        points: point -> layers (a list, or ``True`` for every layer), e.g.
            ``{"resid_post": True, "attn_out": [3]}``; any tap point of
            ``output_activations``.
        positions: a selector as for captures (default ``"prompt"``: every prompt token; the
            rows of generated tokens come with ``"all"``).
        max_tokens: tokens generated per prompt (default 1: the prompt's forward pass).

    Returns:
        Per prompt, ``{"blocks.L.hook_<point>": tensor [n_pos, *row], ...,
        "positions": int64 [n_pos], "prompt_token_ids": [...], "token_ids": [...]}`` under
        TransformerLens' names (``attn_z``: ``blocks.L.attn.hook_z``, rows ``[n_heads,
        head_dim]``; ``mlp_post``: ``blocks.L.mlp.hook_post``), rows in the model's dtype
        on the CPU.

    Raises:
        ValueError: a name that is not a tap point, or names a layer.
        LensRequestError: a point, layer or selector the engine refuses (naming the field).

    Examples:
        >>> from vllm_lens.recipes import run_with_cache
        >>> cache = run_with_cache(llm, ["The capital of France is"], {"resid_post": [2]})[0]
        >>> cache["blocks.2.hook_resid_post"].shape == (len(cache["prompt_token_ids"]), 128)
        True
    """
    wanted = {_point(point): {"layers": layers, "positions": positions}
              for point, layers in points.items()}
    outs = _generate(llm, prompts, {"output_activations": wanted}, max_tokens=max_tokens)
    caches = []
    for out in outs:
        acts = out.activations
        cache: dict[str, Any] = {"prompt_token_ids": list(out.prompt_token_ids or ()),
                                 "token_ids": list(out.outputs[0].token_ids)}
        for point, spec in wanted.items():
            layers = spec["layers"]
            rows = acts[point]
            if layers is True:
                layers = list(range(rows.shape[0]))
            for i, layer in enumerate(sorted(set(layers))):
                cache[tap_points.hook_name(point, layer)] = rows[i]
            cache["positions"] = acts[f"{point}_positions"]
        caches.append(cache)
    return caches
