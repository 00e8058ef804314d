"""Running an ``extract`` job's prompts through one offline engine whose workers write the rows
(runs in: caller, front end).

The process that holds the engine: ``vllm-lens extract`` itself, or each engine actor of ``vllm-lens
extract --ray`` (``extract.ray_actors``).

The engine's workers write through a capture sink of the job's own (``SINK``, added to the
operator's ``VLLM_LENS_SINKS`` by ``sink_settings``); the front end holds only receipts. An
example the engine refuses is listed and the others still run; a refusal of the engine's
set-up (no row can run) ends the job at the first batch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vllm_lens.cli.extract.output import fail

__all__ = ["SINK", "ExtractJob", "check_written", "engine_input", "sink_settings"]

#: The sink ``extract`` adds to the engine's (named so that no operator's name can clash).
SINK = "vllm-lens-extract"


def sink_settings(output: Path, rows_per_shard: int) -> str:
    """``VLLM_LENS_SINKS`` for the job's engine: the operator's sinks, if any, and ``SINK``
    writing to ``output``'s parent (the dataset is ``output.name``), each batch on disk
    before it is reported (``flush_s`` 0 and ``ExtractJob`` flushes)."""
    return json.dumps({**_operator_sinks(), SINK: {
        "kind": "safetensors", "root": str(output.parent), "rows_per_shard": rows_per_shard,
        "flush_s": 0}})


def _operator_sinks() -> dict[str, Any]:
    """The sinks already configured in this environment (kept beside ``extract``'s own)."""
    from vllm_lens.sinks.config import parse_config

    raw = os.environ.get("VLLM_LENS_SINKS", "").strip()
    if not raw:
        return {}
    try:
        parse_config(raw)
        return json.loads(raw if raw.startswith("{") else Path(raw).read_text())
    except ValueError as exc:
        raise SystemExit(f"vllm-lens extract: {exc}") from None


class ExtractJob:
    """Batches of prompts through an offline ``LLM`` whose workers write the rows.

    Args:
        args: the parsed command line (``batch_size`` is read).
        llm: the engine, started with ``sink_settings`` in its environment.
        sp: the sampling parameters carrying the job's lens keys (``extract.output.lens_spec``).
        output: the dataset directory.
    """

    def __init__(self, args: Any, llm: Any, sp: Any, output: Path) -> None:
        self.args, self.llm, self.sp, self.output = args, llm, sp, output
        self.tokenizer = llm.get_tokenizer()
        self.receipts: dict[str, dict[str, Any]] = {}
        """Key -> the sink's receipt, for every example the workers accepted."""

    def run(self, todo: list[Any], bad: list[str]) -> None:
        """Every example of ``todo``, ``batch_size`` at a time, with a progress bar; then
        flushed, and each accepted example checked to be in the index (``bad`` lists those
        that are not, and every example that failed)."""
        from tqdm import tqdm

        n_tokens, started = 0, time.monotonic()
        with tqdm(total=len(todo), unit="ex", desc="extract", file=sys.stderr) as bar:
            for lo in range(0, len(todo), self.args.batch_size):
                batch = todo[lo:lo + self.args.batch_size]
                n_tokens += self.run_batch(batch, bad, flush=False)
                written = sum(f.stat().st_size for f in self.output.glob("shard-*.safetensors"))
                bar.set_postfix(tok_s=f"{n_tokens / (time.monotonic() - started):.0f}",
                                written=f"{written / 2**20:.1f}MiB")
                bar.update(len(batch))
        self.flush()
        check_written(self.output, self.receipts, bad)

    def run_batch(self, batch: list[Any], bad: list[str], *, flush: bool = True) -> int:
        """One batch (failures listed in ``bad``); with ``flush``, on disk when it returns.
        Returns the tokens it ran through the model."""
        n_tokens = 0
        for example, out in self._generate(batch, bad):
            if out.lens_error is not None:
                fail(bad, example, out.lens_error)
                continue
            self.receipts[example.key] = out.capture_receipt
            n_tokens += len(out.prompt_token_ids) + len(out.outputs[0].token_ids)
        if flush:
            self.flush()
        return n_tokens

    def flush(self) -> None:
        """Write every example the workers queued. A failure is printed; the examples it
        dropped are those ``check_written`` then finds missing."""
        from vllm_lens.errors import LensExecutionError
        from vllm_lens.frontend.sink_control import flush_sinks

        try:
            flush_sinks(self.llm)
        except LensExecutionError as exc:
            print(f"vllm-lens extract: {exc}", file=sys.stderr)

    def _params(self, key: str) -> Any:
        sp = self.sp.clone()
        sp.extra_args = {**sp.extra_args, "capture_sink": {
            "sink": SINK, "dataset": self.output.name, "key": key}}
        return sp

    def _generate(self, batch: list[Any], bad: list[str]) -> list[tuple[Any, Any]]:
        """(example, output) for the batch; an example the engine refuses (too long, a chat
        template error ...) is listed in ``bad`` and the rest still run."""
        from vllm_lens.errors import UnsupportedConfigError

        inputs = []
        for example in batch:
            try:
                inputs.append((example, engine_input(example, self.tokenizer)))
            except Exception as exc:  # noqa: BLE001 - the row is bad, not the job
                fail(bad, example, exc)
        try:
            outs = self.llm.generate([i for _, i in inputs],
                                     [self._params(e.key) for e, _ in inputs], use_tqdm=False)
            return [(e, out) for (e, _), out in zip(inputs, outs)]
        except UnsupportedConfigError as exc:  # the engine's set-up, not a row: no row can run
            raise SystemExit(f"vllm-lens extract: {exc}") from None
        except ValueError:  # some input the engine rejects: find it, run the others
            done = []
            for example, one in inputs:
                try:
                    (out,) = self.llm.generate([one], self._params(example.key), use_tqdm=False)
                    done.append((example, out))
                except ValueError as exc:
                    fail(bad, example, exc)
            return done


def check_written(output: Path, accepted: Iterable[str], bad: list[str]) -> None:
    """Every example the workers accepted must be complete in the index now (a shard write
    that failed after its examples were accepted dropped them): those missing are listed."""
    from vllm_lens.dataset.index import complete_keys

    there = set(complete_keys(output))  # (a pipeline-parallel example: every stage's part)
    for key in accepted:
        if key not in there:
            bad.append(f"key {key!r}: accepted, but its shard could not be written (see "
                       "the error above); re-run to write it")
            print(f"vllm-lens extract: {bad[-1]}", file=sys.stderr)


def engine_input(example: Any, tokenizer: Any) -> Any:
    """What the engine runs for one input row: its prompt text, or its chat rendered with the
    model's chat template (as token ids)."""
    if example.prompt is not None:
        return example.prompt
    ids = tokenizer.apply_chat_template(example.messages, add_generation_prompt=True,
                                        tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 answers with the tokenizer's dict
        ids = ids["input_ids"]
    return {"prompt_token_ids": [int(i) for i in ids]}
