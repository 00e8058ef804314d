"""Building an activation dataset: vllm-lens' sink vs plain vLLM and vs other tools, side by side.

    python benchmarks/extract.py [--prompts 2000] [--rounds 2] [--turns 4] [--batch 32]
                                 [--vllm-only] [--jobs sink_last,sink_all,returned_last]
                                 [--baseline DIR]

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
beside a plain job of its own, and its ratio is to that plain job; each plugin engine also runs
the plain job's requests (without lens keys) in the same turns, and the job's ratio to those is
reported too: one engine process can run 10-15% faster than another of the same configuration
for its whole life on this machine, which that ratio, within one process, does not see. Every
vLLM job sends its prompts in the same ``--turns`` ``generate`` calls (four by default), and the
jobs of a round take turns call by call (which goes first rotates; the disk's dirty pages are
written out before each turn), so that load from other processes falls on all alike; a sink
job's turn ends once its rows are on disk (``flush_sinks``: a writer thread does not go on
writing while the plain job runs). Each turn thus ends with the wait for the sink's last shards,
which an extraction job (``vllm-lens extract`` flushes once, at its end) pays once: ``--turns 1``
runs each job whole, one ``generate`` call and one flush, as such a job does. As wall-clock
ratios on a shared 2-core machine carry noise of several percent, the plugin engine also reports
the share of each job's time spent in vllm-lens' own code (the tap handler, the fetch that
assembles and writes the rows, validation, collation), of which waiting for the sink's writer
thread (room in its queue, the flushes), and how long that thread spent writing shards (wall and
CPU time). Prompt tokens per second exclude start-up. The engines run in-process (vLLM's
engine-core busy loop would otherwise compete with the model for the cores), so the plugin
engine's process holds front end and worker: it reports its resident memory after each turn of a
sink job, whose shards are cut at 64 MiB (the rows never pile up in the front end, so it should
stay flat). The disk's own sequential write speed is measured in the same run, before the first
job and after the last (files of a shard's size, 64 MiB, each written and ``fsync``ed in the
output's directory), and each job's bytes written are divided by it: the time the disk alone
needs, a floor under the job's time whatever the plugin does. ``--baseline DIR`` runs every
plugin job a third time, in the same turns beside the same plain job, on an engine importing the
``vllm_lens`` in ``DIR`` (the previous commit, unpacked by ``git archive``): a change and what
it replaces, measured under the same load. Prints a Markdown table for
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import ChildEngine, time_plugin_code  # benchmarks/, this script's directory

N_LAYERS = 30
JOBS = ("sink_last", "sink_all", "returned_last")
SHARD_BYTES = 64 << 20
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
    """In a child process: one engine; runs the turns of the jobs named on stdin
    (``JOB RUN TURN``), answering ``RESULT {json}``: after the last turn, the job's prompt
    tokens/s (and the front end's memory by turn)."""
    from vllm import LLM, SamplingParams

    import vllm_lens
    from vllm_lens import flush_sinks
    from vllm_lens.demo_models import smollm2_dir
    from vllm_lens.dataset.writer import ShardWriter
    from vllm_lens.sinks.shards import ShardSink
    from vllm_lens.worker.extension import LensWorkerExtension

    root = Path(cfg["root"])
    print(f"engine ({'plain' if cfg['disabled'] else 'plugin'}) imports {vllm_lens.__file__}",
          file=sys.stderr, flush=True)
    # A sink that writes in the background waits for the disk in ``_hand_off`` (called inside
    # the fetch: counted apart) and in the flushes; its writer thread's time is its own.
    waits = (ShardSink, "_hand_off") if hasattr(ShardSink, "_hand_off") else None
    spent: dict[str, float] = {} if cfg["disabled"] else time_plugin_code(
        ((LensWorkerExtension, "lens_flush_sinks"), *([waits] if waits else [])))
    writer = _time_writer_thread(ShardWriter) if hasattr(ShardWriter, "write_shard") else {}
    if not cfg["disabled"]:
        os.environ["VLLM_LENS_SINKS"] = json.dumps(
            {"bench": {"root": str(root), "flush_s": 0, "max_shard_bytes": SHARD_BYTES}})
    llm = LLM(str(smollm2_dir()), **ENGINE)
    plain = SamplingParams(max_tokens=1, temperature=0)
    prompts = _prompts(cfg["prompts"])
    turns = cfg["turns"]
    llm.generate(prompts[:16], SamplingParams(max_tokens=1))  # warm-up
    print("READY", flush=True)
    # Per job (a plugin engine runs its sink job and keyless plain requests in turns): its
    # outputs, memory by turn, time, and its share of the timers' totals.
    jobs: dict[str, dict[str, Any]] = {}
    for line in sys.stdin:
        job, run, q = line.split()
        if q == "0":
            jobs[job] = {"outs": [], "memory": [], "elapsed": 0.0, "spent": {}, "writer": {}}
        state = jobs[job]
        outs, memory = state["outs"], state["memory"]
        timers_before = {"spent": dict(spent), "writer": dict(writer)}
        part = range(int(q) * len(prompts) // turns, (int(q) + 1) * len(prompts) // turns)
        last = int(q) == turns - 1
        start = time.perf_counter()
        if job == "plain":
            params = [plain for _ in part]
        elif job.startswith("sink"):
            positions = "last_prompt" if job == "sink_last" else "prompt"
            params = [SamplingParams(max_tokens=1, temperature=0, extra_args={
                "output_residual_stream": {"layers": True, "positions": positions},
                "capture_sink": {"sink": "bench", "dataset": f"{job}-{run}", "key": str(i)}})
                for i in part]
        elif job == "returned_last":
            params = [SamplingParams(max_tokens=1, temperature=0, extra_args={
                "output_residual_stream": {"layers": True, "positions": "last_prompt"}})
                for _ in part]
        else:
            raise SystemExit(f"unknown job {job}")
        outs += llm.generate([prompts[i] for i in part], params, use_tqdm=False)
        if job.startswith("sink"):
            # Each turn's rows are on disk before its time stops (a writer thread must not go
            # on writing while the plain engine runs its next turn).
            flush_sinks(llm)
            failed = [o.lens_error for o in outs if o.lens_error is not None]
            if failed:
                sys.exit(f"sink job failed: {failed[0]}")
        if job == "returned_last" and last:
            _write_returned(outs, root / f"{job}-{run}")
        state["elapsed"] += time.perf_counter() - start
        memory.append(_rss_mb())
        for name, totals in (("spent", spent), ("writer", writer)):
            mine = state[name]
            for key, total in totals.items():
                mine[key] = mine.get(key, 0.0) + total - timers_before[name].get(key, 0.0)
        if not last:
            print("RESULT {}", flush=True)
            continue
        del jobs[job]  # (its outputs: not held while the next jobs run)
        elapsed, mine = state["elapsed"], dict(state["spent"])
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        written = sum(f.stat().st_size for f in (root / f"{job}-{run}").glob("*")) \
            if job != "plain" else 0
        waited = mine.pop("_hand_off", 0.0) + mine.get("lens_flush_sinks", 0.0)
        print("RESULT " + json.dumps({
            "tps": tokens / elapsed, "memory_mb": memory, "seconds": elapsed, "bytes": written,
            "share": sum(mine.values()) / elapsed, "waited": waited / elapsed,
            "writer_busy": state["writer"].get("wall", 0.0) / elapsed,
            "writer_cpu": state["writer"].get("cpu", 0.0) / elapsed}), flush=True)


def _time_writer_thread(cls: type) -> dict[str, float]:
    """Time ``cls.write_shard`` (a sink's writer thread writing a shard): wall and CPU time
    of that thread, as running totals the caller may reset."""
    totals: dict[str, float] = {}
    original = cls.write_shard

    def write_shard(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            totals["wall"] = totals.get("wall", 0.0) + time.perf_counter() - wall
            totals["cpu"] = totals.get("cpu", 0.0) + time.thread_time() - cpu

    cls.write_shard = write_shard
    return totals


def _write_returned(outs: list[Any], path: Path) -> None:
    from vllm_lens.dataset.writer import ShardWriter

    first = outs[0].activations["residual_stream"]
    manifest = {"points": ["resid_post"], "layers": list(range(N_LAYERS)),
                "dtype": str(first.dtype).removeprefix("torch."),
                "row_shapes": {"resid_post": list(first.shape[2:])}}
    with ShardWriter(path, manifest) as writer:
        for i, o in enumerate(outs):
            writer.add(str(i), {"resid_post": o.activations["residual_stream"]},
                       o.activations["positions"].tolist(), o.prompt_token_ids)


def disk_write_speed(directory: Path, files: int = 8) -> float:
    """The disk's sequential write speed in MB/s: ``files`` files of a shard's size, each
    written and ``fsync``ed in ``directory`` (as the sink writes a shard), then removed."""
    data = os.urandom(SHARD_BYTES)  # (incompressible)
    os.sync()
    spent = 0.0
    for i in range(files):
        path = directory / f".disk-speed-{i}"
        start = time.perf_counter()
        with open(path, "wb") as f:
            f.write(data)
            os.fsync(f.fileno())
        spent += time.perf_counter() - start
        path.unlink()
    return files * SHARD_BYTES / spent / 1e6


class _Engine(ChildEngine):
    def __init__(self, cfg: dict, disabled: bool, package: str | None = None) -> None:
        """``package``: a directory holding another ``vllm_lens`` to import instead."""
        super().__init__(__file__, cfg, disabled,
                         env={"PYTHONPATH": package} if package else None)

    def run(self, job: str, run: int, turn: int) -> dict[str, Any]:
        """Run one turn of a job; after the last, returns the job's result."""
        return json.loads(self.ask(f"{job} {run} {turn}"))


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

    from vllm_lens.dataset.writer import ShardWriter

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
    parser.add_argument("--turns", type=int, default=4,
                        help="generate calls per vLLM job, taken in turns with the other "
                             "jobs; a sink job flushes at the end of each (1: each job whole)")
    parser.add_argument("--batch", type=int, default=32,
                        help="prompts per forward pass for the transformers-based tools")
    parser.add_argument("--vllm-only", action="store_true",
                        help="run the vLLM jobs only (not transformers, nnsight, TransformerLens)")
    parser.add_argument("--jobs", default=",".join(JOBS),
                        help=f"the plugin jobs to run, of {', '.join(JOBS)} (default: all)")
    parser.add_argument("--baseline", metavar="DIR",
                        help="also run each plugin job on a third engine importing the "
                             "vllm_lens package in DIR (e.g. `git archive HEAD` unpacked "
                             "there), beside the same plain job")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        serve_engine(json.loads(args.child))
        return

    jobs = args.jobs.split(",")
    unknown = sorted(set(jobs) - set(JOBS))
    if unknown:
        parser.error(f"--jobs: {unknown[0]!r} is not one of {', '.join(JOBS)}")
    if not 1 <= args.turns <= args.prompts:
        parser.error(f"--turns: {args.turns} is not between 1 and --prompts ({args.prompts})")
    work = Path(tempfile.mkdtemp(prefix="vllm_lens_extract_bench_"))
    try:
        _measure(args, jobs, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # (gigabytes of shards)


def _measure(args: argparse.Namespace, jobs: list[str], work: Path) -> None:
    cfg = {"prompts": args.prompts, "turns": args.turns, "root": str(work / "sink")}
    disk = [disk_write_speed(work)]
    print(f"disk: {disk[0]:.0f} MB/s", file=sys.stderr, flush=True)
    engines = {"plain": _Engine(cfg, disabled=True), "": _Engine(cfg, disabled=False)}
    if args.baseline:
        engines["baseline"] = _Engine({**cfg, "root": str(work / "sink-baseline")},
                                      disabled=False, package=args.baseline)
    variants = [v for v in engines if v != "plain"]
    base: list[float] = []
    plain_seconds: list[float] = []
    found: dict[tuple[str, str], list[dict[str, Any]]] = {
        (job, v): [] for job in jobs for v in variants}
    ratios: dict[tuple[str, str], list[float]] = {key: [] for key in found}
    here: dict[tuple[str, str], list[float]] = {key: [] for key in found}
    try:
        for r in range(args.rounds):
            for j, job in enumerate(jobs):
                # Each plugin job beside its own plain job, turn by turn (so that they meet the
                # same load from other processes), taking turns at going first; the disk's
                # dirty pages are written out before each turn.
                # Each plugin engine also runs the plain job (requests without lens keys) in
                # the same turns: a ratio within one process, free of the differences between
                # processes (on this machine one engine process can run 10-15% faster than
                # another, the same configuration, for its whole life).
                group = [("plain", "plain"), *((v, run) for v in variants
                                               for run in (job, "plain"))]
                got = {}
                for q in range(args.turns):
                    turn = (r + j + q) % len(group)
                    for variant, run in group[turn:] + group[:turn]:
                        os.sync()
                        got[variant, run] = engines[variant].run(run, r, q)
                plain = got["plain", "plain"]
                base.append(plain["tps"])
                plain_seconds.append(plain["seconds"])
                for v in variants:
                    found[job, v].append(got[v, job])
                    ratios[job, v].append(got[v, job]["tps"] / plain["tps"])
                    here[job, v].append(got[v, job]["tps"] / got[v, "plain"]["tps"])
                    print(f"round {r}: {job}{f' ({v})' if v else ''} {got[v, job]['tps']:.0f} "
                          f"tok/s, {ratios[job, v][-1]:.3f}x plain, {here[job, v][-1]:.3f}x "
                          "plain requests on its engine", file=sys.stderr, flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    disk.append(disk_write_speed(work))
    print(f"disk: {disk[1]:.0f} MB/s", file=sys.stderr, flush=True)
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
          f"eager on the CPU, {args.rounds} rounds of {args.turns} turns; a vLLM job's ratio is "
          "to the plain job run beside it, the other tools' to the median plain job\n")
    speed = min(disk)
    plain_s = statistics.median(plain_seconds)
    print(f"The disk's own sequential write speed ({SHARD_BYTES >> 20} MiB files written and "
          f"fsynced in the output's directory): {disk[0]:.0f} MB/s before the jobs, "
          f"{disk[1]:.0f} MB/s after. 'disk alone' is a job's bytes at the slower of the two, "
          f"against the median plain job's {plain_s:.1f} s.\n")
    print("| job | prompt tokens/s | ratio to plain vLLM (median) | lowest | highest | "
          "ratio to plain requests on its engine (median, lowest–highest) | "
          "time in vllm-lens | of which waiting for the writer thread | writer thread busy "
          "(CPU) | MB written | disk alone |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| plain vLLM (nothing written; median of its {len(base)} runs) | {plain_tps:.0f} "
          "| 1 | | | | | | | | |")
    for key, results in found.items():
        def median(field: str, results: list[dict[str, Any]] = results) -> float:
            return statistics.median(r.get(field, 0.0) for r in results)

        label = labels[key[0]] + (f" ({key[1]}: {args.baseline})" if key[1] else "")
        written = median("bytes") / 1e6
        print(f"| {label} | {median('tps'):.0f} | {statistics.median(ratios[key]):.3f} | "
              f"{min(ratios[key]):.3f} | {max(ratios[key]):.3f} | "
              f"{statistics.median(here[key]):.3f} ({min(here[key]):.3f}–{max(here[key]):.3f})"
              f" | {median('share'):.1%} | "
              f"{median('waited'):.1%} | {median('writer_busy'):.1%} "
              f"({median('writer_cpu'):.1%}) | {written:.0f} | {written / speed:.1f} s "
              f"({written / speed / plain_s:.0%}) |")
    for name, r in others.items():
        if "tps" in r:
            print(f"| {name} | {r['tps']:.0f} | {r['tps'] / plain_tps:.3f} | | | | | | | | |")
        else:
            print(f"| {name} | {r['skipped']} | | | | | | | | | |")
    memory = found["sink_all", ""][-1]["memory_mb"] if "sink_all" in jobs else []
    print("\nResident memory of the plugin engine's process (front end and worker) after each "
          "turn of the last 'every prompt position' sink job (MB): "
          + ", ".join(f"{m:.0f}" for m in memory))


if __name__ == "__main__":
    main()
