"""One sparse autoencoder in memory, whatever layout it was read from, and its arithmetic: encode,
decode, the k largest features per row (runs in: any).

The worker that serves its features, or a user's own process.

The conventions are sae-lens' (``W_enc [d_in, d_sae]``, ``W_dec [d_sae, d_in]``), and each
architecture computes what sae-lens' class of that name computes:

- ``standard``: ``relu(x' @ W_enc + b_enc)``
- ``jumprelu``: ``relu(h) * (h > threshold)`` with ``h = x' @ W_enc + b_enc``
- ``topk``: the ``k`` largest of ``h`` (optionally ``h * |W_dec[i]|``), ReLU'd, the rest 0
- ``abstopk``: the ``k`` of ``h`` (optionally ``h * |W_dec[i]|``) largest in magnitude, signed
  (no ReLU: a feature may be negative), the rest 0
- ``gated``: ``(g + b_gate > 0) * relu(g * exp(r_mag) + b_mag)`` with ``g = x' @ W_enc``: one
  product for the gate and, rescaled per feature, for the magnitude (``b_enc`` holds
  ``b_mag``)

A *transcoder* (``transcoder``, ``skip_transcoder``, ``jumprelu_transcoder``,
``jumprelu_skip_transcoder``) reads one point and predicts another (the MLP's input and
output): it encodes as ``standard`` / ``jumprelu`` without subtracting ``b_dec`` (which is
``d_out`` wide), decodes into ``d_out``, and its prediction (`forward`) adds
``x @ W_skip.T`` for the skip variants, as sae-lens' ``Transcoder`` classes.

where ``x' = x - b_dec`` if ``apply_b_dec_to_input`` else ``x``; decoding is
``f @ W_dec + b_dec`` (for a TopK SAE that rescaled by the decoder norms, ``f / |W_dec[i]|``
first; ``abstopk`` likewise). Rows are computed in the wider of the SAE's and the rows' dtypes: a float32 SAE reads
bfloat16 rows cast up, never the other way round. The encoder's and decoder's products go
through ``linear.Linear`` (oneDNN with a reordered copy of the weight on the host, where that
is faster), made once per dtype (``prepare``).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch

from vllm_lens.saes.linear import Linear

__all__ = ["ARCHITECTURES", "RESCALED", "SAE", "SIGNED", "TRANSCODERS", "WHOLE_CLAMP"]

#: Transcoders (sae-lens' names), each computing as the SAE architecture it maps to.
TRANSCODERS = {"transcoder": "standard", "skip_transcoder": "standard",
               "jumprelu_transcoder": "jumprelu", "jumprelu_skip_transcoder": "jumprelu"}
#: Transcoders with a skip connection ``W_skip`` ``[d_out, d_in]``.
_SKIP = ("skip_transcoder", "jumprelu_skip_transcoder")
#: A host decode multiplies sparse features (CSR) when at most this share (1 / 32) of them
#: is non-zero; denser ones take the dense product (a sparse one is slower there).
_SPARSE_DECODE_SHARE = 32

ARCHITECTURES = ("standard", "jumprelu", "topk", "abstopk", "gated", *TRANSCODERS)
#: Architectures whose features may be negative (ranked by magnitude, active where not 0).
SIGNED = ("abstopk",)
#: Architectures that keep ``k`` features per row; they honour
#: ``rescale_acts_by_decoder_norm`` (as sae-lens' TopK classes do).
_TOPK = RESCALED = ("topk", "abstopk")
#: Architectures a clamp needs whole on every steering rank: a feature depends on the others
#: (TopK, AbsTopK) or on weights an encoder column does not carry (gated's gate).
WHOLE_CLAMP = ("topk", "abstopk", "gated")
#: The tensors only some architectures have.
_OPTIONAL = ("threshold", "b_gate", "r_mag", "W_skip")


@dataclass(eq=False)
class SAE:
    """A sparse autoencoder's weights and what they mean.

    Usually read from files (`load_sae`); made directly from tensors it computes as
    the sae-lens class of its architecture would (see the module's docstring). The fields
    are its attributes as well.

    Args:
        architecture: ``"standard"``, ``"jumprelu"``, ``"topk"``, ``"abstopk"``,
            ``"gated"`` or a transcoder's (``TRANSCODERS``): one of ``ARCHITECTURES``.
        W_enc: the encoder, ``[d_in, d_sae]``; its dtype is the SAE's.
        b_enc: the encoder bias, ``[d_sae]`` (gated: the magnitude path's, ``b_mag``).
        W_dec: the decoder, ``[d_sae, d_in]`` (a transcoder's ``[d_sae, d_out]``): row ``i``
            is feature ``i``'s direction as stored.
        b_dec: the decoder bias, ``[d_in]`` (a transcoder's ``[d_out]``).
        layout: the on-disk layout it was read from (``formats.LAYOUTS``); any label for
            one made by hand.
        threshold: JumpReLU only (required there): ``[d_sae]``; default ``None``.
        k: TopK and AbsTopK only (required there): features kept per row, 1 to
            ``d_sae``; default ``None``.
        b_gate: gated only (required there): the gate's bias, ``[d_sae]``; default ``None``.
        r_mag: gated only (required there): the magnitude path's log-scale per feature,
            ``[d_sae]``; default ``None``.
        apply_b_dec_to_input: subtract ``b_dec`` from rows before encoding (default
            ``True``, as sae-lens; a transcoder's must be ``False``).
        rescale_acts_by_decoder_norm: TopK and AbsTopK (sae-lens): pre-activations are scaled by
            each feature's decoder norm, and features divided by it again before decoding
            (default ``False``).
        hook_name: where it reads, as its files name it (``"blocks.12.hook_resid_post"``),
            if they do; default ``None``.
        point: the vllm-lens tap point it reads (``points.POINTS``), set by
            `load_sae`; default ``None``.
        layer: the layer it reads, set by `load_sae`; default ``None``.
        W_skip: skip transcoders only (required there): ``[d_out, d_in]``; default ``None``.
        hook_name_out: a transcoder's output point as its files name it
            (``"blocks.12.hook_mlp_out"``); default ``None``.
        out_point: the tap point a transcoder predicts (``"mlp_out"``), set by `load_sae`;
            default ``None``.

    Raises:
        ValueError: an architecture not in ``ARCHITECTURES``, a tensor whose shape does not
            fit ``W_enc``'s ``[d_in, d_sae]``, a JumpReLU SAE without ``threshold``, a
            gated one without ``b_gate`` and ``r_mag``, a TopK / AbsTopK SAE without a
            ``k`` from 1 to ``d_sae``, a skip transcoder without ``W_skip``, or a transcoder
            with ``apply_b_dec_to_input``.

    Examples:
        >>> import torch
        >>> from vllm_lens.saes import SAE
        >>> sae = SAE(architecture="topk", W_enc=torch.randn(128, 512), b_enc=torch.zeros(512),
        ...           W_dec=torch.randn(512, 128), b_dec=torch.zeros(128), layout="mine", k=8)
        >>> x = torch.randn(5, 128)                    # 5 rows of a 128-wide hook point
        >>> f = sae.encode(x)
        >>> f.shape, bool(((f > 0).sum(-1) <= 8).all()), sae.decode(f).shape
        (torch.Size([5, 512]), True, torch.Size([5, 128]))
        >>> {name: (tuple(t.shape), t.dtype) for name, t in sae.top_features(x, 4).items()}
        {'indices': ((5, 4), torch.int32), 'values': ((5, 4), torch.float32)}
    """

    architecture: str
    """One of ``ARCHITECTURES``."""
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
    """TopK and AbsTopK only: features kept per row."""
    apply_b_dec_to_input: bool = True
    rescale_acts_by_decoder_norm: bool = False
    """TopK only (sae-lens): pre-activations are scaled by each feature's decoder norm."""
    hook_name: str | None = None
    """Where it reads, as its file names it (``blocks.12.hook_resid_post``), if it does."""
    point: str | None = None
    """The vllm-lens tap point it reads (``points.POINTS``), once resolved (``load_sae``)."""
    layer: int | None = None
    b_gate: torch.Tensor | None = None
    """Gated only: the gate's bias ``[d_sae]``."""
    r_mag: torch.Tensor | None = None
    """Gated only: ``[d_sae]``; the magnitude path's encoder is ``W_enc * exp(r_mag)``."""
    W_skip: torch.Tensor | None = None
    """Skip transcoders only: ``[d_out, d_in]``."""
    hook_name_out: str | None = None
    """A transcoder's output point as its files name it (``blocks.12.hook_mlp_out``)."""
    out_point: str | None = None
    """The tap point a transcoder predicts, once resolved (``load_sae``)."""

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not one of "
                             f"{', '.join(ARCHITECTURES)}")
        d_in, d_sae = self.W_enc.shape
        d_out = int(self.W_dec.shape[-1]) if self.is_transcoder else d_in
        shapes = {"W_enc": (self.W_enc, (d_in, d_sae)), "b_enc": (self.b_enc, (d_sae,)),
                  "W_dec": (self.W_dec, (d_sae, d_out)), "b_dec": (self.b_dec, (d_out,))}
        if self.is_transcoder and self.apply_b_dec_to_input:
            raise ValueError(f"a {self.architecture} does not subtract b_dec (d_out wide) from "
                             "its input: apply_b_dec_to_input must be false")
        if self.architecture in _SKIP:
            if self.W_skip is None:
                raise ValueError(f"a {self.architecture} needs W_skip")
            shapes["W_skip"] = (self.W_skip, (d_out, d_in))
        if self._kind == "jumprelu":
            if self.threshold is None:
                raise ValueError("a jumprelu SAE needs a threshold")
            shapes["threshold"] = (self.threshold, (d_sae,))
        if self.architecture == "gated":
            if self.b_gate is None or self.r_mag is None:
                raise ValueError("a gated SAE needs b_gate and r_mag")
            shapes["b_gate"] = (self.b_gate, (d_sae,))
            shapes["r_mag"] = (self.r_mag, (d_sae,))
        for name, (tensor, shape) in shapes.items():
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}; with W_enc "
                                 f"{tuple(self.W_enc.shape)} it must be {shape}")
        if self.architecture in _TOPK and not (isinstance(self.k, int)
                                               and 1 <= self.k <= d_sae):
            raise ValueError(f"a{'n' if self.architecture[0] == 'a' else ''} "
                             f"{self.architecture} SAE needs k between 1 and d_sae={d_sae}, "
                             f"got {self.k!r}")

    @property
    def is_transcoder(self) -> bool:
        """It predicts another point than it reads (``TRANSCODERS``)."""
        return self.architecture in TRANSCODERS

    @property
    def _kind(self) -> str:
        """The SAE architecture it encodes as (a transcoder's base; else its own)."""
        return TRANSCODERS.get(self.architecture, self.architecture)

    @property
    def d_out(self) -> int:
        """Width of the rows it decodes into: a transcoder's output point's; else ``d_in``."""
        return int(self.W_dec.shape[1])

    @property
    def d_in(self) -> int:
        """Width of the rows it reads (the hook point's row width)."""
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        """Number of features."""
        return int(self.W_enc.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        """Its weights' dtype (rows are encoded in the wider of it and theirs)."""
        return self.W_enc.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of its weights and of the copies its arithmetic made of them (weights cast
        to a wider dtype, reordered encoder and decoder weights: ``prepare``)."""
        weights = sum(t.numel() * t.element_size() for t in (
            self.W_enc, self.b_enc, self.W_dec, self.b_dec,
            *(getattr(self, n) for n in _OPTIONAL if getattr(self, n) is not None)))
        casts = sum(t.numel() * t.element_size() for cast in self.__dict__.get("_cast", {})
                    .values() for t in cast.values() if t is not None)
        products = sum(linear.nbytes for linear in self.__dict__.get("_linear", {}).values())
        return weights + casts + products

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> SAE:
        """The same SAE with its tensors on ``device`` (and in ``dtype``, if given); ``self``
        (with the copies it made) if they are there already.

        Args:
            device: a torch device or its name (``"cuda:0"``, ``"cpu"``).
            dtype: a floating dtype for every tensor; default ``None``: each keeps its own.

        Returns:
            ``self``, or a new ``SAE`` (``dataclasses.replace``: the other fields the same,
            none of the copies the arithmetic made).
        """
        names = ("W_enc", "b_enc", "W_dec", "b_dec",
                 *(n for n in _OPTIONAL if getattr(self, n) is not None))
        move = {name: getattr(self, name).to(device, dtype) for name in names}
        if all(move[name] is getattr(self, name) for name in names):
            return self
        return dataclasses.replace(self, **move)

    def __getstate__(self) -> dict:
        """Its fields, without the copies its arithmetic made (a reordered oneDNN weight
        cannot be pickled; they are made again when needed)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_cast", "_linear")}

    # -- arithmetic ---------------------------------------------------------------------------
    def _weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The weights in ``dtype``: its own, or a copy made once (rows wider than the SAE)."""
        names = ("W_enc", "b_enc", "W_dec", "b_dec", *_OPTIONAL)
        if dtype == self.dtype:
            return {n: getattr(self, n) for n in names}
        cache = self.__dict__.setdefault("_cast", {})
        if dtype not in cache:
            cache[dtype] = {n: None if getattr(self, n) is None else getattr(self, n).to(dtype)
                            for n in names}
        return cache[dtype]

    def _product(self, part: str, dtype: torch.dtype) -> Linear:
        """The encoder's (``part="enc"``), decoder's (``"dec"``) or a skip transcoder's skip
        connection's (``"skip"``: ``x @ W_skip.T``) ``x @ W + b`` in ``dtype``, made once (a
        gated SAE's encoder has no bias here: its gate and magnitude add their own to the one
        product, ``_gated``)."""
        cache = self.__dict__.setdefault("_linear", {})
        if (part, dtype) not in cache:
            w = self._weights(dtype)
            if part == "skip":
                weight = w["W_skip"].t()
                cache[part, dtype] = Linear(weight, weight.new_zeros(weight.shape[1]))
                return cache[part, dtype]
            bias = (torch.zeros_like(w["b_enc"]) if part == "enc" and self.architecture == "gated"
                    else w[f"b_{part}"])
            cache[part, dtype] = Linear(w[f"W_{part}"], bias)
        return cache[part, dtype]

    def prepare(self, dtype: torch.dtype | None = None) -> None:
        """Make what encoding rows of ``dtype`` (default: its own) computes with now, not at
        the first row: the weights cast wider if needed, and on the host oneDNN's reordered
        copy of ``W_enc`` (``linear``; ~25 ms and ``W_enc``'s size again for a 576 x 9216
        encoder). The decoder's copy is made at the first ``decode``.

        Args:
            dtype: the dtype of the rows that will be encoded; default ``None``: the SAE's
                own. The copies are made for the wider of the two.
        """
        self._product("enc", torch.promote_types(self.dtype, dtype or self.dtype))

    def compute_dtype(self, rows: torch.Tensor) -> torch.dtype:
        """The wider of the SAE's and the rows' dtypes.

        Args:
            rows: the rows to be encoded (only their dtype is read).

        Returns:
            ``torch.promote_types`` of the two: what `encode` computes and returns
            in.
        """
        return torch.promote_types(self.dtype, rows.dtype)

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """``h`` for rows ``x`` ``[n, d_in]`` (before the activation function).

        Args:
            x: rows ``[n, d_in]`` on the SAE's device, any floating dtype.

        Returns:
            ``(x - b_dec) @ W_enc + b_enc`` (without ``- b_dec`` unless
            ``apply_b_dec_to_input``; times each feature's decoder norm for a TopK or AbsTopK
            SAE with ``rescale_acts_by_decoder_norm``; a gated SAE's magnitude path
            ``g * exp(r_mag) + b_mag``), ``[n, d_sae]`` in `compute_dtype`.

        Raises:
            RuntimeError: ``x``'s last dimension is not ``d_in`` (torch's error).
        """
        dtype = self.compute_dtype(x)
        w = self._weights(dtype)
        x = x.to(dtype)
        if self.apply_b_dec_to_input:
            x = x - w["b_dec"]
        h = self._product("enc", dtype)(x)
        if self.architecture == "gated":
            return self._gated(h, w)[1]
        if self.architecture in _TOPK and self.rescale_acts_by_decoder_norm:
            h = h * w["W_dec"].norm(dim=-1)
        return h

    @staticmethod
    def _gated(g: torch.Tensor, w: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A gated SAE's gate and magnitude pre-activations from ``g = x' @ W_enc``."""
        return g + w["b_gate"], g * w["r_mag"].exp() + w["b_enc"]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations ``[n, d_sae]`` of rows ``x`` ``[n, d_in]``.

        Args:
            x: rows ``[n, d_in]`` on the SAE's device, any floating dtype.

        Returns:
            ``[n, d_sae]`` in `compute_dtype`, dense: ``relu(h)`` (standard),
            ``relu(h)`` where ``h > threshold`` else 0 (jumprelu), the ``k`` largest of
            ``h`` ReLU'd and 0 elsewhere (topk), the ``k`` largest in magnitude, signed
            (abstopk), or ``relu(h)`` where the gate's pre-activation is above 0 (gated).

        Raises:
            RuntimeError: ``x``'s last dimension is not ``d_in`` (torch's error).
        """
        if self.architecture == "gated":
            dtype = self.compute_dtype(x)
            w = self._weights(dtype)
            x = x.to(dtype)
            if self.apply_b_dec_to_input:
                x = x - w["b_dec"]
            gate, magnitude = self._gated(self._product("enc", dtype)(x), w)
            return magnitude.relu() * (gate > 0).to(dtype)
        h = self.pre_activations(x)
        if self._kind == "standard":
            return h.relu()
        if self._kind == "jumprelu":
            threshold = self.threshold.to(h.dtype)  # type: ignore[union-attr]
            # ``h > threshold`` written as 1.0 / 0.0 straight into h's dtype: the product of
            # the bool mask cast to it, without the cast (on CPU the cast alone outlasted the
            # comparison, ReLU and product together). The mask carries no gradient: compared
            # detached (an ``out=`` op refuses autograd inputs).
            above = torch.gt(h.detach(), threshold.detach(), out=torch.empty_like(h.detach()))
            features = h.relu()
            return features * above if features.requires_grad else features.mul_(above)
        if self.architecture == "abstopk":
            indices = torch.topk(h.abs(), k=self.k, dim=-1, sorted=False).indices  # type: ignore[arg-type]
            return torch.zeros_like(h).scatter_(-1, indices, h.gather(-1, indices))
        values, indices = torch.topk(h, k=self.k, dim=-1, sorted=False)  # type: ignore[arg-type]
        return torch.zeros_like(h).scatter_(-1, indices, values.relu())

    def decode(self, features: torch.Tensor) -> torch.Tensor:
        """Rows ``[n, d_out]`` (an SAE's ``d_out`` is ``d_in``) decoded from feature
        activations ``[n, d_sae]``.

        Args:
            features: feature activations ``[n, d_sae]`` (e.g. `encode`'s, edited).

        Returns:
            ``features @ W_dec + b_dec`` (a TopK or AbsTopK SAE with
            ``rescale_acts_by_decoder_norm`` first divides each feature by its decoder norm), ``[n, d_in]`` in the wider of
            the SAE's and ``features``' dtypes.

        Raises:
            RuntimeError: ``features``' last dimension is not ``d_sae`` (torch's error).
        """
        dtype = torch.promote_types(self.dtype, features.dtype)
        f = features.to(dtype)
        if self.architecture in _TOPK and self.rescale_acts_by_decoder_norm:
            f = f / self._weights(dtype)["W_dec"].norm(dim=-1)
        if (f.device.type == "cpu" and f.dim() == 2 and f.shape[0] and not f.requires_grad
                and dtype in (torch.float32, torch.float64)
                and int(torch.count_nonzero(f)) * _SPARSE_DECODE_SHARE <= f.numel()):
            # A trained dictionary's few dozen active features per row: a sparse product
            # reads only their decoder rows (on the host, where counting them does not stall
            # a queue; 128 rows of 64 active among 9,216 decode 2.4x faster than dense).
            w = self._weights(dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "sparse CSR ... beta"
                return torch.addmm(w["b_dec"], f.to_sparse_csr(), w["W_dec"])
        return self._product("dec", dtype)(f)

    def directions(self, indices: torch.Tensor) -> torch.Tensor:
        """What one unit of each feature in ``indices`` adds to the point it writes (its
        decoder row; divided by its norm for a TopK or AbsTopK SAE with
        ``rescale_acts_by_decoder_norm``, as `decode` divides the feature): float32
        ``[*indices.shape, d_out]`` on the SAE's device. Indices below 0 (padding) give zero
        rows.

        Args:
            indices: feature indices, any integer dtype and shape.
        """
        w = self._weights(self.dtype)["W_dec"]
        flat = indices.reshape(-1).long()
        rows = w.index_select(0, flat.clamp(min=0)).float()
        if self.architecture in _TOPK and self.rescale_acts_by_decoder_norm:
            rows = rows / rows.norm(dim=-1, keepdim=True)
        rows = rows.masked_fill((flat < 0)[:, None], 0.0)
        return rows.reshape(*indices.shape, w.shape[1])

    def skip(self, x: torch.Tensor) -> torch.Tensor | None:
        """A skip transcoder's skip connection.

        Args:
            x: rows ``[n, d_in]`` on its device, any floating dtype.

        Returns:
            ``x @ W_skip.T`` ``[n, d_out]`` in `compute_dtype`; ``None`` for every other
            architecture.
        """
        if self.architecture not in _SKIP:
            return None
        dtype = self.compute_dtype(x)
        return self._product("skip", dtype)(x.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """What it predicts from rows ``x`` (sae-lens' ``forward``).

        Args:
            x: rows ``[n, d_in]`` on its device, any floating dtype.

        Returns:
            ``decode(encode(x))``, plus a skip transcoder's ``x @ W_skip.T``: ``[n, d_out]``
            in `compute_dtype` (an SAE's reconstruction of ``x``).
        """
        return self.predict(x, self.encode(x))

    def predict(self, x: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """`forward` from features already encoded, perhaps edited.

        Args:
            x: the rows ``[n, d_in]`` the features were encoded from (a skip transcoder's
                skip connection reads them).
            features: feature activations ``[n, d_sae]``.

        Returns:
            ``decode(features)`` plus a skip transcoder's ``x @ W_skip.T``, ``[n, d_out]``.
        """
        out = self.decode(features)
        skip = self.skip(x)
        return out if skip is None else out + skip

    def top_features(self, x: torch.Tensor, top_k: int, *, reconstruction: bool = False,
                     target: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Per row of ``x`` ``[n, d_in]``, its ``top_k`` largest feature activations (an
        AbsTopK SAE's: largest in magnitude, with their signs).

        Returns ``{"indices": int32 [n, top_k], "values": float32 [n, top_k]}``, descending
        (in magnitude for AbsTopK), padded with index -1 and value 0 where fewer than
        ``top_k`` features are active (non-zero); with ``reconstruction`` also ``"nmse"``
        float32 ``[n]`` (``|x - x_hat|^2 / |x|^2``; a transcoder's ``|y - y_hat|^2 / |y|^2``
        of its prediction against ``target`` ``y``) and ``"l0"`` int32 ``[n]`` (active
        features, before ``top_k``).

        This is what a request's ``output_sae_features`` returns per position.

        Args:
            x: rows ``[n, d_in]`` on the SAE's device, any floating dtype.
            top_k: features kept per row, 1 to ``d_sae``.
            reconstruction: also compute ``"nmse"`` and ``"l0"`` (default ``False``).
            target: a transcoder's reconstruction target ``[n, d_out]``, the rows of the
                point it predicts (required for a transcoder's ``reconstruction``).

        Returns:
            ``{"indices", "values"}`` (and ``"nmse"``, ``"l0"``), as above, on ``x``'s
            device.

        Raises:
            ValueError: ``top_k`` is not between 1 and ``d_sae``, or a transcoder's
                reconstruction without a ``target``.
            RuntimeError: ``x``'s last dimension is not ``d_in`` (torch's error).
        """
        if not 1 <= top_k <= self.d_sae:
            raise ValueError(f"top_k must be between 1 and d_sae={self.d_sae}, got {top_k}")
        if reconstruction and self.is_transcoder and target is None:
            raise ValueError(f"a {self.architecture}'s reconstruction is of the point it "
                             "predicts: pass its rows as target")
        features = self.encode(x)
        if self.architecture in SIGNED:
            indices = torch.topk(features.abs(), k=top_k, dim=-1, sorted=True).indices
            values = features.gather(-1, indices)
            active = values != 0
        else:
            values, indices = torch.topk(features, k=top_k, dim=-1, sorted=True)
            active = values > 0
        out = {"indices": torch.where(active, indices, -1).to(torch.int32),
               "values": torch.where(active, values, 0).to(torch.float32)}
        if reconstruction:
            if self.is_transcoder:
                assert target is not None  # (checked above)
                rows, predicted = target.to(features.dtype), self.predict(x, features)
            else:
                rows = x.to(features.dtype)
                predicted = self.decode(features)
            error = (rows - predicted).pow(2).sum(-1)
            out["nmse"] = (error / rows.pow(2).sum(-1)).to(torch.float32)
            out["l0"] = (features != 0).sum(-1).to(torch.int32)
        return out
