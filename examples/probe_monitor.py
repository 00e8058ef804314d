"""Fit a sentiment probe on an activation dataset, then score every token of a generation live.

    python examples/probe_monitor.py [--layer 15] [--max-tokens 48] [--workdir probe_monitor]

1. ``vllm-lens extract`` writes SmolLM2's residual stream at one layer, averaged over each
   prompt (its first token, the attention sink, left out), for 48 short reviews
   (``examples/data/sentiment.jsonl``: 24 positive, 24 negative) to an activation dataset.
2. A mass-mean probe (the difference of the two classes' means) is fitted on half of them,
   read back with ``vllm_lens.datasets``, and scored on the other half.
3. An ``AsyncLLM`` generates with ``stream_activations``: each output brings the row of the
   token just fed through the model, and the monitor prints that token coloured by its probe
   score as it arrives (green positive, red negative), then the scores as numbers.
4. The same generation runs with the probe inside the engine (the ``linear_probe`` named hook,
   which any client may call over HTTP): its scores equal the streamed ones.
5. A guardrail: the same generation with the probe as a ``stop`` monitor on negativity (the
   negated probe, threshold ``--guard``, on the generated tokens: the prompt itself asks about
   a hated meal): the engine ends it right after the first token whose row reads that
   negative, and says which monitor stopped it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import subprocess
import sys
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent / "data" / "sentiment.jsonl"
ENGINE = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-bytes",
          str(512 << 20), "--enforce-eager"]
PROMPT = ("Write two short sentences: the first about a meal you loved, the second about a "
          "meal you hated.")


def extract(model: str, layer: int, output: Path) -> None:
    """Step 1, as a user runs it (a re-run finds every key written and skips the engine)."""
    command = [sys.executable, "-m", "vllm_lens.cli", "extract", "--model", model,
               "--input", str(DATA), "--output", str(output), "--layers", str(layer),
               "--points", "resid_post", "--positions", "prompt[1:]", "--reduce", "mean",
               *ENGINE]
    print("$", " ".join(command[2:]))
    subprocess.run(command, check=True)


def fit_probe(dataset_dir: Path, layer: int) -> tuple[torch.Tensor, float, float]:
    """Step 2: (weight, bias, held-out accuracy) of a mass-mean probe, scaled so that the two
    classes' training means score -1 and +1."""
    from vllm_lens import datasets

    ds = datasets.open(dataset_dir)
    rows = ds.tensor("resid_post", layer).float()  # [n_examples, hidden]: one reduced row each
    keys = [entry["key"] for entry in ds.entries]
    labels = torch.tensor([1.0 if k.startswith("pos") else -1.0 for k in keys])
    train = torch.tensor([int(k.split("-")[1]) % 2 == 0 for k in keys])
    pos, neg = rows[train & (labels > 0)].mean(0), rows[train & (labels < 0)].mean(0)
    weight = pos - neg
    middle = (pos + neg) / 2
    half_gap = float((pos - middle) @ weight)
    weight = weight / half_gap
    bias = -float(middle @ weight)
    scores = rows @ weight + bias
    held_out = ~train
    accuracy = float(((scores[held_out] > 0) == (labels[held_out] > 0)).float().mean())
    return weight, bias, accuracy


def colour(token: str, score: float) -> str:
    """``token`` on a red (negative) to green (positive) background (ANSI 256 colours)."""
    level = max(-1.0, min(1.0, score))
    code = 34 if level > 0.25 else 22 if level > 0 else 52 if level > -0.25 else 124
    return f"\x1b[48;5;{code}m\x1b[97m{token}\x1b[0m"


