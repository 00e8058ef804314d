"""Throughput of vllm-lens vs plain vLLM, side by side in one run (SmolLM2-135M, CPU).

    python benchmarks/throughput.py [--prompts 64] [--tokens 64] [--rounds 3]
                                    [--modes compiled eager] [--cases NAME ...]

For each mode (vLLM's default compiled mode, and eager) two engines are started in their own
processes and stay alive together: plain vLLM (``VLLM_LENS_DISABLE=1``: the plugin does
nothing at all) and vLLM with the plugin. Every case then runs as a *pair*: the same batch on
the plain engine and on the plugin engine back to back (the order alternating between
rounds), and the pair's ratio is taken. The table gives, per case, the median ratio over
``--rounds`` pairs and the lowest and highest one, with the plugin engine's median tokens/s.

Wall-clock ratios on a shared 2-core machine carry noise of several percent even between
runs seconds apart, so the plugin engine also times its own code: the share of each run's
wall time spent in vllm-lens (the tap handler, the fetch of finished requests on the worker,
validation and collation in the front end). That share is the plugin's cost, measured in the
same run and far less noisy than a ratio of two runs; the per-call cost of the two taps per
layer, which plain traffic pays, is measured by ``tap_overhead.py``. To make this possible the
engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the worker runs in the
benchmark's process, which also keeps vLLM's engine-core busy loop from competing with the
model for the two cores).

Cases: plain requests, captures (1 layer; all layers; all layers at the last prompt token
only; ``attn_out`` at one layer; Q/K of one layer; every tap point at every layer at the last
prompt token), steering (1 layer with one shared vector or a distinct vector per request; every
layer; 256 requests each with its own vector at every layer; a replacement at one position;
a conditional vector gated by a probe read 5 layers earlier), monitors (one probe on every
request; plain requests beside one monitored; one probe alone, batch 1; by ``linear_probe``'s
score on every request and alone; by ``attention_to_span``'s score alone), attention steering (PASTA on every head of 8
layers: every request, plain requests beside one, one request alone), SAE features (one 16x-wide
JumpReLU SAE with random weights, d_sae = 9216, at layer 15: its top 32 features at every
position; steering by one of its features; clamping one), transcoders (a 16x-wide JumpReLU
skip transcoder for layer 15's MLP: its top 32 features, with and without the reconstruction
error of the MLP's output; the MLP replaced by it), direct logit attribution (the SAE's top 32
features with their attribution; every layer's attn_out and mlp_out), each with ``--prompts``
greedy requests of ``--tokens`` generated tokens; and plain requests one at a time (batch 1), where
the plugin's fixed per-step cost weighs most.
Results go to stdout as a Markdown table (paste into benchmarks/RESULTS.md), with the bytes of
rows and features each request brought back per position (captures and SAE features).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from harness import ChildEngine, time_plugin_code  # benchmarks/, this script's directory

HIDDEN, N_LAYERS = 576, 30


def _vector(seed: int, layers: list[int]):
    import torch

    from vllm_lens import SteeringVector

    g = torch.Generator().manual_seed(seed)
    return SteeringVector(activations=torch.randn(len(layers), HIDDEN, generator=g),
                          layer_indices=layers, scale=0.5)


def _replacement(seed: int, layer: int, position: int):
    import torch

    from vllm_lens import SteeringVector

    g = torch.Generator().manual_seed(seed)
    return SteeringVector(activations=torch.randn(1, 1, HIDDEN, generator=g) * 10,
                          layer_indices=[layer], position_indices=[position], mode="replace")


def _gated(seed: int, layer: int, read_at: int):
    import torch

    from vllm_lens import SteeringVector

    g = torch.Generator().manual_seed(seed)
    return SteeringVector(activations=torch.randn(1, HIDDEN, generator=g), layer_indices=[layer],
                          scale=0.5, condition={"probe": torch.randn(HIDDEN, generator=g),
                                                "layer": read_at})


def _monitor(seed: int, layer: int, action: str = "flag"):
    """A linear-probe monitor at ``layer`` whose threshold is never crossed (the generation
    runs its full length, as ``ignore_eos`` needs)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"name": f"m{seed}", "probe": torch.randn(HIDDEN, generator=g).tolist(),
            "layer": layer, "threshold": 1e30, "action": action}


