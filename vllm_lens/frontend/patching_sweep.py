"""Activation-patching sweeps: a grid of (layer, position) restorations run as one batch of engine
requests, with the metric per cell (runs in: front end).

Adds ``patching_sweep(prompt, clean, layers, positions, metric, corrupt=None,
point="resid_post")`` to ``vllm.LLM`` and ``AsyncLLM``, and ``POST /v1/lens/patching_sweep``
to the OpenAI server (``frontend.http.routes_patching``: its JSON body has the same names;
tensors as JSON tensor records).

Cell ``(i, j)`` is the prompt run with the ``corrupt`` steering vectors (e.g. noise added to
the subject's embeddings: ``layer_indices=[-1]``) plus one ``mode="replace"`` vector writing
``clean[i, j]`` over ``point`` of layer ``layers[i]`` at position ``positions[j]``. A
corrupting vector may steer by SAE feature (``{"sae", "feature", "scale" | "clamp"}``, as in
``apply_steering_vectors``): its SAE is described and its rows and columns fetched once for
all the variants (over HTTP, only SAEs the server serves by name); a clamp at a (layer, site)
the sweep patches is refused, since a clamp must be the only write at its site. Every
variant is an ordinary lens request of one forward pass over the prompt and one greedy token,
and the metric is read from vLLM's logprobs of the metric's tokens at the last prompt position
(``logprob_token_ids``; raw logprobs, so a difference of two is their logit difference):
``{"logit_diff": [a, b]}``, ``{"logprob": a}`` or ``{"prob": a}``. Nothing the caller sends
runs as code, so a shared server accepts it like any steering request; the number of cells is
bounded by ``VLLM_LENS_MAX_SWEEP_CELLS`` (default 4096), and the corruption's decoded size
times the cells by ``VLLM_LENS_MAX_DECODED_BYTES`` (every variant carries its own copy). On
``AsyncLLM`` a variant that fails, or a caller that is cancelled, cancels the other variants
(vLLM aborts their requests).

Returns ``{"grid": [len(layers), len(positions)] float64 tensor, "corrupted": metric of the
corrupted run alone, "uncorrupted": metric of the prompt without ``corrupt``, "layers",
"positions"}``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm import SamplingParams

from vllm_lens import envs
from vllm_lens.common import wire
from vllm_lens.common import points as tap_points
from vllm_lens.errors import LensRequestError, UnsupportedConfigError
from vllm_lens.frontend.session import LensSession
from vllm_lens.spec.facts import facts_from_describe
from vllm_lens.frontend.engine_methods import drive, drive_async
from vllm_lens.frontend import response_scope
from vllm_lens.frontend.sae_names import described_beforehand, steering_described
from vllm_lens.sinks.config import serves_http
from vllm_lens.spec import ModelFacts, STEER_KEY, SteerSpec, parse_steering
from vllm_lens.spec.sae_steering import is_feature_item

__all__ = ["install"]
_METRICS = {"logit_diff": 2, "logprob": 1, "prob": 1}


@dataclass(frozen=True)
class _Plan:
    prompt_ids: list[int]
    layers: list[int]
    positions: list[int]
    metric: tuple[str, list[int]]
    params: list[SamplingParams]
    """Uncorrupted, corrupted, then the cells in row-major (layer, position) order."""

    def result(self, outputs: Sequence[Any]) -> dict[str, Any]:
        values = [self._metric(out) for out in outputs]
        grid = torch.tensor(values[2:], dtype=torch.float64).reshape(len(self.layers),
                                                                      len(self.positions))
        return {"grid": grid, "uncorrupted": values[0], "corrupted": values[1],
                "layers": self.layers, "positions": self.positions}

    def _metric(self, output: Any) -> float:
        if getattr(output, "lens_error", None) is not None:
            raise output.lens_error
        logprobs = output.outputs[0].logprobs[0]
        kind, tokens = self.metric
        lp = [logprobs[t].logprob for t in tokens]
        if kind == "logit_diff":
            return lp[0] - lp[1]
        return lp[0] if kind == "logprob" else math.exp(lp[0])


def _plan(facts: ModelFacts, tokenizer: Any, model_config: Any, prompt: Any, clean: Any,
          layers: Any, positions: Any, metric: Any, corrupt: Any, point: Any,
          saes: Any = None) -> _Plan:
    """Validate a sweep against the model and build its variants' sampling parameters.
    ``saes``: the SAEs ``corrupt`` steers by, described beforehand (``steering_described``)."""
    from vllm_lens.steering import SteeringVector

    if model_config.logprobs_mode != "raw_logprobs":
        raise UnsupportedConfigError(
            "metric", f"the sweep reads raw logprobs, but this engine returns "
            f"{model_config.logprobs_mode}; start it with the default "
            "logprobs_mode='raw_logprobs'")
    if isinstance(prompt, str):
        ids = list(tokenizer.encode(prompt))
    elif isinstance(prompt, (list, tuple)) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise LensRequestError("prompt", "expected a string or a non-empty list of token ids")
    layers = _ints(layers, "layers", facts.n_layers, "layer")
    positions = _ints(positions, "positions", len(ids), "prompt position")
    cells = len(layers) * len(positions)
    limit = envs.max_sweep_cells()
    if cells > limit:
        raise LensRequestError("layers", f"{len(layers)} layers x {len(positions)} positions "
                               f"is {cells} cells, above this engine's limit of {limit} "
                               "(VLLM_LENS_MAX_SWEEP_CELLS)")
    kind, tokens = _metric(metric, model_config.get_vocab_size())
    clean = _clean(clean, (len(layers), len(positions), facts.hidden_size))
    if not isinstance(point, str):
        raise LensRequestError("point", f"expected a tap point name, got {point!r}")
    try:
        writable = SteeringVector(activations=clean[:1, :1], layer_indices=layers[:1],
                                  position_indices=positions[:1], mode="replace",
                                  hook_point=point)
    except ValueError as exc:
        raise LensRequestError("point", str(exc)) from None
    # A point replacements may write, here.
    (written,) = parse_steering([writable], facts, "point")
    corrupt = [] if corrupt is None else (list(corrupt) if isinstance(corrupt, (list, tuple))
                                          else [corrupt])
    if corrupt:
        specs = parse_steering(corrupt, facts, "corrupt", saes)  # errors name the caller's field
        _check_clamps_unpatched(specs, layers, written.point, facts)
        if len(specs) + 1 > envs.max_steering_vectors():  # each cell adds its patch
            raise LensRequestError(
                "corrupt", f"{len(specs)} corrupting vectors and each cell's patch come to "
                f"{len(specs) + 1} per variant, above this server's "
                f"VLLM_LENS_MAX_STEERING_VECTORS ({envs.max_steering_vectors()})")
        # Every variant carries its own copy of the corruption to the engine: charge them all,
        # decoded (compressed sizes would let a compressible corruption through).
        total = cells * sum(_decoded_bytes(spec) for spec in specs)
        if total > envs.max_decoded_bytes():
            raise LensRequestError(
                "corrupt", f"{cells} variants each carrying these vectors come to {total:,} "
                f"bytes, above VLLM_LENS_MAX_DECODED_BYTES ({envs.max_decoded_bytes():,}); "
                "use fewer cells or smaller corrupting vectors")
        # Decoded once here, so that the variants do not decode the caller's forms again.
        corrupt = [_live(item) for item in corrupt]

    def params(vectors: list[Any]) -> SamplingParams:
        return SamplingParams(max_tokens=1, temperature=0,
                              logprob_token_ids=list(tokens),
                              extra_args={STEER_KEY: vectors} if vectors else None)

    variants = [params([]), params(corrupt)]
    for i, layer in enumerate(layers):
        for j, position in enumerate(positions):
            patch = SteeringVector(activations=clean[i, j][None, None], layer_indices=[layer],
                                   position_indices=[position], mode="replace",
                                   hook_point=point)
            variants.append(params([*corrupt, patch]))
    return _Plan(ids, layers, positions, (kind, tokens), variants)


def _check_clamps_unpatched(specs: Sequence[SteerSpec], layers: Sequence[int], point: str,
                            facts: ModelFacts) -> None:
    """A clamp must be the only clamp or replacement at its (layer, site)
    (``spec.sae_steering.check_clamps_alone``): a corrupting clamp where the sweep writes its
    clean rows would meet a replacement in every cell of that layer."""
    patched = tap_points.site_of(point, split=facts.split)
    for i, spec in enumerate(specs):
        if spec.mode != "clamp" or tap_points.site_of(spec.point, split=facts.split) != patched:
            continue
        both = sorted(set(spec.layers) & set(layers))
        if both:
            raise LensRequestError(
                f"corrupt[{i}].clamp", f"clamps features at layer {both[0]}'s {patched} site, "
                f"where the sweep writes its clean rows ({point}); a clamp must be the only "
                "clamp or replacement at its site: patch other layers, or another point")


def _decoded_bytes(spec: SteerSpec) -> int:
    """What one variant's copy of ``spec`` decodes to (a clamp's encoder columns included)."""
    tensors = [wire.loads(spec.vectors)]
    if spec.clamp is not None:
        tensors += [t for t in wire.loads(spec.clamp.encoder).values()
                    if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _live(item: Any) -> Any:
    """A validated ``SteeringVector`` for one of the caller's forms of a vector; an item
    steering by feature as it is (each variant's parse finds its SAE described beforehand)."""
    from vllm_lens.steering import SteeringVector

    if isinstance(item, SteeringVector):
        return item
    if is_feature_item(item):
        return dict(item)
    if isinstance(item, str):
        return SteeringVector.from_wire(item)
    return SteeringVector.model_validate(dict(item))


def _ints(raw: Any, field: str, upper: int, what: str) -> list[int]:
    if not isinstance(raw, (list, tuple)) or not raw:
        raise LensRequestError(field, f"expected a non-empty list of {what}s")
    out = []
    for i, value in enumerate(raw):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < upper:
            raise LensRequestError(f"{field}[{i}]", f"{value!r} is not a {what} in 0..{upper - 1}")
        out.append(int(value))
    if len(set(out)) != len(out):
        raise LensRequestError(field, f"has duplicates: {out}")
    return out


def _metric(raw: Any, vocab_size: int) -> tuple[str, list[int]]:
    if not isinstance(raw, dict) or len(raw) != 1 or next(iter(raw)) not in _METRICS:
        raise LensRequestError("metric", 'expected {"logit_diff": [a, b]}, {"logprob": a} or '
                               '{"prob": a} (token ids)')
    (kind, value), = raw.items()
    tokens = value if isinstance(value, (list, tuple)) else [value]
    if len(tokens) != _METRICS[kind] or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
            for t in tokens):
        raise LensRequestError(f"metric.{kind}", f"expected {_METRICS[kind]} token id(s) in "
                               f"0..{vocab_size - 1}, got {value!r}")
    return kind, list(tokens)


