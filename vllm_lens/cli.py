"""The ``vllm-lens`` command line (runs in: the user's process, which runs the engine).

``vllm-lens extract`` builds an activation dataset from a prompt file::

    vllm-lens extract --model M --input prompts.jsonl --output acts/ --layers 3,7|all \\
        [--points resid_post,attn_out] [--positions all|prompt|last_prompt|...] \\
        [--reduce mean|last] [--max-tokens 0] [vLLM engine options: --dtype, -tp, ...]

Input rows (``vllm_lens.prompt_files``) have ``prompt`` (text) or ``messages`` (a chat,
rendered with the model's chat template) and an optional ``key``. Activations are written in
the format of ``vllm_lens.shard_writer`` a shard at a time, so they do not accumulate in
memory (the prompt file itself is read whole); a re-run skips the keys already written and
refuses a dataset made with other settings. Bad input rows, and examples the engine refuses,
are listed and make the command exit with status 1; the others are still extracted.
``--max-tokens N`` generates N tokens, of which the first N-1 have rows (the last is sampled
but never run through the model); their ids are in the index (``token_ids``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _parser():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm-lens", description="vllm-lens tools")
    commands = parser.add_subparsers(dest="command", required=True)
    extract = commands.add_parser(
        "extract", help="write the activations of a prompt file to an activation dataset")
    extract.add_argument("--input", required=True, type=Path,
                         help="JSONL, CSV or Parquet with prompt or messages, and key")
    extract.add_argument("--output", required=True, type=Path, help="the dataset directory")
    extract.add_argument("--layers", required=True, help="comma-separated layers, or all")
    extract.add_argument("--points", default="resid_post",
                         help="comma-separated tap points (default: resid_post)")
    extract.add_argument("--positions", default="all",
                         help="a positions selector: all, prompt, last_prompt, prompt[-4:] ...")
    extract.add_argument("--reduce", choices=("mean", "last"), default=None)
    extract.add_argument("--max-tokens", type=int, default=0,
                         help="tokens to generate per prompt (0: prompt only)")
    extract.add_argument("--batch-size", type=int, default=256,
                         help="prompts handed to the engine at once (bounds memory)")
    extract.add_argument("--rows-per-shard", type=int, default=65536)
    EngineArgs.add_cli_args(extract)
    return parser


_OWN = ("command", "input", "output", "layers", "points", "positions", "reduce", "max_tokens",
        "batch_size", "rows_per_shard")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if not any(a == "--model" or a.startswith("--model=") for a in argv):
        raise SystemExit("vllm-lens extract: give --model (a model name or path)")
    return extract(args)


def extract(args: Any) -> int:
    from vllm import LLM, SamplingParams

    from vllm_lens.points import resolve
    from vllm_lens.prompt_files import read_examples
    from vllm_lens.shard_writer import INDEX, MANIFEST, read_index

    if args.max_tokens < 0 or args.batch_size < 1:
        raise SystemExit("vllm-lens extract: --max-tokens must be >= 0, --batch-size >= 1")
    points = []
    for name in (p.strip() for p in args.points.split(",") if p.strip()):
        try:
            point, layer = resolve(name)
        except KeyError as exc:
            raise SystemExit(f"vllm-lens extract: --points: {exc.args[0]}") from None
        if layer is not None:
            raise SystemExit(f"vllm-lens extract: --points: {name} names a layer; give "
                             "layers with --layers")
        points.append(point)
    if not points:
        raise SystemExit("vllm-lens extract: --points names no point")
    if args.max_tokens == 0 and args.positions.strip().startswith("generated"):
        raise SystemExit("vllm-lens extract: --positions selects generated rows, but "
                         "--max-tokens 0 generates none")
    examples, bad = read_examples(args.input)
    for message in bad:
        print(f"vllm-lens extract: {args.input}: {message}", file=sys.stderr)
    resume = (args.output / INDEX).exists()
    if (args.output / MANIFEST).exists():
        _check_same_job(json.loads((args.output / MANIFEST).read_text()), args, points)
    todo = examples
    if resume:
        done = {entry["key"] for entry in read_index(args.output / INDEX)[0]}
        todo = [e for e in examples if e.key not in done]
        print(f"vllm-lens extract: resuming, {len(examples) - len(todo)} of {len(examples)} "
              "examples already written", file=sys.stderr)
    layers: Any = True if args.layers.strip() == "all" else [
        int(x) for x in args.layers.split(",") if x.strip()]
    capture = {"layers": layers, "positions": args.positions}
    if args.reduce:
        capture["reduce"] = args.reduce
    sp = SamplingParams(
        temperature=0, max_tokens=max(args.max_tokens, 1),
        extra_args={"output_activations": {point: capture for point in points}})
    llm = LLM(**{k: v for k, v in vars(args).items() if k not in _OWN})
    job = _Job(args, llm, points, sp, resume)
    try:
        job.run(todo, bad)
    finally:
        job.close()
    if bad:
        print(f"vllm-lens extract: {len(bad)} bad input row(s) or failed example(s); the "
              "others were written", file=sys.stderr)
        return 1
    return 0


def _check_same_job(manifest: dict[str, Any], args: Any, points: list[str]) -> None:
    """Refuse, before the engine starts, to add to a dataset made with other settings."""
    mine = {"points": points, "positions": args.positions, "reduce": args.reduce,
            "max_tokens": args.max_tokens, "model": args.model}
    if args.layers.strip() != "all":
        mine["layers"] = sorted({int(x) for x in args.layers.split(",") if x.strip()})
    for field, value in mine.items():
        if manifest.get(field) != value:
            raise SystemExit(f"vllm-lens extract: {args.output} holds a dataset made with "
                             f"{field}={manifest.get(field)!r}, not {value!r}; write to another "
                             "--output")


class _Job:
    """One extraction: batches of prompts through the engine, rows into the writer."""

    def __init__(self, args: Any, llm: Any, points: list[str], sp: Any, resume: bool) -> None:
        self.args, self.llm, self.points, self.sp, self.resume = args, llm, points, sp, resume
        self.writer: Any = None
        self.tokenizer = llm.get_tokenizer()

    def run(self, todo: list[Any], bad: list[str]) -> None:
        from tqdm import tqdm

        n_tokens, started = 0, time.monotonic()
        with tqdm(total=len(todo), unit="ex", desc="extract", file=sys.stderr) as bar:
            for lo in range(0, len(todo), self.args.batch_size):
                batch = todo[lo:lo + self.args.batch_size]
                for example, out in self._generate(batch, bad):
                    if out.lens_error is not None:
                        self._fail(bad, example, out.lens_error)
                        continue
                    self._write(example, out)
                    n_tokens += len(out.prompt_token_ids) + len(out.outputs[0].token_ids)
                written = sum(f.stat().st_size
                              for f in self.args.output.glob("shard-*.safetensors"))
                bar.set_postfix(tok_s=f"{n_tokens / (time.monotonic() - started):.0f}",
                                written=f"{written / 2**20:.1f}MiB")
                bar.update(len(batch))

    def _generate(self, batch: list[Any], bad: list[str]) -> list[tuple[Any, Any]]:
        """(example, output) for the batch; an example the engine refuses (too long, a chat
        template error ...) is listed in ``bad`` and the rest still run."""
        inputs = []
        for example in batch:
            try:
                inputs.append((example, _engine_input(example, self.tokenizer)))
            except Exception as exc:  # noqa: BLE001 - the row is bad, not the job
                self._fail(bad, example, exc)
        try:
            outs = self.llm.generate([i for _, i in inputs], self.sp, use_tqdm=False)
            return [(e, out) for (e, _), out in zip(inputs, outs)]
        except ValueError:  # some input the engine rejects: find it, run the others
            done = []
            for example, engine_input in inputs:
                try:
                    (out,) = self.llm.generate([engine_input], self.sp, use_tqdm=False)
                    done.append((example, out))
                except ValueError as exc:
                    self._fail(bad, example, exc)
            return done

    @staticmethod
    def _fail(bad: list[str], example: Any, exc: Any) -> None:
        bad.append(f"key {example.key!r}: {exc}")
        print(f"vllm-lens extract: {bad[-1]}", file=sys.stderr)

    def _write(self, example: Any, out: Any) -> None:
        from vllm_lens.shard_writer import ShardWriter

        acts = out.activations
        reduced = self.args.reduce is not None
        rows = {p: acts[p][:, None] if reduced else acts[p] for p in self.points}
        if self.writer is None:
            self.writer = ShardWriter(self.args.output, self._manifest(rows),
                                      rows_per_shard=self.args.rows_per_shard,
                                      resume=self.resume)
        self.writer.add(example.key, rows, acts[f"{self.points[0]}_positions"].tolist(),
                        list(out.prompt_token_ids),
                        list(out.outputs[0].token_ids) if self.args.max_tokens else [],
                        reduced=reduced)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def _manifest(self, rows: dict[str, Any]) -> dict[str, Any]:
        import importlib.metadata

        import vllm

        try:
            lens_version = importlib.metadata.version("vllm-lens")
        except importlib.metadata.PackageNotFoundError:
            lens_version = "source"
        args, first = self.args, rows[self.points[0]]
        layers = (list(range(first.shape[0])) if args.layers.strip() == "all"
                  else sorted({int(x) for x in args.layers.split(",") if x.strip()}))
        return {
            "model": args.model,
            "vllm_version": vllm.__version__,
            "vllm_lens_version": lens_version,
            "points": self.points,
            "layers": layers,
            "dtype": str(first.dtype).removeprefix("torch."),
            "row_shapes": {p: list(rows[p].shape[2:]) for p in self.points},
            "positions": args.positions,
            "reduce": args.reduce,
            "max_tokens": args.max_tokens,
        }


def _engine_input(example: Any, tokenizer: Any) -> Any:
    if example.prompt is not None:
        return example.prompt
    ids = tokenizer.apply_chat_template(example.messages, add_generation_prompt=True,
                                        tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 answers with the tokenizer's dict
        ids = ids["input_ids"]
    return {"prompt_token_ids": [int(i) for i in ids]}


if __name__ == "__main__":
    sys.exit(main())