def _hook_monitor(seed: int, layer: int):
    """``_monitor``'s probe as a monitor by the ``linear_probe`` named hook's score."""
    probe = _monitor(seed, layer)
    return {"name": probe["name"], "hook": "linear_probe", "layer": layer,
            "args": {"weight": probe["probe"]}, "threshold": 1e30, "action": "flag"}


PASTA = [{"layers": list(range(16, 24)), "heads": None, "emphasize": [0, 8], "alpha": 0.01}]

#: name -> (batch size: None = --prompts, extra_args for request i; None = a plain request)
CASES: dict[str, tuple[int | None, Callable[[int], Any]]] = {
    "plain requests": (None, lambda i: None),
    "plain requests, batch 1": (1, lambda i: None),
    "capture 1 layer, all positions": (None, lambda i: {"output_residual_stream": [15]}),
    "capture all 30 layers": (None, lambda i: {"output_residual_stream": True}),
    "capture all layers, last_prompt": (None, lambda i: {
        "output_residual_stream": {"layers": True, "positions": "last_prompt"}}),
    "attn_out at 1 layer": (None, lambda i: {"output_activations": {"attn_out": [15]}}),
    "Q/K of 1 layer": (None, lambda i: {"output_qk": [15]}),
    "every point, all layers, last_prompt": (None, lambda i: {"output_activations": {
        p: {"layers": True, "positions": "last_prompt"} for p in (
            "resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post", "mlp_post",
            "attn_z")}}),
    "steer 1 layer, same vector": (None, lambda i: {
        "apply_steering_vectors": [_vector(0, [15])]}),
    "steer 1 layer, distinct vectors": (None, lambda i: {
        "apply_steering_vectors": [_vector(i, [15])]}),
    "steer all 30 layers": (None, lambda i: {
        "apply_steering_vectors": [_vector(0, list(range(N_LAYERS)))]}),
    "256 requests, distinct vector at all layers": (256, lambda i: {
        "apply_steering_vectors": [_vector(i, list(range(N_LAYERS)))]}),
    "replace at 1 position (layer 15)": (None, lambda i: {
        "apply_steering_vectors": [_replacement(i, 15, 5)]}),
    "monitor 1 probe at 1 layer, every request": (None, lambda i: {
        "monitors": [_monitor(i, 15)]}),
    "plain requests beside 1 monitored": (None, lambda i: {
        "monitors": [_monitor(i, 15)]} if i == 0 else None),
    "monitor 1 probe at 1 layer, batch 1": (1, lambda i: {"monitors": [_monitor(i, 15)]}),
    # Monitors by a named hook's score: the hook runs for the request, the monitor reads it.
    "monitor by linear_probe hook, every request": (None, lambda i: {
        "monitors": [_hook_monitor(i, 15)]}),
    "monitor by linear_probe hook, batch 1": (1, lambda i: {
        "monitors": [_hook_monitor(i, 15)]}),
    "monitor by attention_to_span hook, batch 1": (1, lambda i: {"monitors": [{
        "name": "span", "hook": "attention_to_span", "layer": 15, "point": "attn_qk",
        "args": {"span": [0, 8], "queries": "generated"}, "reduce": "max",
        "threshold": 1e30, "action": "flag"}]}),
    # PASTA (``steer_attention``): every head of 8 layers, the first 8 prompt tokens emphasised.
    "PASTA at 8 layers, every request": (None, lambda i: {"steer_attention": PASTA}),
    "plain requests beside 1 PASTA": (None, lambda i: {"steer_attention": PASTA}
                                      if i == 0 else None),
    "PASTA at 8 layers, batch 1": (1, lambda i: {"steer_attention": PASTA}),
    "conditional steering at 1 layer": (None, lambda i: {
        "apply_steering_vectors": [_gated(i, 15, 10)]}),
    # One 16x-wide SAE (``_save_sae``) at layer 15's resid_post; ``SAE`` is its directory.
    "SAE features at 1 layer, top 32, all positions": (None, lambda i: {
        "output_sae_features": {"sae": SAE, "top_k": 32}}),
    "steer by 1 SAE feature": (None, lambda i: {
        "apply_steering_vectors": [{"sae": SAE, "feature": 7, "scale": 4.0}]}),
    "clamp 1 SAE feature": (None, lambda i: {
        "apply_steering_vectors": [{"sae": SAE, "feature": 7, "clamp": 2.0}]}),
    # The same clamp on a TopK SAE (``SAE_TOPK``, k = 32): every steered row is encoded in full.
    "clamp 1 TopK SAE feature": (None, lambda i: {
        "apply_steering_vectors": [{"sae": SAE_TOPK, "feature": 7, "clamp": 2.0}]}),
    # A 16x-wide JumpReLU skip transcoder standing in for layer 15's MLP (``TRANSCODER``).
    "transcoder features at 1 layer, top 32": (None, lambda i: {
        "output_sae_features": {"sae": TRANSCODER, "top_k": 32}}),
    "transcoder features, top 32, reconstruction": (None, lambda i: {
        "output_sae_features": {"sae": TRANSCODER, "top_k": 32, "reconstruction": True}}),
    "replace 1 MLP by a transcoder": (None, lambda i: {
        "replace_mlp": [{"transcoder": TRANSCODER, "keep_error": False}]}),
    # The same with thresholds calibrated for 64 active features per row: on the calibration
    # rows 93 of 9,216 (1.0 %) were active on average, as in trained ones.
    "replace 1 MLP by a sparse transcoder (1% active)": (None, lambda i: {
        "replace_mlp": [{"transcoder": SPARSE_TRANSCODER, "keep_error": False}]}),
    # Direct logit attribution: the SAE's top 32 features with their effect on the next
    # token's logit; every layer's attn_out and mlp_out onto it (``output_logit_attribution``).
    "SAE features, top 32, attribution": (None, lambda i: {
        "output_sae_features": {"sae": SAE, "top_k": 32, "attribution": True}}),
    "logit attribution of every layer": (None, lambda i: {"output_logit_attribution": True}),
}
#: The SAE cases' directories (set in the child from ``--child``'s config).
SAE = ""
SAE_TOPK = ""
TRANSCODER = ""
SPARSE_TRANSCODER = ""
D_SAE = 16 * HIDDEN


