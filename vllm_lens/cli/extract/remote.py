"""``vllm-lens extract --server URL``: a prompt file through a lens-enabled vLLM server into a local
activation dataset (runs in: caller).

The model runs on the server.

Requests go out a batch (``--batch-size``) at a time with ``AsyncLensClient``; their rows come
back with the binary transport and are written with ``ShardWriter`` a shard at a time, so the
process holds at most a batch's rows and one shard. Settings, resume and bad rows work as for
the in-process job (``vllm_lens.cli.main``).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import sys
import time
from pathlib import Path
from typing import Any

from vllm_lens.cli.extract.output import fail, finish, lens_spec, prepare_output
from vllm_lens.client import AsyncLensClient
from vllm_lens.dataset.writer import ShardWriter

__all__ = ["extract_remote"]


def extract_remote(args: Any, examples: list[Any], bad: list[str], output: Path,
                   points: list[str]) -> int:
    """``extract --server``: the prompts run on a lens-enabled server, a batch in flight at a
    time; their rows come back (binary transport) and are written here a shard at a time."""
    if args.model is None:
        async def model_name() -> str:
            async with AsyncLensClient(args.server,
                                       api_key=os.environ.get(args.api_key_env)) as client:
                return await client.served_model()

        args.model = asyncio.run(model_name())
    todo = prepare_output(args, examples, output, points)
    job = _RemoteJob(args, output, points, args.model)
    try:
        asyncio.run(job.run(todo, bad))
    finally:
        job.close()
    return finish(bad)


class _RemoteJob:
    """``extract --server``: requests to the server, rows into a local ``ShardWriter``."""

    def __init__(self, args: Any, output: Path, points: list[str], model: str) -> None:
        self.args, self.output, self.points, self.model = args, output, points, model
        self.writer: Any = None
        self.fingerprint = "unknown"
        self.d_sae: dict[str, int] = {}
        """The width of each SAE the job reads, as the server lists it."""

    async def run(self, todo: list[Any], bad: list[str]) -> None:
        from tqdm import tqdm

        spec = lens_spec(self.args, self.points)
        n_tokens, started = 0, time.monotonic()
        async with AsyncLensClient(self.args.server, model=self.model,
                                   api_key=os.environ.get(self.args.api_key_env)) as client:
            if self.args.sae:
                self.d_sae = {s["name"]: int(s["d_sae"]) for s in await client.saes()}
            with tqdm(total=len(todo), unit="ex", desc="extract", file=sys.stderr) as bar:
                for lo in range(0, len(todo), self.args.batch_size):
                    batch = todo[lo:lo + self.args.batch_size]
                    results = await asyncio.gather(
                        *(self._one(client, e, spec) for e in batch), return_exceptions=True)
                    for example, result in zip(batch, results):
                        if isinstance(result, BaseException):
                            fail(bad, example, result)
                            continue
                        try:
                            self._write(example, result)
                        except ValueError as exc:  # rows that do not fit the dataset
                            fail(bad, example, exc)
                            continue
                        n_tokens += len(result.prompt_token_ids or ()) + len(result.token_ids)
                    written = sum(f.stat().st_size
                                  for f in self.output.glob("shard-*.safetensors"))
                    bar.set_postfix(tok_s=f"{n_tokens / (time.monotonic() - started):.0f}",
                                    written=f"{written / 2**20:.1f}MiB")
                    bar.update(len(batch))

    async def _one(self, client: Any, example: Any, spec: dict[str, Any]) -> Any:
        options = dict(max_tokens=max(self.args.max_tokens, 1), temperature=0.0,
                       transport="binary", output_activations=spec.get("output_activations"),
                       sae_features=spec.get("output_sae_features"))
        if example.prompt is not None:
            return await client.generate(example.prompt, **options)
        return await client.chat(example.messages, **options)

    def _write(self, example: Any, result: Any) -> None:
        acts = result.activations
        reduced = self.args.reduce is not None
        rows = {p: acts[p][:, None] if reduced else acts[p] for p in self.points}
        found = result.sae_features or []
        features = [{f: e[f] for f in ("indices", "values", "nmse", "l0") if f in e}
                    for e in found]
        positions = (acts[f"{self.points[0]}_positions"] if self.points
                     else found[0]["positions"]).tolist()
        if any(e["positions"].tolist() != positions for e in found):
            raise ValueError("the server read the SAE features at other positions than the "
                             "rows")
        if self.writer is None:
            self.fingerprint = result.raw.get("system_fingerprint") or "unknown"
            self.writer = ShardWriter(self.output, self._manifest(rows, found),
                                      rows_per_shard=self.args.rows_per_shard, resume=True)
        self.writer.add(example.key, rows, positions, result.prompt_token_ids or [],
                        result.token_ids, reduced=reduced, sae_features=features)

    def _manifest(self, rows: dict[str, Any], saes: list[dict[str, Any]]) -> dict[str, Any]:
        first = rows[self.points[0]] if self.points else None
        if first is None:
            layers = []
        elif self.args.layers.strip() == "all":
            layers = list(range(first.shape[0]))
        else:
            layers = sorted({int(x) for x in self.args.layers.split(",") if x.strip()})
        manifest = {
            "model": self.model, "vllm_version": f"server {self.fingerprint}",
            "vllm_lens_version": _lens_version(), "points": self.points, "layers": layers,
            "dtype": "float32" if first is None else str(first.dtype).removeprefix("torch."),
            "row_shapes": {p: list(rows[p].shape[2:]) for p in self.points},
            "positions": self.args.positions, "reduce": self.args.reduce,
        }
        if saes:
            manifest["sae_features"] = [
                {"sae": e["sae"], "point": e["point"], "layer": e["layer"],
                 "d_sae": self.d_sae.get(e["sae"]), "top_k": self.args.top_k,
                 "reconstruction": self.args.sae_reconstruction} for e in saes]
        return manifest

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _lens_version() -> str:
    try:
        return importlib.metadata.version("vllm-lens")
    except importlib.metadata.PackageNotFoundError:
        return "source"
