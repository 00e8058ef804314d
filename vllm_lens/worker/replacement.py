"""MLPs replaced by transcoders, per request (``replace_mlp``, ``spec.replacement``) (runs in:
worker).

Every TP rank: each holds the MLP's whole input (the norm's output, replicated) and output
(after the all-reduce), and computes the same replacement, so the ranks stay in agreement;
under PP the stage owning the layer replaces it.

Two sites of the layer take part. At the transcoder's input (``mlp_in``, or ``resid_mid``),
after that site's steering and hooks, the request's rows are encoded and what the output
will need is kept: the prediction from the (clamped) features, or with ``keep_error`` only
the clamp's difference ``(v - f[:, i]) @ W_dec[i]``. At the output (``mlp_out``: the ``post``
site, a split layout's ``mlp_block``), before that site's steering, the request's rows are
overwritten with the prediction, or the difference is added. ``keep_error`` without a clamp
leaves the layer as it is and computes nothing. A step in which the input site did not run
for a request never writes stale rows: what is kept is used once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_lens.common.points import operands, site_of
from vllm_lens.saes import SAE
from vllm_lens.spec.replacement import ReplaceSpec
from vllm_lens.worker.capture import sae_chunk_rows

__all__ = ["PreparedReplacement", "prepare_replacement"]


@dataclass
class PreparedReplacement:
    """One layer's replacement for one request, on the model's device."""

    spec: ReplaceSpec
    transcoder: SAE
    in_site: str
    out_site: str
    features: torch.Tensor | None
    """The clamped features' indices (long, on the device), or ``None``."""
    targets: torch.Tensor | None
    """Their values, in the transcoder's dtype."""
    pending: torch.Tensor | None = None
    """This step's rows for the output site (the prediction, or ``keep_error``'s difference),
    from the input site; used once."""

    @property
    def idle(self) -> bool:
        """``keep_error`` without a clamp: the layer computes what it did; nothing to do."""
        return self.spec.keep_error and self.features is None

    def read(self, a: torch.Tensor, b: torch.Tensor | None, start: int, end: int) -> None:
        """At the input site: encode the request's rows ``start:end`` of the tap's tensors."""
        hidden, residual = operands(self.spec.point, a, b)
        x = hidden[start:end] if residual is None else hidden[start:end] + residual[start:end]
        tc = self.transcoder
        parts = []
        for chunk in x.split(sae_chunk_rows(tc.d_sae)):
            f = tc.encode(chunk)
            if self.spec.keep_error:  # decode(f') - decode(f): only the clamped features move
                moved = self.targets.to(f.dtype) - f.index_select(1, self.features)
                parts.append(moved @ self._directions(f.dtype))
                continue
            if self.features is not None:
                f = f.index_copy(1, self.features,
                                 self.targets.to(f.dtype).expand(f.shape[0], -1))
            parts.append(tc.predict(chunk, f))
        self.pending = (torch.cat(parts) if len(parts) > 1 else parts[0]) if parts else \
            x.new_zeros((0, tc.d_out))

    def write(self, a: torch.Tensor, b: torch.Tensor | None, start: int, end: int) -> None:
        """At the output site: the request's rows of the MLP's output, in place."""
        pending, self.pending = self.pending, None
        if pending is None:
            raise RuntimeError(f"layer {self.spec.layer}'s {self.in_site} site did not run "
                               "for it in this step, so there is nothing to write")
        y, _ = operands("mlp_out", a, b)
        rows = y[start:end]
        if self.spec.keep_error:
            rows.add_(pending.to(y.dtype))
        else:
            rows.copy_(pending)

    def _directions(self, dtype: torch.dtype) -> torch.Tensor:
        """The clamped features' decoder rows ``[k, d_out]`` in ``dtype`` (made once)."""
        cached = self.__dict__.get("_rows")
        if cached is None or cached.dtype != dtype:
            cached = self.transcoder.W_dec.index_select(0, self.features).to(dtype)
            self.__dict__["_rows"] = cached
        return cached


def prepare_replacement(spec: ReplaceSpec, transcoder: SAE, *, split: bool
                        ) -> PreparedReplacement:
    """``spec`` with the transcoder this worker holds for it (on the model's device)."""
    device, dtype = transcoder.W_dec.device, transcoder.dtype
    features = targets = None
    if spec.clamp:
        features = torch.tensor([f for f, _ in spec.clamp], dtype=torch.long, device=device)
        targets = torch.tensor([v for _, v in spec.clamp], dtype=dtype, device=device)
    return PreparedReplacement(spec, transcoder, site_of(spec.point, split=split),
                               site_of("mlp_out", split=split), features, targets)