def _save_sae(path: str, architecture: str = "jumprelu") -> None:
    """A JumpReLU (or TopK, k = 32) SAE with random weights in sae-lens' layout (d_sae = 9216
    for SmolLM2's 576), saved by sae-lens itself (the test extra)."""
    import torch
    from sae_lens import JumpReLUSAEConfig, TopKSAEConfig
    from sae_lens.saes.sae import SAE as SaeLensSAE

    cfg = (JumpReLUSAEConfig(d_in=HIDDEN, d_sae=D_SAE, dtype="float32", device="cpu")
           if architecture == "jumprelu" else
           TopKSAEConfig(d_in=HIDDEN, d_sae=D_SAE, k=32, dtype="float32", device="cpu"))
    sae = SaeLensSAE.get_sae_class_for_architecture(cfg.architecture())(cfg)
    sae.cfg.metadata.hook_name = "blocks.15.hook_resid_post"
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in sae.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.05)
        if architecture == "jumprelu":
            sae.threshold.copy_(torch.rand(D_SAE, generator=g) * 0.05)
    sae.save_model(path)


def _save_transcoder(path: str, l0: int | None = None) -> None:
    """A JumpReLU skip transcoder with random weights for layer 15's MLP (d_sae = 9216),
    saved by sae-lens itself. Its random thresholds keep about half of the features active;
    with ``l0`` each feature's threshold is instead the quantile of its pre-activation over
    SmolLM2's layer-15 ``mlp_in`` rows of the benchmark's prompts (transformers) that leaves
    about ``l0`` features active per row, as a trained transcoder's (a few dozen)."""
    import torch
    from sae_lens.saes.sae import SAE as SaeLensSAE
    from sae_lens.saes.transcoder import JumpReLUSkipTranscoderConfig

    cfg = JumpReLUSkipTranscoderConfig(d_in=HIDDEN, d_sae=D_SAE, d_out=HIDDEN, dtype="float32",
                                       device="cpu", apply_b_dec_to_input=False)
    transcoder = SaeLensSAE.get_sae_class_for_architecture(cfg.architecture())(cfg)
    transcoder.cfg.metadata.hook_name = "blocks.15.hook_mlp_in"
    transcoder.cfg.metadata.hook_name_out = "blocks.15.hook_mlp_out"
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in transcoder.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.02)
        transcoder.threshold.copy_(torch.rand(D_SAE, generator=g) * 0.05)
        if l0 is not None:
            rows = _mlp_in_rows(15)
            h = rows @ transcoder.W_enc + transcoder.b_enc
            transcoder.threshold.copy_(h.quantile(1 - l0 / D_SAE, dim=0).clamp(min=1e-6))
    transcoder.save_model(path)