def _clean(raw: Any, shape: tuple[int, int, int]) -> torch.Tensor:
    limit = wire.decode_limit(envs.max_decoded_bytes(),
                              "VLLM_LENS_MAX_DECODED_BYTES (the sweep's clean activations)")
    try:
        with limit:
            tensor = wire.tensor_from_json(raw) if isinstance(raw, dict) else raw
    except ValueError as exc:
        raise LensRequestError("clean", str(exc)) from None
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise LensRequestError("clean", "expected a float tensor [len(layers), len(positions), "
                               "hidden]")
    if tuple(tensor.shape) != shape:
        raise LensRequestError("clean", f"shape is {list(tensor.shape)}, expected {list(shape)} "
                               "([len(layers), len(positions), hidden])")
    if not torch.isfinite(tensor).all():
        raise LensRequestError("clean", "contains NaN or inf")
    return tensor.float()


def _sync_sweep(self: Any, prompt: Any, clean: Any, layers: Any, positions: Any, metric: Any,
                corrupt: Any = None, point: str = "resid_post") -> dict[str, Any]:
    from vllm.inputs import TokensPrompt

    engine = self.llm_engine
    session = LensSession.of(engine)
    if session.facts is None:
        session.facts = facts_from_describe(engine.collective_rpc("lens_describe"))
    saes = drive(engine, steering_described(session, corrupt, paths=True))
    plan = _plan(session.facts, self.get_tokenizer(), engine.model_config, prompt, clean,
                 layers, positions, metric, corrupt, point, saes)
    prompts = [TokensPrompt(prompt_token_ids=plan.prompt_ids)] * len(plan.params)
    with described_beforehand(saes):
        return plan.result(self.generate(prompts, plan.params, use_tqdm=False))


