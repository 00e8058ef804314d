"""Throughput of vllm-lens vs plain vLLM, side by side in one run (SmolLM2-135M, CPU).

    python benchmarks/throughput.py [--prompts 64] [--tokens 64] [--repeats 2] [--rounds 2]
                                    [--modes compiled eager]

For each mode (vLLM's default compiled mode, and eager), two engines run one after the other in
fresh processes: plain vLLM (``VLLM_LENS_DISABLE=1``) and vLLM with the plugin; the pair is
started ``--rounds`` times, alternating, so slow drift of the machine hits both alike. The plugin
engine runs its cases round-robin (plain requests; capture of 1 layer, of all layers, of all
layers at the last prompt token only; steering of 1 layer with one shared vector or with a
distinct vector per request, and of every layer); each number is the best over all rounds of ``--repeats`` runs of
``--prompts`` greedy requests of ``--tokens`` generated tokens. Ratios are to plain vLLM in the
same mode. Results go to stdout as a Markdown table (paste into benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HIDDEN, N_LAYERS = 576, 30


def _vector(seed: int, layers: list[int]):
    import torch

    from vllm_lens import SteeringVector

    g = torch.Generator().manual_seed(seed)
    return SteeringVector(activations=torch.randn(len(layers), HIDDEN, generator=g),
                          layer_indices=layers, scale=0.5)


# name -> (extra_args for request i) ; None: a plain request
CASES = {
    "plugin, plain requests": lambda i: None,
    "capture 1 layer, all positions": lambda i: {"output_residual_stream": [15]},
    "capture all 30 layers": lambda i: {"output_residual_stream": True},
    "capture all layers, last_prompt":
        lambda i: {"output_residual_stream": {"layers": True, "positions": "last_prompt"}},
    "steer 1 layer, same vector": lambda i: {"apply_steering_vectors": [_vector(0, [15])]},
    "steer 1 layer, 64 distinct vectors":
        lambda i: {"apply_steering_vectors": [_vector(i, [15])]},
    "steer all 30 layers":
        lambda i: {"apply_steering_vectors": [_vector(0, list(range(N_LAYERS)))]},
}


def _prompts(n: int) -> list[str]:
    topics = ["the sea", "a city at night", "mathematics", "a forest", "music", "the moon",
              "an old library", "trains"]
    return [f"Write a short paragraph about {topics[i % len(topics)]} (variant {i})."
            for i in range(n)]


def run_engine(cfg: dict) -> dict:
    """In a child process: start one engine, time every case, return tokens/s per case."""
    from vllm import LLM, SamplingParams

    from vllm_lens.demo_models import smollm2_dir

    llm = LLM(str(smollm2_dir()), dtype="float32", max_model_len=1024, seed=0,
              kv_cache_memory_bytes=1 << 30, enforce_eager=cfg["eager"])
    prompts = _prompts(cfg["prompts"])
    cases = {"plain vLLM": lambda i: None} if cfg["disabled"] else CASES
    best: dict[str, float] = {}
    llm.generate(prompts[:8], SamplingParams(max_tokens=8))  # warm-up
    for _ in range(cfg["repeats"]):
        for name, extra_for in cases.items():
            sps = [SamplingParams(max_tokens=cfg["tokens"], temperature=0, ignore_eos=True,
                                  extra_args=extra_for(i)) for i in range(len(prompts))]
            start = time.perf_counter()
            outs = llm.generate(prompts, sps, use_tqdm=False)
            elapsed = time.perf_counter() - start
            n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            best[name] = max(best.get(name, 0.0), n_tokens / elapsed)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["compiled", "eager"],
                        choices=["compiled", "eager"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_engine(json.loads(args.child))), flush=True)
        return

    rows = []
    for mode in args.modes:
        results: dict[str, float] = {}
        for disabled in (True, False) * args.rounds:
            cfg = dict(eager=mode == "eager", disabled=disabled, prompts=args.prompts,
                       tokens=args.tokens, repeats=args.repeats)
            env = {**os.environ, "VLLM_LENS_DISABLE": "1" if disabled else "0"}
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)],
                                  env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(proc.stderr[-3000:])
            line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
            for name, tps in json.loads(line.removeprefix("RESULT ")).items():
                results[name] = max(results.get(name, 0.0), tps)
        base = results["plain vLLM"]
        rows += [(mode, name, tps, tps / base) for name, tps in results.items()]

    print(f"\n{args.prompts} prompts x {args.tokens} generated tokens, greedy, best of "
          f"{args.rounds} rounds x {args.repeats} runs\n")
    print("| mode | case | tokens/s | ratio to plain vLLM |")
    print("|---|---|---:|---:|")
    for mode, name, tps, ratio in rows:
        print(f"| {mode} | {name} | {tps:.1f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
