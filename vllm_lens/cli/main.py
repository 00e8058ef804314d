"""The ``vllm-lens`` command line (runs in: caller).

With a local engine that process is also the engine's front end.

``vllm-lens serve MODEL [flags]`` is ``vllm serve`` with the same flags, on every vLLM
distribution (``vllm_lens.cli.serve``).

``vllm-lens extract`` builds an activation dataset from a prompt file::

    vllm-lens extract --model M --input prompts.jsonl|DIR [--split NAME] --output acts/ \\
        [--layers 3,7|all] [--points resid_post,attn_out] [--sae DIR_OR_NAME --top-k 32] \\
        [--positions all|prompt|last_prompt|...] [--reduce mean|last] [--max-tokens 0] \\
        [--format vllm-lens|sae-lens [--context-size 128]] \\
        [--server URL | --ray [--num-engines N] [--ray-address ADDR]] \\
        [vLLM engine options: --dtype, -tp, --data-parallel-size ...]

Input rows (``vllm_lens.cli.extract.prompts``: a JSONL, CSV or Parquet file, or a local Hugging Face
dataset directory with ``--split``) have ``prompt`` (text) or ``messages`` (a chat, rendered
with the model's chat template) and an optional ``key``. The engine's workers write
the rows themselves through a capture sink of the job's own (``vllm_lens.sinks``; the front
end sees only receipts), in the format of ``vllm_lens.dataset.writer`` a shard at a time, so
nothing grows with the dataset (the prompt file itself is read whole). A re-run skips the
keys already written and refuses a dataset made with other settings (``extract.json`` keeps
those the manifest does not). Bad input rows, and examples the engine refuses, are listed
and make the command exit with status 1; the others are still extracted.

``--sae`` (repeatable) also writes each SAE's top ``--top-k`` features per row (sparse
columns beside the rows; with ``--sae`` alone, the features only). ``--format sae-lens``
writes one point at one layer in sae-lens' cached-activations layout
(``vllm_lens.dataset.sae_lens_cache``) at ``--output``, from a vllm-lens dataset kept in its
``vllm-lens-rows`` folder (which resumes as usual).

With ``--server URL`` the prompts run on a lens-enabled vLLM server instead (engine options
are ignored): the rows come back over HTTP and are written here, a batch in flight at a time.
With ``--ray`` they run on ``--num-engines`` engines, each a Ray Data actor
(``vllm_lens.cli.extract.ray_actors``); with ``--data-parallel-size N`` on vLLM's own data parallel
engines (``vllm_lens.cli.extract.dp``). Either way every engine writes the one dataset.

``--max-tokens N`` generates N tokens, of which the first N-1 have rows (the last is sampled
but never run through the model); their ids are in the index (``token_ids``; with 0, the one
token sampled to end the request).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_lens.cli.extract.engine_stop import stop_engine
from vllm_lens.cli.extract.args import add_extract_flags, extract_help
from vllm_lens.cli.extract.checks import check_against_model
from vllm_lens.cli.extract.job import ExtractJob, sink_settings
from vllm_lens.cli.extract.output import (
    SAE_LENS_ROWS, check_sae_lens_format, export_sae_lens, finish, lens_spec, prepare_output)
from vllm_lens.cli.extract.ray_actors import check_ray_args

__all__ = ["main"]


def _parser():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(
        prog="vllm-lens", description="vllm-lens tools: vLLM with per-request activation "
        "capture, steering and hooks.\n`vllm-lens COMMAND --help` describes a command's flags.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", add_help=False,
                        help="vLLM's OpenAI-compatible server with vllm-lens: `vllm-lens serve "
                             "MODEL [vllm serve flags]`, on every vLLM distribution (its own "
                             "--help lists vLLM's flags)")
    extract = commands.add_parser(
        "extract", help="write the activations (and SAE features) of a prompt file to an "
                        "activation dataset, locally, on a lens-enabled server (--server) or "
                        "on Ray (--ray); a re-run resumes")
    add_extract_flags(extract)
    EngineArgs.add_cli_args(extract)
    return parser


_OWN = ("command", "input", "split", "output", "layers", "points", "positions", "reduce",
        "max_tokens", "batch_size", "rows_per_shard", "server", "api_key_env", "sae", "top_k",
        "sae_reconstruction", "format", "context_size", "ray", "num_engines", "ray_address")


def engine_kwargs(args: Any) -> dict[str, Any]:
    """The vLLM engine arguments of the command line (everything that is not ``extract``'s).

    Args:
        args: the parsed ``extract`` command line (``argparse.Namespace``).

    Returns:
        The ``LLM(**kwargs)`` keyword arguments: every attribute of ``args`` except
        extract's own flags.
    """
    return {k: v for k, v in vars(args).items() if k not in _OWN}


def main(argv: Sequence[str] | None = None) -> int:
    """``vllm-lens serve ...`` or ``vllm-lens extract ...`` with ``argv`` (default: the
    process's arguments); returns the exit status.

    The ``vllm-lens`` console script. ``serve`` hands the rest of ``argv`` to vLLM's own
    ``vllm serve`` parser and server (``vllm_lens.cli.serve``); ``extract`` runs an extract job
    (see the module docs) and prints a summary line to stderr. ``extract --help`` prints
    extract's own flags, then vLLM's engine flag groups.

    Args:
        argv: the arguments after the program name, e.g. ``["extract", "--model", "M",
            "--input", "p.jsonl", "--output", "acts", "--layers", "3"]``; default ``None``:
            ``sys.argv[1:]``.

    Returns:
        The exit status: 0 when every example was extracted (or for ``--help``), 1 when some
        input rows were bad or some examples were refused (the others are still written);
        for ``serve``, 0 once the server has stopped.

    Raises:
        SystemExit: bad or conflicting flags (the message names the flag; argparse's own
            errors exit with status 2), and ``--help`` for the top level and ``serve``.

    Examples:
        >>> from vllm_lens.cli.main import main
        >>> try:
        ...     main(["extract", "--input", "prompts.jsonl", "--output", str(tmp / "acts")])
        ... except SystemExit as exc:
        ...     print(exc)
        vllm-lens extract: give --model (a model name or path)
        >>> # Skipped: a real extraction starts a second engine beside the examples' one.
        >>> main(["extract", "--model", tiny_path, "--input", "p.jsonl",  # doctest: +SKIP
        ...       "--output", str(tmp / "acts"), "--layers", "1"])
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # vLLM's own serve parser, help included
        from vllm_lens.cli import serve

        return serve.main(argv[1:])
    if argv[:1] == ["extract"] and any(a in ("-h", "--help") for a in argv[1:]):
        print(extract_help())
        return 0
    args = _parser().parse_args(argv)
    if args.server is None and not any(a == "--model" or a.startswith("--model=")
                                       for a in argv):
        raise SystemExit("vllm-lens extract: give --model (a model name or path)")
    if args.server is not None and not any(a == "--model" or a.startswith("--model=")
                                           for a in argv):
        args.model = None  # the server's first model
    return extract(args)


def extract(args: Any) -> int:
    """Run an extract job; ends with a summary line (examples, rows, bytes, time, where).

    Args:
        args: the parsed ``extract`` command line (``argparse.Namespace``).

    Returns:
        The exit status (0, or 1 when some rows or examples failed).

    Raises:
        SystemExit: bad or conflicting flags, named in the message.
    """
    import time

    from vllm_lens.cli.extract.output import summary

    started = time.monotonic()
    final = args.output.resolve()
    rows_dir = final / SAE_LENS_ROWS if args.format == "sae-lens" else final
    before = summary(rows_dir)
    status = _extract(args)
    after = summary(rows_dir)
    if after is not None:
        examples, rows, size = after
        print(f"vllm-lens extract: {rows_dir}: {examples} examples "
              f"({examples - (before or (0,))[0]} new), {rows} rows, {size / 2**20:.1f} MiB, "
              f"in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return status


def _extract(args: Any) -> int:
    from vllm import LLM, SamplingParams

    from vllm_lens.common.points import resolve
    from vllm_lens.cli.extract.prompts import read_examples
    from vllm_lens.sinks.config import check_name

    if args.ray or args.num_engines is not None or args.ray_address is not None:
        check_ray_args(args)
    if args.max_tokens < 0 or args.batch_size < 1:
        raise SystemExit("vllm-lens extract: --max-tokens must be >= 0, --batch-size >= 1")
    if args.layers is None and not args.sae:
        raise SystemExit("vllm-lens extract: give --layers (and --points), or --sae")
    if args.sae and args.reduce:
        raise SystemExit("vllm-lens extract: --reduce cannot be combined with --sae (features "
                         "are written per row)")
    if args.sae and not 1 <= args.top_k:
        raise SystemExit("vllm-lens extract: --top-k must be >= 1")
    if args.server is None:  # a directory, read by the engine's workers: one spelling
        args.sae = [str(Path(sae).resolve()) for sae in args.sae or ()] or None
    final = args.output.resolve()
    output = final / SAE_LENS_ROWS if args.format == "sae-lens" else final
    try:
        check_name(output.name, "--output's directory")
    except ValueError as exc:
        raise SystemExit(f"vllm-lens extract: {exc}") from None
    if args.layers is not None and args.points is None:
        args.points = "resid_post"
    points = []
    for name in (p.strip() for p in (args.points or "").split(",") if p.strip()):
        try:
            point, layer = resolve(name)
        except KeyError as exc:
            raise SystemExit(f"vllm-lens extract: --points: {exc.args[0]}") from None
        if layer is not None:
            raise SystemExit(f"vllm-lens extract: --points: {name} names a layer; give "
                             "layers with --layers")
        points.append(point)
    if args.layers is not None and not points:
        raise SystemExit("vllm-lens extract: --points names no point")
    if points and args.layers is None:
        raise SystemExit("vllm-lens extract: --points needs --layers")
    if args.format == "sae-lens":
        check_sae_lens_format(args, points)
    if args.server is None:  # (a server checks its own model)
        check_against_model(args)
    if args.max_tokens == 0 and args.positions.strip().startswith("generated"):
        raise SystemExit("vllm-lens extract: --positions selects generated rows, but "
                         "--max-tokens 0 generates none")
    examples, bad = read_examples(args.input, args.split)
    for message in bad:
        print(f"vllm-lens extract: {args.input}: {message}", file=sys.stderr)
    if args.server is not None:
        from vllm_lens.cli.extract.remote import extract_remote

        status = extract_remote(args, examples, bad, output, points)
        return export_sae_lens(args, output, final, points, status)
    todo = prepare_output(args, examples, output, points)
    if not todo:
        print("vllm-lens extract: nothing to extract", file=sys.stderr)
        return export_sae_lens(args, output, final, points, finish(bad))
    extra_args = lens_spec(args, points)
    sp = SamplingParams(temperature=0, max_tokens=max(args.max_tokens, 1),
                        extra_args=extra_args)
    if args.ray:
        from vllm_lens.cli.extract.ray_actors import extract_over_ray

        extract_over_ray(args, engine_kwargs(args), sp, todo, bad, output)
        return export_sae_lens(args, output, final, points, finish(bad))
    # The engine's workers write the rows themselves, through a sink of this job's own.
    os.environ["VLLM_LENS_SINKS"] = sink_settings(output, args.rows_per_shard)
    if (args.data_parallel_size or 1) > 1:
        from vllm_lens.cli.extract.dp import extract_data_parallel

        extract_data_parallel(args, engine_kwargs(args), sp, todo, bad, output)
        return export_sae_lens(args, output, final, points, finish(bad))
    llm = LLM(**engine_kwargs(args))
    try:
        ExtractJob(args, llm, sp, output).run(todo, bad)
    finally:
        stop_engine(llm)
    return export_sae_lens(args, output, final, points, finish(bad))


if __name__ == "__main__":
    sys.exit(main())