async def _async_sweep(self: Any, prompt: Any, clean: Any, layers: Any, positions: Any,
                       metric: Any, corrupt: Any = None, point: str = "resid_post"
                       ) -> dict[str, Any]:
    import uuid

    from vllm.inputs import TokensPrompt

    from vllm_lens.frontend.async_engine import model_facts

    facts = await model_facts(self)
    # Over HTTP a client names the server's SAEs, never a directory.
    saes = await drive_async(self, steering_described(LensSession.of(self), corrupt,
                                                      paths=not serves_http()))
    plan = await asyncio.to_thread(_plan, facts, self.get_tokenizer(), self.model_config,
                                   prompt, clean, layers, positions, metric, corrupt, point,
                                   saes)
    sweep_id = uuid.uuid4().hex

    async def one(k: int, params: SamplingParams) -> Any:
        final = None
        async for out in self.generate(TokensPrompt(prompt_token_ids=plan.prompt_ids), params,
                                       f"sweep-{sweep_id}-{k}"):
            final = out
        return final

    # One variant failing (or the caller being cancelled) cancels the others, which aborts
    # their engine requests.
    try:
        # The variants' tasks inherit the mark and the SAEs described for them.
        with response_scope.lens_route(), described_beforehand(saes):
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(k, p)) for k, p in enumerate(plan.params)]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return plan.result([task.result() for task in tasks])


def install() -> None:
    from vllm import LLM
    from vllm.v1.engine.async_llm import AsyncLLM

    if not hasattr(LLM, "patching_sweep"):
        LLM.patching_sweep = _sync_sweep
    if not hasattr(AsyncLLM, "patching_sweep"):
        AsyncLLM.patching_sweep = _async_sweep
