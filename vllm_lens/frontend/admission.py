"""Admission: refuse, before it is scheduled, a lens request whose size could overload the workers
(runs in: front end).

Parsing (``spec``) checks what a request *is*; admission checks what it *costs*, which needs
the request's size: its prompt length (known once the engine input is tokenized), its
``max_tokens``, its ``n`` and the model's context. Two bounds are enforced:

- a capture may hold at most ``VLLM_LENS_MAX_CAPTURE_BYTES`` on a worker at once: layers × the
  most rows its selection can keep while the request runs × hidden × dtype bytes × ``n``
  (reductions happen at fetch time and do not shrink it; rolling windows such as
  ``"generated[-5:]"`` keep only their last positions, see ``positions.Selector.held_bound``);
- a worker holds at most ``VLLM_LENS_WORKER_MAX_BYTES`` of captured rows: each request
  reserves its bound (``capture_reservation``, carried in its payload) when it first runs on a
  worker, and one that does not fit beside the reservations of the requests held there fails
  at once, before any of its rows exist; nobody else's rows are dropped for it;
- attention steering keeps the keys and values of the layers it steers on every worker
  (``worker.attention_steering``): its bound, positions × layers × key heads per rank × head
  size × 2 × dtype bytes × ``n``, may not exceed ``VLLM_LENS_ATTENTION_STEER_MAX_BYTES``
  (checked here once the prompt is tokenized; each worker reserves the bound, with the prompt
  it sees, when the request first runs, and fails it there if it does not fit);
- a named hook that declares ``max_rows = (ENV_VAR, default)`` (``logit_lens_topk``) may run on
  at most that many rows: hooked layers × positions × ``n`` (hooked requests compute every
  position, prefix cache or not), summed over all of the request's hooks of that name and
  the hooks its monitors run (``monitors[i].hook``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from vllm_lens import envs
from vllm_lens.errors import LensRequestError
from vllm_lens.common.positions import parse_selector
from vllm_lens.common.points import ATTENTION_SIGNALS, RESIDUAL_SIGNAL
from vllm_lens.spec import (
    ACTIVATIONS_KEY,
    ATTENTION_STEER_KEY,
    CAPTURE_KEY,
    HOOKS_KEY,
    LOGIT_KEY,
    MONITORS_KEY,
    QK_KEY,
    SAE_KEY,
    CaptureSpec,
    LensRequest,
    ModelFacts,
)

__all__ = ["attention_history_bound", "capture_bound", "capture_reservation",
           "check_admission", "check_capture_size"]

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def _lengths(facts: ModelFacts, prompt_len: int | None,
             max_tokens: int | None) -> dict[str, int]:
    """The most positions each range can have: the prompt (its length, or the whole context if
    it is not tokenized yet), the generated tokens and all of them, within the context."""
    context = facts.max_model_len
    budget = context if max_tokens is None else max_tokens
    if prompt_len is None:  # any split of the context: bound each range by itself
        return {"prompt": context, "generated": min(budget, context), "all": context}
    prompt = min(prompt_len, context)
    generated = max(0, min(budget, context - prompt))
    return {"prompt": prompt, "generated": generated, "all": prompt + generated}


def capture_bound(spec: CaptureSpec, facts: ModelFacts, prompt_len: int | None,
                  max_tokens: int | None, row_bytes: int | None = None) -> tuple[int, int]:
    """(rows, bytes): the most rows one sample of a request holds on a worker at once, all
    layers together, and their size (``row_bytes``: one row's, if not the signal's own)."""
    lengths = _lengths(facts, prompt_len, max_tokens)
    if isinstance(spec.positions, tuple):
        rows = min(len(spec.positions), lengths["all"])
    else:
        selector = parse_selector(spec.positions)
        assert selector is not None, spec.positions  # validated by spec
        rows = selector.held_bound(lengths[selector.base])
    if row_bytes is None:
        row_bytes = facts.row_width(spec.signal, spec.layers) * _ITEMSIZE.get(facts.dtype, 4)
    return rows, len(spec.layers) * rows * row_bytes


def sae_bounds(lens: LensRequest, facts: ModelFacts, prompt_len: int | None,
               max_tokens: int | None) -> list[tuple[int, int]]:
    """``capture_bound`` of each SAE feature entry: its rows hold ``width`` float32 values
    (the top features, not the SAE's input)."""
    return [capture_bound(s.capture(), facts, prompt_len, max_tokens, row_bytes=4 * s.width)
            for s in lens.saes]


def capture_reservation(lens: LensRequest, facts: ModelFacts, prompt_len: int | None,
                        max_tokens: int | None) -> int:
    """Bytes a worker reserves for one sample of ``lens`` when it first runs: what its
    captures together can hold at once (``capture_bound``), so that a worker admits only
    requests whose rows all fit beside the others' (``VLLM_LENS_WORKER_MAX_BYTES``)."""
    dla = () if lens.logit_attribution is None else lens.logit_attribution.captures()
    return (sum(capture_bound(spec, facts, prompt_len, max_tokens)[1]
                for spec in (*lens.captures, *dla))
            + sum(size for _, size in sae_bounds(lens, facts, prompt_len, max_tokens)))


def check_capture_size(specs: CaptureSpec | Sequence[CaptureSpec], facts: ModelFacts,
                       prompt_len: int | None, max_tokens: int | None, n: int,
                       request_id: str | None = None) -> None:
    """Refuse captures that together could hold more than ``VLLM_LENS_MAX_CAPTURE_BYTES``."""
    specs = (specs,) if isinstance(specs, CaptureSpec) else tuple(specs)
    bounds = [capture_bound(spec, facts, prompt_len, max_tokens) for spec in specs]
    total = sum(size for _, size in bounds) * max(1, n)
    cap = envs.max_capture_bytes()
    if total <= cap:
        return
    (rows, _), spec = max(zip(bounds, specs), key=lambda pair: pair[0][1])
    field = (CAPTURE_KEY if spec.signal == RESIDUAL_SIGNAL
             else QK_KEY if spec.signal in ATTENTION_SIGNALS
             else f"{ACTIVATIONS_KEY}.{spec.signal}")
    row_width = facts.row_width(spec.signal, spec.layers)
    width = (f"hidden {facts.hidden_size}" if row_width == facts.hidden_size
             else f"{row_width} values")
    together = f"; {len(specs)} signals together" if len(specs) > 1 else ""
    raise LensRequestError(
        field,
        f"could hold up to {total:,} bytes ({len(spec.layers)} layers x {rows} positions x "
        f"{width} x {_ITEMSIZE.get(facts.dtype, 4)} bytes ({facts.dtype})"
        + (f" x n={n}" if n > 1 else "") + f"{together}), above this server's "
        f"VLLM_LENS_MAX_CAPTURE_BYTES ({cap:,}); select fewer layers or positions (e.g. "
        "'prompt[-1]', 'generated[-16:]'), lower max_tokens, or raise the setting",
        request_id=request_id)


def attention_history_bound(lens: LensRequest, facts: ModelFacts, positions: int) -> int:
    """The most bytes one sample's attention-steering history takes on one worker: every
    steered layer's key heads on one tensor-parallel rank (all of them: a bound),
    ``positions`` rows of keys and values in the model's dtype."""
    layers = {layer for edit in lens.steer_attention for layer in edit.layers}
    tp = max(1, facts.tp_size)
    per_position = sum(max(1, int(facts.qk_meta[layer]["num_kv_heads"]) // tp)
                       * int(facts.qk_meta[layer]["head_size"]) for layer in layers)
    return positions * per_position * 2 * _ITEMSIZE.get(facts.dtype, 4)


def check_admission(lens: LensRequest, facts: ModelFacts, prompt_len: int | None,
                    max_tokens: int | None, n: int, request_id: str | None = None) -> None:
    """Refuse ``lens`` if its captures (together), its attention-steering history or a
    row-bounded named hook are too large."""
    if lens.steer_attention:
        # Prompt not tokenized yet: the least it can hold (one prompt token), so that only a
        # request that can never fit is refused here; the workers check the real bound.
        positions = (_lengths(facts, prompt_len, max_tokens)["all"] if prompt_len is not None
                     else min(facts.max_model_len, 1 + (max_tokens or facts.max_model_len)))
        bound = attention_history_bound(lens, facts, positions) * max(1, n)
        limit = envs.attention_steer_max_bytes()
        if bound > limit:
            raise LensRequestError(
                ATTENTION_STEER_KEY, f"its keys and values could take up to {bound:,} bytes on "
                f"a worker (steered layers x positions x key heads x head size x 2"
                + (f" x n={n}" if n > 1 else "") + f"), above this server's "
                f"VLLM_LENS_ATTENTION_STEER_MAX_BYTES ({limit:,}); steer fewer layers, lower "
                "max_tokens or shorten the prompt, or raise the setting",
                request_id=request_id)
    if lens.captures:
        check_capture_size(lens.captures, facts, prompt_len, max_tokens, n, request_id)
    if lens.saes or lens.logit_attribution is not None:  # with the captures, the same cap
        total = capture_reservation(lens, facts, prompt_len, max_tokens) * max(1, n)
        if total > envs.max_capture_bytes() and not lens.saes:
            raise LensRequestError(
                LOGIT_KEY, f"the rows it keeps until the request ends (the embedding's, each "
                f"layer's attn_out and mlp_out, the last layer's stream: hidden "
                f"{facts.hidden_size} per position) and the request's captures could hold up "
                f"to {total:,} bytes, above this server's VLLM_LENS_MAX_CAPTURE_BYTES "
                f"({envs.max_capture_bytes():,}); select fewer layers or positions, or lower "
                "max_tokens", request_id=request_id)
        if total > envs.max_capture_bytes():
            raise LensRequestError(
                SAE_KEY, f"its top features and captures could hold up to {total:,} bytes, "
                f"above this server's VLLM_LENS_MAX_CAPTURE_BYTES "
                f"({envs.max_capture_bytes():,}); select fewer positions or a smaller top_k, "
                "or lower max_tokens", request_id=request_id)
    named = [(f"{HOOKS_KEY}[{i}]", hook) for i, hook in enumerate(lens.hooks)]
    named += [(f"{MONITORS_KEY}[{i}].hook", m.hook_spec())
              for i, m in enumerate(lens.monitors) if m.hook]
    if not any(h.name for _, h in named):
        return
    from vllm_lens import named_hooks

    positions = _lengths(facts, prompt_len, max_tokens)["all"]
    # A factory's rows are summed over every hook of the request that names it: copies of
    # one hook cost what one hook on all their layers would.
    layers_by_name: dict[str, int] = {}
    copies: dict[str, int] = {}
    for where, hook in named:
        limit = getattr(named_hooks.load(hook.name), "max_rows", None) if hook.name else None
        if limit is None:
            continue
        setting, default = limit
        cap = _int_setting(setting, default)
        layers = layers_by_name[hook.name] = layers_by_name.get(hook.name, 0) + len(hook.layers)
        copies[hook.name] = copies.get(hook.name, 0) + 1
        rows = layers * positions * max(1, n)
        if rows > cap:
            together = (f", {copies[hook.name]} hooks named so together"
                        if copies[hook.name] > 1 else "")
            raise LensRequestError(
                where,
                f"named hook {hook.name!r} would run on up to {rows:,} rows ({layers} layers x "
                f"{positions} positions" + (f" x n={n}" if n > 1 else "") + f"{together}), "
                f"above this server's {setting} ({cap:,}); hook fewer layers, lower "
                "max_tokens, or raise the setting", request_id=request_id)


def _int_setting(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise LensRequestError(name, f"the server's setting {name}={raw!r} is not an integer; "
                               "the operator must fix it") from None
