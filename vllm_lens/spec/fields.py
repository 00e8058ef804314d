"""Validators every lens key shares: JSON-string values, layer and position lists, tap sites and the
points a request may write to. Each raises ``LensRequestError`` (or a subclass) naming the offending
field (runs in: front end)."""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping
from typing import Any

from vllm_lens.common import points as tap_points
from vllm_lens.errors import LensRequestError, UnsupportedConfigError, UnsupportedModelError
from vllm_lens.spec.facts import ModelFacts


def json_value(raw: Any, field: str, request_id: str | None) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise LensRequestError(field, f"not valid JSON ({exc.msg})", request_id=request_id) from None


def checked_item(item: Any, allowed: tuple[str, ...], field: str, expected: str,
                 request_id: str | None) -> Mapping[str, Any]:
    """One item of a list-valued lens key: a mapping with only ``allowed`` keys; otherwise a
    ``LensRequestError`` naming ``field`` (saying what was ``expected``) or the unknown key."""
    if not isinstance(item, Mapping):
        raise LensRequestError(field, f"expected {expected}, got {type(item).__name__}",
                               request_id=request_id)
    unknown = [k for k in item if k not in allowed]
    if unknown:
        raise LensRequestError(f"{field}.{unknown[0]}", "unknown field; allowed fields are "
                               f"{', '.join(allowed)}", request_id=request_id)
    return item


def checked_flag(value: Any, field: str, request_id: str | None,
                 expected: str = "true or false") -> bool:
    """A boolean field: ``true`` / ``false``, or the strings ``"true"`` / ``"false"`` (what
    ``vllm_xargs`` carries); anything else a ``LensRequestError`` naming ``field`` and saying
    what was ``expected``."""
    if value in ("true", "false"):
        value = value == "true"
    if not isinstance(value, bool):
        raise LensRequestError(field, expected, request_id=request_id)
    return value


def parse_layers(raw: Any, facts: ModelFacts, field: str, request_id: str | None) -> tuple[int, ...]:
    if raw is True:
        return tuple(range(facts.n_layers))
    if hasattr(raw, "tolist") and not isinstance(raw, (str, bytes)):
        raw = raw.tolist()  # a numpy array or tensor of indices
    if not isinstance(raw, (list, tuple)):
        hint = ""
        if isinstance(raw, int) and not isinstance(raw, bool) and raw in (0, 1):
            hint = ("; over HTTP, vllm_xargs turns JSON true into 1: send the string \"true\" "
                    "for every layer, or a list such as \"[3, 7]\"")
        raise LensRequestError(
            field, f"expected a list of layer indices or true, got {type(raw).__name__} "
            f"{raw!r}{hint}", request_id=request_id,
        )
    if not raw:
        raise LensRequestError(field, "empty list; name at least one layer", request_id=request_id)
    return sorted_indices(raw, field, layer_rule(facts), request_id)


def parse_heads(raw: Any, facts: ModelFacts, field: str,
                request_id: str | None) -> tuple[int, ...]:
    """Query heads of the whole layer (every TP rank's), sorted, repeats dropped: a non-empty
    list, one index, a tensor or array, or (over HTTP) a JSON string of them."""
    raw = json_value(raw, field, request_id)
    if hasattr(raw, "tolist") and not isinstance(raw, (str, bytes)):
        raw = raw.tolist()
    if isinstance(raw, numbers.Integral) and not isinstance(raw, bool):
        raw = [raw]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise LensRequestError(field, f"expected a non-empty list of query heads, got {raw!r}",
                               request_id=request_id)
    if facts.n_heads <= 0:
        raise UnsupportedModelError(field, "this model's head count is not known, so heads "
                                    "cannot be chosen", request_id=request_id)
    return sorted_indices(raw, field, ("head index", facts.n_heads,
                                       f"is out of range; the model has query heads "
                                       f"0..{facts.n_heads - 1}"), request_id)


def layer_rule(facts: ModelFacts) -> tuple[str, int, str]:
    return ("layer index", facts.n_layers,
            f"is out of range; the model has layers 0..{facts.n_layers - 1}")


def position_rule(facts: ModelFacts) -> tuple[str, int, str]:
    return ("position", facts.max_model_len,
            f"is outside the model's context (0..{facts.max_model_len - 1})")


def sorted_indices(
    raw: list | tuple, field: str, rule: tuple[str, int, str], request_id: str | None
) -> tuple[int, ...]:
    """Check every item is an int in ``[0, upper)``; ``rule`` is (what, upper, complaint)."""
    what, upper, complaint = rule
    raw = [int(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool) else v
           for v in raw]  # numpy integers count
    for i, value in enumerate(raw):
        if isinstance(value, bool) or not isinstance(value, int):
            raise LensRequestError(f"{field}[{i}]", f"expected an integer {what}, got {value!r}",
                                   request_id=request_id)
        if not 0 <= value < upper:
            raise LensRequestError(f"{field}[{i}]", f"{what} {value} {complaint}",
                                   request_id=request_id)
    return tuple(sorted(set(raw)))


