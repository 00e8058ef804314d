"""One sparse autoencoder in memory, whatever layout it was read from, and its arithmetic:
encode, decode, the k largest features per row (runs in: whichever process loads it — the
worker that serves its features, or a user's own process).

The conventions are sae-lens' (``W_enc [d_in, d_sae]``, ``W_dec [d_sae, d_in]``), and each
architecture computes what sae-lens' class of that name computes:

- ``standard``: ``relu(x' @ W_enc + b_enc)``
- ``jumprelu``: ``relu(h) * (h > threshold)`` with ``h = x' @ W_enc + b_enc``
- ``topk``: the ``k`` largest of ``h`` (optionally ``h * |W_dec[i]|``), ReLU'd, the rest 0

where ``x' = x - b_dec`` if ``apply_b_dec_to_input`` else ``x``; decoding is
``f @ W_dec + b_dec`` (for a TopK SAE that rescaled by the decoder norms, ``f / |W_dec[i]|``
first). Rows are computed in the wider of the SAE's and the rows' dtypes: a float32 SAE reads
bfloat16 rows cast up, never the other way round.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["ARCHITECTURES", "SAE"]

ARCHITECTURES = ("standard", "jumprelu", "topk")


@dataclass(eq=False)
class SAE:
    """A sparse autoencoder's weights and what they mean."""

    architecture: str
    """``standard``, ``jumprelu`` or ``topk`` (``ARCHITECTURES``)."""
    W_enc: torch.Tensor
    """``[d_in, d_sae]``."""
    b_enc: torch.Tensor
    W_dec: torch.Tensor
    """``[d_sae, d_in]``: row ``i`` is feature ``i``'s direction as stored."""
    b_dec: torch.Tensor
    layout: str
    """The on-disk layout it was read from (``formats.LAYOUTS``)."""
    threshold: torch.Tensor | None = None
    """JumpReLU only: ``[d_sae]``."""
    k: int | None = None
    """TopK only: features kept per row."""
    apply_b_dec_to_input: bool = True
    rescale_acts_by_decoder_norm: bool = False
    """TopK only (sae-lens): pre-activations are scaled by each feature's decoder norm."""
    hook_name: str | None = None
    """Where it reads, as its file names it (``blocks.12.hook_resid_post``), if it does."""
    point: str | None = None
    """The vllm-lens tap point it reads (``points.POINTS``), once resolved (``load_sae``)."""
    layer: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not one of "
                             f"{', '.join(ARCHITECTURES)}")
        d_in, d_sae = self.W_enc.shape
        shapes = {"W_enc": (self.W_enc, (d_in, d_sae)), "b_enc": (self.b_enc, (d_sae,)),
                  "W_dec": (self.W_dec, (d_sae, d_in)), "b_dec": (self.b_dec, (d_in,))}
        if self.architecture == "jumprelu":
            if self.threshold is None:
                raise ValueError("a jumprelu SAE needs a threshold")
            shapes["threshold"] = (self.threshold, (d_sae,))
        for name, (tensor, shape) in shapes.items():
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}; with W_enc "
                                 f"{tuple(self.W_enc.shape)} it must be {shape}")
        if self.architecture == "topk" and not (isinstance(self.k, int) and 1 <= self.k <= d_sae):
            raise ValueError(f"a topk SAE needs k between 1 and d_sae={d_sae}, got {self.k!r}")

    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        return int(self.W_enc.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (
            self.W_enc, self.b_enc, self.W_dec, self.b_dec,
            *(() if self.threshold is None else (self.threshold,))))

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> SAE:
        """The same SAE with its tensors on ``device`` (and in ``dtype``, if given)."""
        move = {name: getattr(self, name).to(device, dtype) for name in
                ("W_enc", "b_enc", "W_dec", "b_dec")}
        if self.threshold is not None:
            move["threshold"] = self.threshold.to(device, dtype)
        return dataclasses.replace(self, **move)

    # -- arithmetic ---------------------------------------------------------------------------
    def _weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The weights in ``dtype``: its own, or a copy made once (rows wider than the SAE)."""
        if dtype == self.dtype:
            names = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")
            return {n: getattr(self, n) for n in names}
        cache = self.__dict__.setdefault("_cast", {})
        if dtype not in cache:
            cache[dtype] = {n: None if getattr(self, n) is None else getattr(self, n).to(dtype)
                            for n in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")}
        return cache[dtype]

    def compute_dtype(self, rows: torch.Tensor) -> torch.dtype:
        """The wider of the SAE's and the rows' dtypes."""
        return torch.promote_types(self.dtype, rows.dtype)

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """``h`` for rows ``x`` ``[n, d_in]`` (before the activation function)."""
        w = self._weights(self.compute_dtype(x))
        x = x.to(w["W_enc"].dtype)
        if self.apply_b_dec_to_input:
            x = x - w["b_dec"]
        h = x @ w["W_enc"] + w["b_enc"]
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            h = h * w["W_dec"].norm(dim=-1)
        return h

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations ``[n, d_sae]`` of rows ``x`` ``[n, d_in]``."""
        h = self.pre_activations(x)
        if self.architecture == "standard":
            return h.relu()
        if self.architecture == "jumprelu":
            threshold = self.threshold.to(h.dtype)  # type: ignore[union-attr]
            return h.relu() * (h > threshold).to(h.dtype)
        values, indices = torch.topk(h, k=self.k, dim=-1, sorted=False)  # type: ignore[arg-type]
        return torch.zeros_like(h).scatter_(-1, indices, values.relu())

    def decode(self, features: torch.Tensor) -> torch.Tensor:
        """Rows ``[n, d_in]`` reconstructed from feature activations ``[n, d_sae]``."""
        w = self._weights(torch.promote_types(self.dtype, features.dtype))
        f = features.to(w["W_dec"].dtype)
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            f = f / w["W_dec"].norm(dim=-1)
        return f @ w["W_dec"] + w["b_dec"]

    def top_features(self, x: torch.Tensor, top_k: int, *, reconstruction: bool = False
                     ) -> dict[str, torch.Tensor]:
        """Per row of ``x`` ``[n, d_in]``, its ``top_k`` largest feature activations.

        Returns ``{"indices": int32 [n, top_k], "values": float32 [n, top_k]}``, descending,
        padded with index -1 and value 0 where fewer than ``top_k`` features are active; with
        ``reconstruction`` also ``"nmse"`` float32 ``[n]`` (``|x - x_hat|^2 / |x|^2``) and
        ``"l0"`` int32 ``[n]`` (active features, before ``top_k``).
        """
        if not 1 <= top_k <= self.d_sae:
            raise ValueError(f"top_k must be between 1 and d_sae={self.d_sae}, got {top_k}")
        features = self.encode(x)
        values, indices = torch.topk(features, k=top_k, dim=-1, sorted=True)
        active = values > 0
        out = {"indices": torch.where(active, indices, -1).to(torch.int32),
               "values": torch.where(active, values, 0).to(torch.float32)}
        if reconstruction:
            rows = x.to(features.dtype)
            error = (rows - self.decode(features)).pow(2).sum(-1)
            out["nmse"] = (error / rows.pow(2).sum(-1)).to(torch.float32)
            out["l0"] = (features > 0).sum(-1).to(torch.int32)
        return out