def _mlp_in_rows(layer: int):
    """SmolLM2's ``mlp_in`` rows (the post-attention norm's output) at ``layer`` for the
    benchmark's prompts, from transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_lens.demo_models import smollm2_dir

    path = str(smollm2_dir())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    seen = []
    norm = model.model.layers[layer].post_attention_layernorm
    handle = norm.register_forward_hook(lambda _m, _i, out: seen.append(out[0]))
    try:
        with torch.no_grad():
            for prompt in _prompts(64):
                model(**tokenizer(prompt, return_tensors="pt"))
    finally:
        handle.remove()
    return torch.cat(seen)


def _returned_bytes(out: Any) -> int:
    """Bytes of the rows and features a finished request brought back."""
    import torch

    def size(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, dict):
            return sum(size(v) for v in value.values())
        if isinstance(value, list):
            return sum(size(v) for v in value)
        return 0

    return (size(getattr(out, "activations", None)) + size(getattr(out, "sae_features", None))
            + size(getattr(out, "logit_attribution", None)))


def _prompts(n: int) -> list[str]:
    topics = ["the sea", "a city at night", "mathematics", "a forest", "music", "the moon",
              "an old library", "trains"]
    return [f"Write a short paragraph about {topics[i % len(topics)]} (variant {i})."
            for i in range(n)]


def serve_engine(cfg: dict) -> None:
    """In a child process: start one engine, then time the cases named on stdin, one per
    line, answering ``RESULT <tokens/s> <share of the time spent in vllm-lens>``."""
    from vllm import LLM, SamplingParams

    from vllm_lens.demo_models import smollm2_dir

    global SAE, SAE_TOPK, TRANSCODER, SPARSE_TRANSCODER
    SAE, SAE_TOPK, TRANSCODER = cfg["sae"], cfg["sae_topk"], cfg["transcoder"]
    SPARSE_TRANSCODER = cfg.get("sparse_transcoder", "")
    spent: dict[str, float] = {} if cfg["disabled"] else time_plugin_code()
    llm = LLM(str(smollm2_dir()), dtype="float32", max_model_len=1024, seed=0,
              kv_cache_memory_bytes=1 << 30, enforce_eager=cfg["eager"])
    # Warm-up; on the plugin engine with a lens request, so that every case, plain requests
    # included, runs with the tap handler attached (as on a server that has seen lens traffic).
    llm.generate(_prompts(8), SamplingParams(
        max_tokens=8, extra_args=None if cfg["disabled"] else {"output_residual_stream": [0]}))
    # Loads each on the worker (once, as a server would).
    for sae in (SAE, SAE_TOPK, TRANSCODER, SPARSE_TRANSCODER):
        if sae and not cfg["disabled"]:
            llm.generate(_prompts(1), SamplingParams(max_tokens=2, extra_args={
                "output_sae_features": {"sae": sae}}))
    print("READY", flush=True)
    for line in sys.stdin:
        batch, extra_for = CASES[line.strip()]
        n = batch or cfg["prompts"]
        # A disabled plugin must not see lens keys (vLLM would ignore them anyway).
        sps = [SamplingParams(max_tokens=cfg["tokens"], temperature=0, ignore_eos=True,
                              extra_args=None if cfg["disabled"] else extra_for(i))
               for i in range(n)]
        prompts = _prompts(max(n, cfg["prompts"]))[:n]
        spent.clear()
        start = time.perf_counter()
        outs = llm.generate(prompts, sps, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tps = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
        rows = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)
        per_row = sum(_returned_bytes(o) for o in outs) / rows
        print(f"RESULT {tps} {sum(spent.values()) / elapsed} {per_row}", flush=True)


class _Engine(ChildEngine):
    """A child process serving one engine (see ``serve_engine``)."""

    def __init__(self, cfg: dict, disabled: bool) -> None:
        super().__init__(__file__, cfg, disabled)

    def run(self, case: str) -> tuple[float, float, float]:
        """(tokens/s, share of the time spent in vllm-lens, bytes returned per position) of
        one run of ``case``."""
        tps, share, per_row = self.ask(case).split()
        return float(tps), float(share), float(per_row)


def measure_mode(cfg: dict, cases: list[str], rounds: int) -> dict[str, dict[str, float]]:
    plain, lens = _Engine(cfg, disabled=True), _Engine(cfg, disabled=False)
    try:
        ratios: dict[str, list[float]] = {c: [] for c in cases}
        speeds: dict[str, list[float]] = {c: [] for c in cases}
        shares: dict[str, list[float]] = {c: [] for c in cases}
        returned: dict[str, float] = {}
        for r in range(rounds):
            for case in cases:
                if r % 2 == 0:
                    (base, *_), (tps, share, per_row) = plain.run(case), lens.run(case)
                else:
                    (tps, share, per_row), (base, *_) = lens.run(case), plain.run(case)
                ratios[case].append(tps / base)
                speeds[case].append(tps)
                shares[case].append(share)
                returned[case] = per_row
    finally:
        plain.close()
        lens.close()
    return {c: {"median": statistics.median(ratios[c]), "low": min(ratios[c]),
                "high": max(ratios[c]), "tps": statistics.median(speeds[c]),
                "share": statistics.median(shares[c]), "bytes": returned[c]} for c in cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["compiled", "eager"],
                        choices=["compiled", "eager"])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES),
                        metavar="CASE", help="default: all of " + "; ".join(CASES))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        serve_engine(json.loads(args.child))
        return

    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm_lens_bench_sae_") as sae_dir:
        sae = sae_topk = transcoder = sparse_transcoder = ""
        if any("transcoder" in case and "sparse" not in case for case in args.cases):
            transcoder = os.path.join(sae_dir, "transcoder")
            _save_transcoder(transcoder)
        if any("sparse transcoder" in case for case in args.cases):
            sparse_transcoder = os.path.join(sae_dir, "sparse_transcoder")
            _save_transcoder(sparse_transcoder, l0=64)
        if any("SAE" in case and "TopK" not in case for case in args.cases):
            sae = os.path.join(sae_dir, "jumprelu")
            _save_sae(sae)
        if any("TopK SAE" in case for case in args.cases):
            sae_topk = os.path.join(sae_dir, "topk")
            _save_sae(sae_topk, "topk")
        for mode in args.modes:
            cfg = dict(eager=mode == "eager", prompts=args.prompts, tokens=args.tokens, sae=sae,
                       sae_topk=sae_topk, transcoder=transcoder,
                       sparse_transcoder=sparse_transcoder)
            for case, r in measure_mode(cfg, args.cases, args.rounds).items():
                rows.append((mode, case, r))
                print(f"{mode:8} {case:34} {r['median']:.3f} ({r['low']:.3f}-{r['high']:.3f}) "
                      f"in vllm-lens {r['share']:.2%}", file=sys.stderr, flush=True)

    print(f"\n{args.prompts} prompts x {args.tokens} generated tokens (batch-1 case: one "
          f"prompt), greedy, {args.rounds} paired rounds\n")
    print("| mode | case | plugin tokens/s | ratio to plain vLLM (median) | lowest | highest | "
          "time in vllm-lens | bytes returned per position |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for mode, case, r in rows:
        print(f"| {mode} | {case} | {r['tps']:.1f} | {r['median']:.3f} | {r['low']:.3f} | "
              f"{r['high']:.3f} | {r['share']:.2%} | {r['bytes']:.0f} |")


if __name__ == "__main__":
    main()