def check_site(point: str, facts: ModelFacts, where: str, request_id: str | None) -> None:
    """Refuse a point whose site this model's taps do not have, or that the start-up check of
    the model's layout did not prove (``worker.layout_check``)."""
    if (why := facts.refused_points.get(point)) is not None:
        raise UnsupportedModelError(
            where, f"the tap point {point} is refused on {facts.model_class}: the start-up "
            f"check of its {'derived' if facts.derived_layout else 'written'} layout on "
            f"its own weights did not prove it ({why})", request_id=request_id)
    site = tap_points.site_of(point, split=facts.split)
    if site not in facts.sites:
        if site == "mid" and facts.block == "parallel":
            raise UnsupportedModelError(
                where, f"{facts.model_class} runs attention and the MLP in parallel on "
                f"resid_pre, so there is no {point} (use resid_pre, attn_out, mlp_out or "
                "resid_post)", request_id=request_id)
        if not facts.inner_taps and site not in ("pre", "post", "attn"):
            why = "the engine was started with VLLM_LENS_INNER_TAPS=0"
        else:
            why = _MISSING_SITE.get(site, "its layers have no tap there")
        raise UnsupportedModelError(
            where, f"the tap point {point} is not available on {facts.model_class} ({why})",
            request_id=request_id)


#: Why a model offers no tap at a site (the engine's inner taps on).
_MISSING_SITE = {
    "final": "no final norm was found beside its layers, its LM head is quantized, or the "
             "engine's inner taps are off",
    "router": "its layers have no MoE router",
    "act": "its layers have no single MLP activation to read: MoE experts, or a down "
           "projection taking quantized input",
    "attn": "its attention is not vLLM's plain attention kernel (MLA, chunked local attention, "
            "shared KV, a query quantized first, or V heads of another size than Q/K or padded "
            "to it)",
    "pre": "its layers' inputs cannot be tapped",
    "attn_in": "its layout does not prove what its attention reads: offered on layouts "
               "with a norm before attention (derived ones once the start-up check proves "
               "attention reads its output), not on post-norm layers (their attention reads "
               "resid_pre: use it) or quantized models (vLLM may fuse the norm with the "
               "quantization of attention's input)",
    "mlp_in": "its layout does not prove what its MLP reads: offered on layouts whose "
              "pre-MLP norm feeds the MLP (derived ones once the start-up check proves it), "
              "not on post-norm layers (their MLP reads resid_mid: use it), parallel blocks "
              "or quantized models",
    "attn_post_norm": "its layers have no norm after attention (sandwich or post-norm layers "
                      "have one): what attention returns is attn_out itself there",
    "mlp_post_norm": "its layers have no norm after the MLP (sandwich or post-norm layers "
                     "have one): what the MLP returns is mlp_out itself there",
    "q_norm": "its attention has no norm of Q (Qwen3, Gemma 3/4, OLMo 2/3, OLMoE and EXAONE 4 "
              "have one), or its norm spans every head at once and tensor parallelism splits "
              "the heads (vLLM gathers them for it on every rank)",
    "k_norm": "its attention has no norm of K (Qwen3, Gemma 3/4, OLMo 2/3, OLMoE and EXAONE 4 "
              "have one), or its norm spans every head at once and tensor parallelism splits "
              "the heads (vLLM gathers them for it on every rank)",
}


def parse_write_point(raw: Any, facts: ModelFacts, where: str, request_id: str | None,
                       *, hook: bool = False) -> str:
    """A point steering or a hook writes to: one of ``points.STEERABLE`` (or an alias); for
    a hook also ``points.QK_HOOK_POINT`` (read-only)."""
    if hook and raw == tap_points.QK_HOOK_POINT:
        check_site("attn_q", facts, where, request_id)
        if facts.tp_size > 1:
            raise UnsupportedConfigError(
                where, f"hooks at {raw} would see each tensor-parallel rank's heads apart "
                f"(tensor_parallel_size={facts.tp_size}); use output_qk, or "
                "tensor_parallel_size=1", request_id=request_id)
        return raw
    try:
        point, layer = tap_points.resolve(raw)
    except KeyError as exc:
        raise LensRequestError(where, exc.args[0], request_id=request_id) from None
    if layer is not None or point not in tap_points.STEERABLE:
        raise LensRequestError(where, f"{raw!r} cannot be written to; use one of "
                               f"{', '.join(tap_points.STEERABLE)} (layers go in "
                               "layer_indices)", request_id=request_id)
    check_site(point, facts, where, request_id)
    return point
