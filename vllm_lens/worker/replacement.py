"""MLPs replaced by transcoders, per request (``replace_mlp``, ``spec.replacement``) (runs in:
worker).

Every TP rank: each holds the MLP's whole input (the norm's output, replicated) and output
(after the all-reduce), and computes the same replacement, so the ranks stay in agreement;
under PP the stage owning the layer replaces it.

Two sites of the layer take part. At the transcoder's input (``mlp_in``, or ``resid_mid``),
after that site's steering and hooks, the request's rows are encoded and what the output
will need is kept, in the model's dtype: the prediction from the (clamped) features, or with
``keep_error`` only the clamp's difference ``(v - f[:, i]) @ W_dec[i]`` (which needs the
clamped features alone: their encoder columns, as sae-lens' ``standard`` and ``jumprelu``
encoders compute each feature from its own column). At the output (``mlp_out``: the
``post`` site, a split layout's ``mlp_block``), before that site's steering, the request's
rows are overwritten with the prediction, or the difference is added. ``keep_error`` without
a clamp leaves the layer as it is and computes nothing. Requests replacing alike (the same
transcoder, ``keep_error`` and clamp) are one group per step, encoded together, so the
transcoder's weights are read once a step however many requests use it. What the input site
kept is used once: a step in which it did not run never writes stale rows.

A replacement keeps running for a request whose other lens work failed (its prefix-cache
salt promises it, and every rank must go on computing alike); one that fails itself stops,
and its request fails and is ended (``tap_handler``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_lens.common.points import operands, site_of
from vllm_lens.saes import SAE
from vllm_lens.spec.replacement import ReplaceSpec
from vllm_lens.worker.capture import pick_rows, sae_chunk_rows
from vllm_lens.worker.plan import device_index

__all__ = ["PreparedReplacement", "ReplacementGroup", "held_transcoder", "prepare_replacement"]


@dataclass
class PreparedReplacement:
    """One layer's replacement for one request, on the model's device (made when the request
    first runs)."""

    spec: ReplaceSpec
    """Never ``idle`` (those are not prepared: the layer computes what it did)."""
    transcoder: SAE
    in_site: str
    """Where it reads (``mlp_in``, or ``mid`` for ``resid_mid``)."""
    out_site: str
    """Where the MLP's output is written (``post``; a split layout's ``mlp_block``)."""
    features: torch.Tensor | None
    """The clamped features' indices (long, on the device), or ``None``."""
    targets: torch.Tensor | None
    """Their values (float32, on the device)."""
    failed: bool = False
    """A site raised: the replacement stops (its request failed)."""

    @property
    def key(self) -> tuple:
        """Equal for requests replacing alike (one transcoder, ``keep_error``, clamp): one
        step computes them together, reading the transcoder's weights once."""
        return (id(self.transcoder), self.spec.layer, self.spec.point, self.spec.keep_error,
                self.spec.clamp)

    def _columns(self, dtype: torch.dtype
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None, torch.Tensor]:
        """The clamped features' encoder columns and bias, JumpReLU thresholds and decoder
        rows in ``dtype`` (made once per dtype)."""
        cached = self.__dict__.setdefault("_columns_by_dtype", {})
        if dtype not in cached:
            tc, index = self.transcoder, self.features
            encoder = (tc.W_enc.index_select(1, index).to(dtype),
                       tc.b_enc.index_select(0, index).to(dtype))
            threshold = (None if tc.threshold is None
                         else tc.threshold.index_select(0, index).to(dtype))
            cached[dtype] = (encoder, threshold, tc.W_dec.index_select(0, index).to(dtype))
        return cached[dtype]


