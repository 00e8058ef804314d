"""The ``vllm-lens`` command line (runs in: the user's process, which runs the engine).

``vllm-lens extract`` builds an activation dataset from a prompt file::

    vllm-lens extract --model M --input prompts.jsonl --output acts/ --layers 3,7|all \\
        [--points resid_post,attn_out] [--positions all|prompt|last_prompt|...] \\
        [--reduce mean|last] [--max-tokens 0] [vLLM engine options: --dtype, -tp, ...]

Input rows have ``prompt`` (text) or ``messages`` (a chat, rendered with the model's chat
template) and an optional ``key`` (default: the row's line number, from 1, as a string):
JSONL, CSV (same columns; ``messages`` as JSON text) or Parquet (needs pandas). Rows are
written in the dataset format of ``vllm_lens.shard_writer`` as batches finish, so memory does
not grow with the input; a re-run skips the keys already written. Bad input rows are listed
and make the command exit with status 1; the good rows are still extracted.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["main"]


@dataclass(frozen=True)
class Example:
    key: str
    prompt: str | None = None
    messages: list[Any] | None = None


def read_examples(path: Path) -> tuple[list[Example], list[str]]:
    """The examples of an input file, and one message per bad row (``"line N: ..."``)."""
    rows: Iterator[tuple[int, Any]]
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with path.open(newline="") as f:
            rows = iter(list(enumerate(csv.DictReader(f), start=2)))  # line 1: the header
    elif suffix == ".parquet":
        try:
            import pandas
        except ImportError:
            raise SystemExit("vllm-lens extract: reading Parquet needs pandas "
                             "(pip install pandas pyarrow)") from None
        rows = ((i, row) for i, row in enumerate(
            pandas.read_parquet(path).to_dict(orient="records"), start=1))
    else:
        rows = _jsonl_rows(path)
    examples, bad, seen = [], [], set()
    for line, row in rows:
        try:
            example = _example(line, row)
        except ValueError as exc:
            bad.append(f"line {line}: {exc}")
            continue
        if example.key in seen:
            bad.append(f"line {line}: key {example.key!r} appears twice")
            continue
        seen.add(example.key)
        examples.append(example)
    return examples, bad


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open() as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                yield line, json.loads(text)
            except ValueError as exc:
                yield line, ValueError(f"not JSON ({exc})")


def _example(line: int, row: Any) -> Example:
    if isinstance(row, ValueError):
        raise row
    if not isinstance(row, dict):
        raise ValueError("expected an object with prompt or messages")
    key = row.get("key")
    key = str(line) if key is None or key == "" else str(key)
    prompt, messages = row.get("prompt"), row.get("messages")
    if isinstance(messages, str) and messages:
        try:
            messages = json.loads(messages)
        except ValueError:
            raise ValueError("messages is not JSON") from None
    if prompt not in (None, "") and messages not in (None, ""):
        raise ValueError("give prompt or messages, not both")
    if isinstance(prompt, str) and prompt:
        return Example(key, prompt=prompt)
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        return Example(key, messages=messages)
    raise ValueError("needs a non-empty prompt (text) or messages (a list of {role, content})")


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

    from vllm_lens.shard_writer import INDEX, ShardWriter, read_index

    examples, bad = read_examples(args.input)
    for message in bad:
        print(f"vllm-lens extract: {args.input}: {message}", file=sys.stderr)
    if args.max_tokens < 0 or args.batch_size < 1:
        raise SystemExit("vllm-lens extract: --max-tokens must be >= 0, --batch-size >= 1")
    points = [p.strip() for p in args.points.split(",") if p.strip()]
    layers: Any = True if args.layers.strip() == "all" else [
        int(x) for x in args.layers.split(",") if x.strip()]
    engine = {k: v for k, v in vars(args).items() if k not in _OWN}
    llm = LLM(**engine)
    capture = {"layers": layers, "positions": args.positions}
    if args.reduce:
        capture["reduce"] = args.reduce
    sp = SamplingParams(
        temperature=0, max_tokens=max(args.max_tokens, 1),
        extra_args={"output_activations": {point: capture for point in points}})
    resume = (args.output / INDEX).exists()
    writer: ShardWriter | None = None
    todo = examples
    if resume:
        done = {entry["key"] for entry in read_index(args.output / INDEX)[0]}
        todo = [e for e in examples if e.key not in done]
        print(f"vllm-lens extract: resuming, {len(examples) - len(todo)} of {len(examples)} "
              "examples already written", file=sys.stderr)
    from tqdm import tqdm

    tokenizer = llm.get_tokenizer()
    n_tokens, started = 0, time.monotonic()
    with tqdm(total=len(todo), unit="ex", desc="extract", file=sys.stderr) as bar:
        for lo in range(0, len(todo), args.batch_size):
            batch = todo[lo:lo + args.batch_size]
            inputs = [_engine_input(e, tokenizer) for e in batch]
            for example, out in zip(batch, llm.generate(inputs, sp, use_tqdm=False)):
                if out.lens_error is not None:
                    bad.append(f"key {example.key!r}: {out.lens_error}")
                    print(f"vllm-lens extract: {bad[-1]}", file=sys.stderr)
                    continue
                acts = out.activations
                rows = {p: acts[p] if args.reduce is None else acts[p][:, None]
                        for p in points}
                if writer is None:
                    writer = ShardWriter(args.output, _manifest(args, llm, points, acts, rows),
                                         rows_per_shard=args.rows_per_shard, resume=resume)
                writer.add(example.key, rows, acts[f"{points[0]}_positions"].tolist(),
                           list(out.prompt_token_ids))
                n_tokens += len(out.prompt_token_ids) + len(out.outputs[0].token_ids)
            written = sum(f.stat().st_size for f in args.output.glob("shard-*.safetensors"))
            bar.set_postfix(tok_s=f"{n_tokens / (time.monotonic() - started):.0f}",
                            written=f"{written / 2**20:.1f}MiB")
            bar.update(len(batch))
    if writer is not None:
        writer.close()
    if bad:
        print(f"vllm-lens extract: {len(bad)} bad input row(s) or failed example(s); the "
              "others were written", file=sys.stderr)
        return 1
    return 0


def _engine_input(example: Example, tokenizer: Any) -> Any:
    if example.prompt is not None:
        return example.prompt
    ids = tokenizer.apply_chat_template(example.messages, add_generation_prompt=True,
                                        tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 answers with the tokenizer's dict
        ids = ids["input_ids"]
    return {"prompt_token_ids": [int(i) for i in ids]}


def _manifest(args: Any, llm: Any, points: list[str], acts: dict[str, Any],
              rows: dict[str, Any]) -> dict[str, Any]:
    import importlib.metadata

    import vllm

    try:
        lens_version = importlib.metadata.version("vllm-lens")
    except importlib.metadata.PackageNotFoundError:
        lens_version = "source"
    n_layers = rows[points[0]].shape[0]
    layers = (list(range(n_layers)) if args.layers.strip() == "all"
              else [int(x) for x in args.layers.split(",") if x.strip()])
    return {
        "model": llm.llm_engine.model_config.model,
        "vllm_version": vllm.__version__,
        "vllm_lens_version": lens_version,
        "points": points,
        "layers": sorted(set(layers)),
        "dtype": str(rows[points[0]].dtype).removeprefix("torch."),
        "row_shapes": {p: list(rows[p].shape[2:]) for p in points},
        "positions": args.positions,
        "reduce": args.reduce,
        "max_tokens": args.max_tokens,
    }


if __name__ == "__main__":
    sys.exit(main())
