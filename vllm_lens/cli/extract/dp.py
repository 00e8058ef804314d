"""``vllm-lens extract --data-parallel-size N``: the prompts over vLLM's own data parallel engines
on one machine (runs in: caller, front end).

The user's process holds the ``AsyncLLM``.

vLLM's offline ``LLM`` runs one engine, so a job with ``--data-parallel-size`` above 1 runs
on an ``AsyncLLM``: a batch's requests are sent together and vLLM spreads them over its
engines, whose workers each write their examples through the job's capture sink as a writer
of their own (``dataset.writer``: shards of its own, one index and manifest). Each batch is
flushed on every engine before the next is sent.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from vllm_lens.cli.extract.engine_stop import stop_engine
from vllm_lens.cli.extract.job import check_written, engine_input
from vllm_lens.cli.extract.output import fail

__all__ = ["extract_data_parallel"]


def extract_data_parallel(args: Any, engine: dict[str, Any], sp: Any, todo: list[Any],
                          bad: list[str], output: Path) -> None:
    """Run ``todo`` on one ``AsyncLLM`` of ``engine``'s options (``data_parallel_size`` above
    1) writing ``output``; failures are listed in ``bad``."""
    asyncio.run(_extract(args, engine, sp, todo, bad, output))


async def _extract(args: Any, engine: dict[str, Any], sp: Any, todo: list[Any],
                   bad: list[str], output: Path) -> None:
    from tqdm import tqdm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm_lens.errors import LensExecutionError, UnsupportedConfigError
    from vllm_lens.frontend.sink_control import flush_sinks_async

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine))
    try:
        tokenizer = llm.get_tokenizer()
        if asyncio.iscoroutine(tokenizer):
            tokenizer = await tokenizer
        accepted: list[str] = []
        n_tokens, began = 0, time.monotonic()
        with tqdm(total=len(todo), unit="ex", desc="extract", file=sys.stderr) as bar:
            for lo in range(0, len(todo), args.batch_size):
                batch = todo[lo:lo + args.batch_size]
                try:
                    done = await asyncio.gather(*(
                        _one(llm, example, tokenizer, sp, output, bad) for example in batch))
                except UnsupportedConfigError as exc:  # the set-up: no row can run
                    raise SystemExit(f"vllm-lens extract: {exc}") from None
                for key, tokens in filter(None, done):
                    accepted.append(key)
                    n_tokens += tokens
                try:
                    await flush_sinks_async(llm)
                except LensExecutionError as exc:
                    print(f"vllm-lens extract: {exc}", file=sys.stderr)
                bar.set_postfix(tok_s=f"{n_tokens / (time.monotonic() - began):.0f}")
                bar.update(len(batch))
        check_written(output, accepted, bad)
    finally:
        stop_engine(llm)


async def _one(llm: Any, example: Any, tokenizer: Any, sp: Any, output: Path,
               bad: list[str]) -> tuple[str, int] | None:
    """One example through the engine: (its key, the tokens it ran), or ``None`` if it
    failed (listed in ``bad``)."""
    from vllm_lens.errors import UnsupportedConfigError
    from vllm_lens.cli.extract.job import SINK

    params = sp.clone()
    params.extra_args = {**sp.extra_args, "capture_sink": {
        "sink": SINK, "dataset": output.name, "key": example.key}}
    final = None
    try:
        prompt = engine_input(example, tokenizer)
        async for out in llm.generate(prompt, params, request_id=f"extract-{example.key}"):
            final = out
    except UnsupportedConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - this row is bad, not the job
        fail(bad, example, exc)
        return None
    if final is None or final.lens_error is not None:
        fail(bad, example, final.lens_error if final is not None else "no output")
        return None
    return example.key, len(final.prompt_token_ids) + len(final.outputs[0].token_ids)