@dataclass
class ReplacementGroup:
    """One step's replacement for the requests replacing alike at one layer: their rows are
    encoded and written together."""

    replacement: PreparedReplacement
    """The first member's (every member's computes the same)."""
    members: list[tuple[Any, PreparedReplacement]]
    """(``plan.RequestSlice``, its replacement) per request."""
    rows: torch.Tensor | slice
    """The members' rows of the step's batch (indices on the device, or a slice)."""
    pending: torch.Tensor | None = None
    """This step's rows for the output site (the prediction, or ``keep_error``'s difference),
    from the input site, in the model's dtype; used once."""

    @classmethod
    def build(cls, members: list[tuple[Any, PreparedReplacement]], device: torch.device
              ) -> ReplacementGroup:
        """The group of ``members`` (``(RequestSlice, replacement)``, computing alike) for
        this step: their rows as a slice where they lie together, else as indices copied to
        ``device`` without waiting."""
        ranges = [(s.start, s.end) for s, _ in members]
        rows: torch.Tensor | slice
        if all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])):
            rows = slice(ranges[0][0], ranges[-1][1])
        else:
            rows = device_index(np.concatenate([np.arange(a, b) for a, b in ranges]), device)
        return cls(members[0][1], members, rows)

    @classmethod
    def add_to(cls, plan: Any, members: list[tuple[Any, PreparedReplacement]],
               device: torch.device) -> None:
        """Group ``members`` for this step and put the group where ``plan`` (``StepPlan``)
        runs it: at its input site and at the MLP's output site."""
        group = cls.build(members, device)
        spec = group.replacement.spec
        plan.replace_in.setdefault((spec.layer, group.replacement.in_site), []).append(group)
        plan.replace_out.setdefault((spec.layer, group.replacement.out_site), []).append(group)

    @property
    def failed(self) -> bool:
        """Every member's replacement stopped (a member whose replacement failed at another
        layer is still computed here with the others: its request is ending anyway)."""
        return all(r.failed for _, r in self.members)

    def read(self, a: torch.Tensor, b: torch.Tensor | None) -> None:
        """At the input site: encode the members' rows of the tap's tensors."""
        replacement = self.replacement
        hidden, residual = operands(replacement.spec.point, a, b)
        x = pick_rows(hidden, self.rows)
        if residual is not None:
            x = x + pick_rows(residual, self.rows)
        out_dtype = a.dtype
        tc = replacement.transcoder
        if replacement.spec.keep_error:  # decode(f') - decode(f): only the clamped ones move
            (weight, bias), threshold, directions = replacement._columns(tc.compute_dtype(x))
            h = x.to(weight.dtype) @ weight + bias
            f = h.relu() if threshold is None else h.relu() * (h > threshold)
            moved = replacement.targets.to(f.dtype) - f
            self.pending = (moved @ directions).to(out_dtype)
            return
        parts = []
        for chunk in x.split(sae_chunk_rows(tc.d_sae)):
            f = tc.encode(chunk)
            if replacement.features is not None:
                f = f.index_copy(1, replacement.features,
                                 replacement.targets.to(f.dtype).expand(f.shape[0], -1))
            parts.append(tc.predict(chunk, f).to(out_dtype))
        self.pending = (torch.cat(parts) if len(parts) > 1 else parts[0]) if parts else \
            x.new_zeros((0, tc.d_out), dtype=out_dtype)

    def write(self, a: torch.Tensor, b: torch.Tensor | None) -> None:
        """At the output site: the members' rows of the MLP's output, in place."""
        pending, self.pending = self.pending, None
        if pending is None:
            raise RuntimeError(f"layer {self.replacement.spec.layer}'s "
                               f"{self.replacement.in_site} site did not run in this step, "
                               "so there is nothing to write")
        y, _ = operands("mlp_out", a, b)
        keep = self.replacement.spec.keep_error
        if isinstance(self.rows, slice):
            target = y[self.rows]
            if keep:
                target.add_(pending)
            else:
                target.copy_(pending)
        elif keep:
            y.index_add_(0, self.rows, pending)
        else:
            y.index_copy_(0, self.rows, pending)


def held_transcoder(saes: Any, spec: ReplaceSpec) -> SAE:
    """The transcoder a replacement computes with: the one this worker's registry
    (``worker.saes.SAERegistry``) loaded when the front end admitted the request, of the
    files it was admitted with."""
    transcoder = saes.get(spec.path, spec.hook_point, resolved=True)
    if transcoder is None:
        raise ValueError(f"the transcoder {spec.transcoder!r} replacing layer {spec.layer}'s "
                         "MLP is not loaded on this worker (unloaded for another since the "
                         "request was admitted?)")
    if saes.version(spec.path, spec.hook_point) != spec.version:
        raise ValueError(f"the transcoder {spec.transcoder!r} was read again from changed "
                         "files since the request was admitted; retry it")
    return transcoder


def prepare_replacement(spec: ReplaceSpec, transcoder: SAE, *, split: bool
                        ) -> PreparedReplacement:
    """``spec`` with the transcoder this worker holds for it (on the model's device)."""
    device = transcoder.W_dec.device
    features = targets = None
    if spec.clamp:  # made on the host, copied without waiting for the device
        features = torch.tensor([f for f, _ in spec.clamp], dtype=torch.long).to(
            device, non_blocking=True)
        targets = torch.tensor([v for _, v in spec.clamp], dtype=torch.float32).to(
            device, non_blocking=True)
    return PreparedReplacement(spec, transcoder, site_of(spec.point, split=split),
                               site_of("mlp_out", split=split), features, targets)
