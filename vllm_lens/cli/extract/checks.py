"""What ``vllm-lens extract`` checks against the model's configuration before any engine starts
(runs in: caller).

A typo in ``--layers`` or ``--positions``, or a model family vllm-lens does not map, would
otherwise cost an engine start and then fail every example alike. The model's configuration
(its ``config.json``, read by transformers as vLLM reads it) gives the layer count; the
positions selector is parsed as a request's would be. A configuration that cannot be read
here (a hub model while offline ...) skips the checks: the engine then reports the problem.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_against_model", "parse_layer_list"]


def parse_layer_list(text: str) -> list[int] | bool:
    """``--layers``: ``all`` (``True``) or comma-separated layer indices."""
    if text.strip() == "all":
        return True
    layers = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if not piece.lstrip("-").isdigit():
            raise SystemExit(f"vllm-lens extract: --layers: {piece!r} is not a layer index "
                             "(give comma-separated indices such as 3,7, or all)")
        layers.append(int(piece))
    if not layers:
        raise SystemExit("vllm-lens extract: --layers names no layer")
    return layers


def check_against_model(args: Any) -> None:
    """Refuse ``--layers`` out of the model's range, an unknown ``--positions`` selector and
    a model family vllm-lens does not map, each naming the flag."""
    from vllm_lens.common.positions import parse_selector

    if parse_selector(args.positions) is None:
        raise SystemExit(f"vllm-lens extract: --positions: unknown selector {args.positions!r}; "
                         "use all, prompt, generated, last_prompt, or a slice of one of the "
                         "first three such as prompt[1:], generated[-5:] or all[-1]")
    layers = parse_layer_list(args.layers) if args.layers is not None else []
    config = _config(args)
    if config is None:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_layers = getattr(text, "num_hidden_layers", None)
    if isinstance(n_layers, int) and layers is not True:
        bad = [layer for layer in layers if not 0 <= layer < n_layers]
        if bad:
            raise SystemExit(f"vllm-lens extract: --layers: {bad[0]} is out of range; "
                             f"{args.model} has layers 0..{n_layers - 1}")
    problem = _unmapped(args, config)
    if problem is not None:
        raise SystemExit(f"vllm-lens extract: --model: {problem}")


def _config(args: Any) -> Any:
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(
            args.model, trust_remote_code=bool(getattr(args, "trust_remote_code", False)),
            revision=getattr(args, "revision", None))
    except Exception:  # noqa: BLE001 - unreadable here: the engine will say why
        return None


def _unmapped(args: Any, config: Any) -> str | None:
    """Why vLLM's class for this model would have no vllm-lens layout, if it would not."""
    from vllm_lens.worker.layouts import LAYOUTS

    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        return None
    arch = architectures[0]
    via_transformers = f"TransformersForCausalLM:{arch}"
    if getattr(args, "model_impl", "auto") == "transformers":
        known = via_transformers in LAYOUTS
    else:
        known = arch in LAYOUTS or via_transformers in LAYOUTS
    if known:
        return None
    families = sorted({key.split(":")[-1] for key in LAYOUTS})
    return (f"{arch} is not a model family vllm-lens maps (its decoder layers' tap sites are "
            f"unknown); mapped: {', '.join(families)}")
