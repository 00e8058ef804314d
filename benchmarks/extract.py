"""Building an activation dataset: vllm-lens' sink vs plain vLLM and vs other tools, side by side.

    python benchmarks/extract.py [--prompts 2000] [--rounds 2] [--batch 32] [--vllm-only]

SmolLM2-135M (float32, eager, CPU). Every job reads the same ``--prompts`` short prompts once
(prompt only: one token sampled, as ``vllm-lens extract --max-tokens 0``) and, except the
plain one, writes the residual stream of all 30 layers to a safetensors shard dataset:

- **plain vLLM**: the prompts through an engine without the plugin (``VLLM_LENS_DISABLE=1``),
  nothing written: the throughput to compare with;
- **vllm-lens sink**: the same engine with the plugin; each request names a capture sink and
  its worker writes the rows (``capture_sink``, as ``vllm-lens extract`` does), at
  ``last_prompt`` and at every prompt position;
- **vllm-lens returned**: rows returned to the caller, which writes them (``ShardWriter``), at
  ``last_prompt``: what a hand-written loop does;
- **transformers + hooks**: forward hooks on the 30 decoder layers, batches of ``--batch``
  prompts (padded), the rows written with the same ``ShardWriter``;
- **nnsight**, **TransformerLens**: the same job where the package is installed (benchmark-only
  extras: ``pip install nnsight transformer_lens``), else reported as skipped.

The two vLLM engines run in child processes that stay up; in each round every plugin job runs
beside a plain job of its own (which of the two goes first alternates; the disk's dirty pages
are written out before each job), and its ratio is to that plain job. Every vLLM job sends its
prompts in the same four ``generate`` calls. As wall-clock ratios on a shared 2-core machine
carry noise of several percent, the plugin engine also reports the share of each job's time
spent in vllm-lens' own code (the tap handler, the fetch that assembles and writes the rows,
validation, collation). Prompt tokens per second exclude start-up. The engines run in-process
(vLLM's engine-core busy loop would otherwise compete with the model for the cores), so the
plugin engine's process holds front end and worker: it reports its resident memory after each
quarter of a sink job, whose shards are cut at 64 MiB (the rows never pile up in the front end,
so it should stay flat). Prints a Markdown table for ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import ChildEngine, time_plugin_code  # benchmarks/, this script's directory

N_LAYERS = 30
ENGINE = dict(dtype="float32", max_model_len=512, seed=0, kv_cache_memory_bytes=1 << 30,
              enforce_eager=True)


def _prompts(n: int) -> list[str]:
    subjects = ["The river", "My neighbour", "A small robot", "The old train", "Our teacher",
                "The market", "A quiet library", "The storm", "This recipe", "The museum"]
    verbs = ["surprised everyone when", "was remembered because", "changed slowly after",
             "seemed happier once", "kept going even though"]
    ends = ["the lights went out.", "the winter came early.", "nobody was watching.",
            "the music stopped.", "the bridge reopened.", "the letters arrived."]
    return [f"{subjects[i % 10]} {verbs[(i // 10) % 5]} {ends[(i // 50) % 6]} (#{i})"
            for i in range(n)]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# -- the engines (child processes) ------------------------------------------------------------
def serve_engine(cfg: dict) -> None:
    """In a child process: one engine; runs the jobs named on stdin, answering
    ``RESULT {json}`` with prompt tokens/s (and the front end's memory by quarter)."""
    from vllm import LLM, SamplingParams

    from vllm_lens.demo_models import smollm2_dir

    root = Path(cfg["root"])
    from vllm_lens.worker.extension import LensWorkerExtension

    spent: dict[str, float] = {} if cfg["disabled"] else time_plugin_code(
        ((LensWorkerExtension, "lens_flush_sinks"),))
    if not cfg["disabled"]:
        os.environ["VLLM_LENS_SINKS"] = json.dumps(
            {"bench": {"root": str(root), "flush_s": 0, "max_shard_bytes": 64 << 20}})
    llm = LLM(str(smollm2_dir()), **ENGINE)
    plain = SamplingParams(max_tokens=1, temperature=0)
    prompts = _prompts(cfg["prompts"])
    llm.generate(prompts[:16], SamplingParams(max_tokens=1))  # warm-up
    print("READY", flush=True)
    for line in sys.stdin:
        job, run = line.split()
        spent.clear()
        start = time.perf_counter()
        memory = []
        if job == "plain":
            outs = _in_quarters(llm, prompts, lambda i: plain, memory)
        elif job.startswith("sink"):
            positions = "last_prompt" if job == "sink_last" else "prompt"
            outs = _in_quarters(llm, prompts, lambda i: SamplingParams(
                max_tokens=1, temperature=0, extra_args={
                    "output_residual_stream": {"layers": True, "positions": positions},
                    "capture_sink": {"sink": "bench", "dataset": f"{job}-{run}",
                                     "key": str(i)}}), memory)
            from vllm_lens import flush_sinks

            flush_sinks(llm)
            failed = [o.lens_error for o in outs if o.lens_error is not None]
            if failed:
                sys.exit(f"sink job failed: {failed[0]}")
        elif job == "returned_last":
            sp = SamplingParams(max_tokens=1, temperature=0, extra_args={
                "output_residual_stream": {"layers": True, "positions": "last_prompt"}})
            outs = _in_quarters(llm, prompts, lambda i: sp, memory)
            _write_returned(outs, root / f"{job}-{run}")
        else:
            raise SystemExit(f"unknown job {job}")
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        print("RESULT " + json.dumps({"tps": tokens / elapsed, "memory_mb": memory,
                                      "share": sum(spent.values()) / elapsed}), flush=True)


def _in_quarters(llm: Any, prompts: list[str], params_of: Any, memory: list[float]
                 ) -> list[Any]:
    """Every job's prompts go through the engine in the same four ``generate`` calls (the
    front end's memory is read after each), so that the jobs' ratios compare like with like."""
    outs: list[Any] = []
    quarter = max(1, len(prompts) // 4)
    for lo in range(0, len(prompts), quarter):
        part = range(lo, min(lo + quarter, len(prompts)))
        outs += llm.generate([prompts[i] for i in part], [params_of(i) for i in part],
                             use_tqdm=False)
        memory.append(_rss_mb())
    return outs


def _write_returned(outs: list[Any], path: Path) -> None:
    from vllm_lens.shard_writer import ShardWriter

    first = outs[0].activations["residual_stream"]
    manifest = {"points": ["resid_post"], "layers": list(range(N_LAYERS)),
                "dtype": str(first.dtype).removeprefix("torch."),
                "row_shapes": {"resid_post": list(first.shape[2:])}}
    with ShardWriter(path, manifest) as writer:
        for i, o in enumerate(outs):
            writer.add(str(i), {"resid_post": o.activations["residual_stream"]},
                       o.activations["positions"].tolist(), o.prompt_token_ids)


class _Engine(ChildEngine):
    def __init__(self, cfg: dict, disabled: bool) -> None:
        super().__init__(__file__, cfg, disabled)

    def run(self, job: str, run: int) -> dict[str, Any]:
        return json.loads(self.ask(f"{job} {run}"))


# -- the other tools (this process) -----------------------------------------------------------
def _batches(tokenizer: Any, prompts: list[str], size: int):
    for lo in range(0, len(prompts), size):
        enc = tokenizer(prompts[lo:lo + size], return_tensors="pt", padding=True)
        yield lo, enc["input_ids"], enc["attention_mask"]


def _write_rows(writer: Any, lo: int, per_layer: list[Any], mask: Any, ids: Any,
                last_only: bool) -> None:
    """Write a batch's rows (``per_layer[l]``: ``[batch, seq, hidden]``, right-padded)."""
    import torch

    stacked = torch.stack(per_layer, dim=1)  # [batch, layers, seq, hidden]
    for b in range(stacked.shape[0]):
        n = int(mask[b].sum())
        rows = stacked[b, :, n - 1:n] if last_only else stacked[b, :, :n]
        positions = [n - 1] if last_only else list(range(n))
        writer.add(str(lo + b), {"resid_post": rows}, positions, ids[b, :n].tolist())


def _timed_job(root: Path, tokenizer: Any, prompts: list[str], batch: int, last_only: bool,
               hidden: int, rows_of: Any) -> float:
    """Run ``rows_of(ids, mask)`` (per layer ``[batch, seq, hidden]``) over the prompts, a
    padded batch at a time, writing the rows; returns prompt tokens per second."""
    import torch

    from vllm_lens.shard_writer import ShardWriter

    manifest = {"points": ["resid_post"], "layers": list(range(N_LAYERS)), "dtype": "float32",
                "row_shapes": {"resid_post": [hidden]}}
    tokens = 0
    start = time.perf_counter()
    with torch.inference_mode(), ShardWriter(root, manifest) as writer:
        for lo, ids, mask in _batches(tokenizer, prompts, batch):
            _write_rows(writer, lo, rows_of(ids, mask), mask, ids, last_only)
            tokens += int(mask.sum())
    return tokens / (time.perf_counter() - start)


def _hf(path: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "right"
    return tokenizer, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def transformers_hooks(prompts: list[str], root: Path, batch: int, last_only: bool) -> float:
    from vllm_lens.demo_models import smollm2_dir

    tokenizer, model = _hf(str(smollm2_dir()))
    grabbed: list[Any] = []
    handles = [layer.register_forward_hook(
        lambda _m, _i, out: grabbed.append(out[0] if isinstance(out, tuple) else out))
        for layer in model.model.layers]

    def rows_of(ids: Any, mask: Any) -> list[Any]:
        grabbed.clear()
        model(input_ids=ids, attention_mask=mask)
        return list(grabbed)

    try:
        return _timed_job(root, tokenizer, prompts, batch, last_only,
                          model.config.hidden_size, rows_of)
    finally:
        for h in handles:
            h.remove()


def nnsight_job(prompts: list[str], root: Path, batch: int, last_only: bool) -> float:
    import torch
    from nnsight import LanguageModel

    from vllm_lens.demo_models import smollm2_dir

    model = LanguageModel(str(smollm2_dir()), dtype=torch.float32, dispatch=True)
    model.tokenizer.padding_side = "right"

    def rows_of(ids: Any, mask: Any) -> list[Any]:
        saved: list[Any] = []  # filled inside the trace (nnsight runs its body apart)
        with model.trace({"input_ids": ids, "attention_mask": mask}):
            for layer in model.model.layers:
                saved.append(layer.output.save())  # transformers 5: a tensor
        return [getattr(s, "value", s) for s in saved]

    return _timed_job(root, model.tokenizer, prompts, batch, last_only,
                      model.config.hidden_size, rows_of)


def transformer_lens_job(prompts: list[str], root: Path, batch: int, last_only: bool) -> float:
    import torch
    import transformer_lens  # noqa: F401 - ImportError: reported as not installed

    from vllm_lens.demo_models import smollm2_dir

    path = str(smollm2_dir())
    tokenizer, hf = _hf(path)
    try:  # TransformerLens 4 wraps the transformers model ("bridge")
        from transformer_lens.model_bridge import TransformerBridge

        model = TransformerBridge.boot_transformers(path, dtype=torch.float32, device="cpu",
                                                    tokenizer=tokenizer, hf_model=hf)
    except ImportError:  # TransformerLens 2 and 3
        from transformer_lens import HookedTransformer

        model = HookedTransformer.from_pretrained_no_processing(
            "HuggingFaceTB/SmolLM2-135M-Instruct", hf_model=hf, tokenizer=tokenizer,
            dtype=torch.float32, device="cpu")
    names = [f"blocks.{i}.hook_resid_post" for i in range(N_LAYERS)]

    def rows_of(ids: Any, mask: Any) -> list[Any]:
        _, cache = model.run_with_cache(ids, attention_mask=mask, names_filter=names)
        return [cache[n] for n in names]

    return _timed_job(root, tokenizer, prompts, batch, last_only, hf.config.hidden_size,
                      rows_of)


OTHERS = {"transformers + hooks": transformers_hooks, "nnsight": nnsight_job,
          "TransformerLens": transformer_lens_job}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2000, help="prompts per job")
    parser.add_argument("--rounds", type=int, default=2, help="paired rounds per vLLM job")
    parser.add_argument("--batch", type=int, default=32,
                        help="prompts per forward pass for the transformers-based tools")
    parser.add_argument("--vllm-only", action="store_true",
                        help="run the vLLM jobs only (not transformers, nnsight, TransformerLens)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        serve_engine(json.loads(args.child))
        return

    work = Path(tempfile.mkdtemp(prefix="vllm_lens_extract_bench_"))
    cfg = {"prompts": args.prompts, "root": str(work / "sink")}
    jobs = ["sink_last", "sink_all", "returned_last"]
    plain, lens = _Engine(cfg, disabled=True), _Engine(cfg, disabled=False)
    base: list[float] = []
    found: dict[str, list[dict[str, Any]]] = {job: [] for job in jobs}
    ratios: dict[str, list[float]] = {job: [] for job in jobs}
    try:
        for r in range(args.rounds):
            for j, job in enumerate(jobs):
                # Each plugin job beside its own plain job, which goes first every other
                # time; the disk's dirty pages of earlier jobs are written out before each.
                pair = [("plain", plain), (job, lens)]
                got = {}
                for name, engine in pair if (r + j) % 2 == 0 else pair[::-1]:
                    os.sync()
                    got[name] = engine.run(name, r)
                base.append(got["plain"]["tps"])
                found[job].append(got[job])
                ratios[job].append(got[job]["tps"] / got["plain"]["tps"])
                print(f"round {r}: {job} {got[job]['tps']:.0f} tok/s, "
                      f"{ratios[job][-1]:.3f}x plain", file=sys.stderr, flush=True)
    finally:
        plain.close()
        lens.close()
    prompts = _prompts(args.prompts)
    others: dict[str, dict[str, float | str]] = {}
    for name, fn in {} if args.vllm_only else OTHERS.items():
        for last_only, label in ((True, "last_prompt"), (False, "every prompt position")):
            try:
                tps = fn(prompts, work / f"{name}-{label}".replace(" ", "_"), args.batch,
                         last_only)
                others[f"{name}, {label}"] = {"tps": tps}
            except ImportError as exc:
                others[f"{name}, {label}"] = {"skipped": f"not installed ({exc.name})"}
            except Exception as exc:  # noqa: BLE001 - report, and run the others
                others[f"{name}, {label}"] = {"skipped": f"failed: {type(exc).__name__}: "
                                                         f"{str(exc)[:120]}"}
            print(f"{name}, {label}: {others[f'{name}, {label}']}", file=sys.stderr,
                  flush=True)

    plain_tps = statistics.median(base)
    labels = {"sink_last": "vllm-lens sink, all layers, last_prompt",
              "sink_all": "vllm-lens sink, all layers, every prompt position",
              "returned_last": "vllm-lens returned + ShardWriter, all layers, last_prompt"}
    print(f"\n{args.prompts} prompts, prompt only (1 token sampled), SmolLM2-135M float32 "
          f"eager on the CPU, {args.rounds} rounds; a vLLM job's ratio is to the plain job run "
          "beside it, the other tools' to the median plain job\n")
    print("| job | prompt tokens/s | ratio to plain vLLM (median) | lowest | highest | "
          "time in vllm-lens |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| plain vLLM (nothing written; median of its {len(base)} runs) | {plain_tps:.0f} "
          "| 1 | | | |")
    for job in jobs:
        tps = statistics.median(r["tps"] for r in found[job])
        share = statistics.median(r["share"] for r in found[job])
        print(f"| {labels[job]} | {tps:.0f} | {statistics.median(ratios[job]):.3f} | "
              f"{min(ratios[job]):.3f} | {max(ratios[job]):.3f} | {share:.1%} |")
    for name, r in others.items():
        if "tps" in r:
            print(f"| {name} | {r['tps']:.0f} | {r['tps'] / plain_tps:.3f} | | | |")
        else:
            print(f"| {name} | {r['skipped']} | | | | |")
    memory = found["sink_all"][-1]["memory_mb"]
    print("\nResident memory of the plugin engine's process (front end and worker) after each "
          "quarter of the last 'every prompt position' sink job (MB): "
          + ", ".join(f"{m:.0f}" for m in memory))


if __name__ == "__main__":
    main()