async def monitor(engine, tokenizer, weight: torch.Tensor, bias: float, layer: int,
                  max_tokens: int) -> tuple[list[int], list[float]]:
    """Step 3: stream a generation with the rows of its generated tokens; score each row as
    it arrives. Returns (positions, scores)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                        add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, output_kind=RequestOutputKind.DELTA,
                        extra_args={"output_residual_stream": {"layers": [layer],
                                                               "positions": "generated"},
                                    "stream_activations": True})
    generated: list[int] = []
    positions: list[int] = []
    scores: list[float] = []
    print(f"\nmonitor (layer {layer}), each token as its row arrives:\n")
    async for out in engine.generate({"prompt_token_ids": ids}, sp, "monitor"):
        generated += out.outputs[0].token_ids
        acts = out.activations
        for row, position in zip(acts["residual_stream"][0], acts["positions"].tolist()):
            score = float(row.float() @ weight + bias)
            token = tokenizer.decode([generated[position - len(ids)]])
            print(colour(token, score), end="", flush=True)
            positions.append(position)
            scores.append(score)
    print("\n")
    tokens = [tokenizer.decode([generated[p - len(ids)]]) for p in positions]
    print("scores: " + " ".join(f"{t.strip() or repr(t)}:{s:+.2f}" for t, s in zip(tokens, scores)))
    return positions, scores


async def in_engine(engine, tokenizer, weight: torch.Tensor, bias: float, layer: int,
                    max_tokens: int) -> dict[int, float]:
    """Step 4: the same generation scored by the ``linear_probe`` named hook in the engine."""
    from vllm import SamplingParams

    from vllm_lens import NamedHook

    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                        add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    probe = NamedHook("linear_probe", [layer], {"weight": weight.tolist(), "bias": bias})
    sp = SamplingParams(max_tokens=max_tokens, temperature=0,
                        extra_args={"apply_hooks": [probe]})
    last = None
    async for out in engine.generate({"prompt_token_ids": ids}, sp, "in-engine"):
        last = out
    saved = last.hook_results["0"]
    scores = saved["scores"][str(layer)].tolist()
    positions = saved["positions"][str(layer)].tolist()
    return dict(zip(positions, scores))


async def guard(engine, tokenizer, weight: torch.Tensor, bias: float, layer: int,
                max_tokens: int, threshold: float) -> dict:
    """Step 5: the generation with a ``stop`` monitor that fires where the probe reads more
    negative than ``-threshold``."""
    from vllm import SamplingParams

    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                        add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    monitor = {"name": "negativity", "probe": (-weight).tolist(), "bias": -bias,
               "layer": layer, "threshold": threshold, "action": "stop",
               "positions": "generated"}  # a guard on what the model writes, not the prompt
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, extra_args={"monitors": [monitor]})
    last = None
    async for out in engine.generate({"prompt_token_ids": ids}, sp, "guarded"):
        last = out
    record, completion = last.monitors[0], last.outputs[0]
    print(f"\nguarded (stop when the probe reads below {-threshold:+.1f}): "
          f"{completion.text!r}\n  finish_reason={completion.finish_reason!r}, "
          f"stop_reason={completion.stop_reason!r}, fired at position {record['position']} "
          f"(score {record['score']})")
    return {"position": record["position"], "n_prompt": len(ids),
            "stop_reason": completion.stop_reason, "tokens": len(completion.token_ids)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", type=int, default=15, help="the layer the probe reads")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens to generate")
    parser.add_argument("--guard", type=float, default=1.0,
                        help="the guardrail stops where the probe reads below minus this")
    parser.add_argument("--workdir", type=Path, default=Path("probe_monitor"),
                        help="where the activation dataset is written")
    args = parser.parse_args()

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm_lens.demo_models import smollm2_dir

    model = str(smollm2_dir())
    dataset_dir = args.workdir.resolve() / "sentiment-acts"
    extract(model, args.layer, dataset_dir)
    weight, bias, accuracy = fit_probe(dataset_dir, args.layer)
    print(f"probe fitted on 24 reviews; held-out accuracy on the other 24: {accuracy:.2f}")

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=512 << 20,
        enforce_eager=True))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)

    async def both(engine):
        streamed = await monitor(engine, tokenizer, weight, bias, args.layer, args.max_tokens)
        hooked = await in_engine(engine, tokenizer, weight, bias, args.layer, args.max_tokens)
        guarded = await guard(engine, tokenizer, weight, bias, args.layer, args.max_tokens,
                              args.guard)
        return streamed, hooked, guarded

    try:
        (positions, scores), hooked, guarded = asyncio.run(both(engine))
    finally:
        engine.shutdown()
        del engine
        gc.collect()  # while the interpreter is whole (AsyncLLM.__del__ shuts down again)
    diff = max(abs(hooked[p] - s) for p, s in zip(positions, scores))
    print(f"\nin-engine linear_probe scored the same {len(scores)} tokens: max |difference| "
          f"from the streamed scores {diff:.2e}")
    # Where the streamed scores (generated positions) first read below -guard.
    crossing = next((p for p, s in zip(positions, scores) if -s > args.guard), None)
    print(json.dumps({"held_out_accuracy": accuracy, "tokens_scored": len(scores),
                      "max_difference": diff, "guard": guarded,
                      "streamed_first_crossing": crossing}))


if __name__ == "__main__":
    main()
