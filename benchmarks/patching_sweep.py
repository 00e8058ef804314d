"""Causal tracing as a patching sweep vs the same sweep written with hooks, side by side.

    python benchmarks/patching_sweep.py [--rounds 3]

One SmolLM2 engine (float32, eager, as ``examples/causal_tracing.py``) runs the example's
sweep (every layer x every prompt position of "The Eiffel Tower is located in the city of",
noise on the subject's embeddings, the probability of the clean answer per cell) two ways,
alternating which goes first between rounds:

- ``patching_sweep``: steering vectors only (an embedding addition and one ``replace`` per
  cell), the metric from vLLM's logprobs of the answer token;
- hooks: the example's former pickled ``Hook`` functions (a pre-hook adding the noise, a
  post-hook writing the clean row, a hook on the last layer computing the answer's
  probability through the final norm and the unembedding).

Prints the wall time of each, their ratio, and the largest difference between the two grids.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from causal_tracing import subject_noise  # noqa: E402 - the example's own corruption

PROMPT = "The Eiffel Tower is located in the city of"
SUBJECT = "Eiffel Tower"


def answer_prob(target: int, last: int):
    def hook(ctx, hidden):
        rows = (ctx.positions == last).nonzero().flatten()
        if rows.numel():
            x = hidden[rows[0]].float()
            eps = ctx.model.config.rms_norm_eps
            x = x * torch.rsqrt(x.pow(2).mean() + eps) * ctx.get_parameter("model.norm.weight")
            logits = ctx.get_parameter("lm_head.weight").float() @ x
            ctx.saved["p"] = float(torch.softmax(logits, -1)[target])
    return hook


def add_noise(noise: torch.Tensor, positions: list[int]):
    def hook(ctx, hidden):
        out = hidden.clone()
        for row, p in enumerate(positions):
            out[ctx.positions == p] += noise[row].to(hidden)
        return out
    return hook


def restore(clean: torch.Tensor, position: int):
    def hook(ctx, hidden):
        rows = (ctx.positions == position).nonzero().flatten()
        if not rows.numel():
            return None
        out = hidden.clone()
        out[rows] = clean[position].to(hidden)
        return out
    return hook


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_lens import Hook, SteeringVector
    from vllm_lens.demo_models import smollm2_dir

    llm = LLM(str(smollm2_dir()), dtype="float32", max_model_len=512, enforce_eager=True,
              kv_cache_memory_bytes=256 << 20)
    tok = llm.get_tokenizer()
    ids = tok(PROMPT)["input_ids"]
    n, n_layers = len(ids), llm.llm_engine.model_config.hf_config.num_hidden_layers
    clean = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        max_tokens=1, temperature=0, extra_args={
            "output_residual_stream": {"layers": True, "positions": "prompt"}}))[0]
    target = clean.outputs[0].token_ids[0]
    streams = clean.activations["residual_stream"]
    subject, noise = subject_noise(tok, PROMPT, SUBJECT, 3.0, streams.shape[-1],
                                   float(streams[0].std()))

    def by_sweep() -> torch.Tensor:
        corrupt = SteeringVector(activations=noise[None], layer_indices=[-1],
                                 position_indices=subject)
        return llm.patching_sweep(ids, streams, list(range(n_layers)), list(range(n)),
                                  {"prob": target}, corrupt=[corrupt])["grid"]

    def by_hooks() -> torch.Tensor:
        def request(extra):
            hooks = [Hook(add_noise(noise, subject), [0], pre=True), *extra,
                     Hook(answer_prob(target, n - 1), [n_layers - 1])]
            return SamplingParams(max_tokens=1, temperature=0, extra_args={"apply_hooks": hooks})
        grid = [(layer, p) for layer in range(n_layers) for p in range(n)]
        params = [request([])] + [request([Hook(restore(streams[layer], p), [layer])])
                                  for layer, p in grid]
        outs = llm.generate([{"prompt_token_ids": ids}] * len(params), params, use_tqdm=False)
        values = [o.hook_results[str(len(o.hook_results) - 1)]["p"] for o in outs[1:]]
        return torch.tensor(values, dtype=torch.float64).reshape(n_layers, n)

    times: dict[str, list[float]] = {"patching_sweep": [], "hooks": []}
    grids = {}
    runs = {"patching_sweep": by_sweep, "hooks": by_hooks}
    by_sweep(), by_hooks()  # warm-up
    for r in range(args.rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            start = time.perf_counter()
            grids[name] = runs[name]()
            times[name].append(time.perf_counter() - start)
    sweep_s, hooks_s = (statistics.median(times[k]) for k in ("patching_sweep", "hooks"))
    diff = float((grids["patching_sweep"] - grids["hooks"]).abs().max())
    print(f"\n{n_layers} layers x {n} positions = {n_layers * n} cells (+2 baselines), "
          f"median of {args.rounds} rounds\n")
    print("| sweep | wall time (s) | ratio to hooks |")
    print("|---|---:|---:|")
    print(f"| patching_sweep | {sweep_s:.2f} | {sweep_s / hooks_s:.3f} |")
    print(f"| hooks (pickled Hook functions) | {hooks_s:.2f} | 1.000 |")
    print(f"\nlargest |difference| between the two grids of probabilities: {diff:.2e}")


if __name__ == "__main__":
    main()
