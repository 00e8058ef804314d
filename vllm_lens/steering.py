"""``SteeringVector``: what a user adds to (or writes into) the residual stream (runs in: caller,
front end).

A steering vector is a pydantic model so that it validates itself on construction and
round-trips through JSON (``model_dump(mode="json")`` / ``model_validate``) and through the
compact wire string (``to_wire`` / ``from_wire``, msgpack + zstd in base64) that the HTTP API
carries in ``vllm_xargs``.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, field_serializer, field_validator, model_validator

from vllm_lens.common import wire
from vllm_lens.errors import WireError

__all__ = ["EMBED_POINT", "STEERING_DTYPES", "SteeringCondition", "SteeringVector"]

#: Floating dtypes a steering tensor may have; it is cast to the model dtype on the worker.
STEERING_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: ``hook_point`` of the token embeddings (the stream entering layer 0), with
#: ``layer_indices=[-1]``.
EMBED_POINT = "embed"


def _as_tensor(value: Any, what: str) -> Any:
    """A tensor from a tensor, numpy array or JSON tensor record; float64 becomes float32."""
    if isinstance(value, dict):
        value = wire.tensor_from_json(value)
    elif isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    elif isinstance(value, (list, tuple)):
        try:
            value = torch.tensor(value, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{what} must be a list of floats ({exc})") from None
    elif not isinstance(value, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, numpy array or list of floats, got "
                         f"{type(value).__name__}")
    if value.dtype == torch.float64:
        value = value.to(torch.float32)
    return value


class SteeringCondition(BaseModel):
    """Steering gated by the model's own activations: at each token the vector's scale is
    ``scale * sigmoid(sharpness * (h · probe - threshold))``, with ``h`` the stream at
    (``layer``, ``point``) earlier in the same forward pass (before any steering there).

    Set it as a ``SteeringVector``'s ``condition``; every field is a keyword argument.

    Keyword Args:
        probe (torch.Tensor | numpy.ndarray | list | dict): ``(hidden,)``, float32, float16
            or bfloat16 (float64 is cast to float32), finite: the direction read.
        layer (int): the layer read, at or before every steered layer.
        point (str): the tap point read at ``layer`` (default ``"resid_post"``).
        threshold (float): the value of ``h · probe`` where the gate is one half (default
            ``0.0``; finite).
        sharpness (float): how steeply the gate opens around ``threshold`` (default
            ``1.0``; finite).

    Raises:
        pydantic.ValidationError: (a ``ValueError``) a field breaks one of the rules above;
            whether ``layer`` and ``point`` come early enough is checked when the request
            is sent (``LensRequestError``).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True, extra="forbid")

    probe: torch.Tensor
    """``(hidden,)``: the direction read."""
    layer: int
    """At or before every steered layer (and at the same layer, a point the layer reaches
    no later than the steered one)."""
    point: str = "resid_post"
    threshold: float = 0.0
    sharpness: float = 1.0

    @field_validator("probe", mode="before")
    @classmethod
    def _probe_tensor(cls, value: Any) -> Any:
        return _as_tensor(value, "condition.probe")

    @field_serializer("probe", when_used="json")
    def _probe_to_json(self, value: torch.Tensor) -> dict[str, Any]:
        return wire.tensor_to_json(value)

    @model_validator(mode="after")
    def _check(self) -> SteeringCondition:
        if self.probe.dim() != 1 or self.probe.dtype not in STEERING_DTYPES:
            raise ValueError(f"condition.probe must be a 1D float tensor (hidden,), got shape "
                             f"{tuple(self.probe.shape)} and dtype {self.probe.dtype}")
        if not torch.isfinite(self.probe).all():
            raise ValueError("condition.probe contains NaN or inf")
        if not (math.isfinite(self.threshold) and math.isfinite(self.sharpness)):
            raise ValueError("condition.threshold and condition.sharpness must be finite")
        return self


class SteeringVector(BaseModel):
    """Vectors added to the residual stream after the listed decoder layers (or, with
    ``mode="replace"``, written over it).

    Pass a list of them as ``extra_args["apply_steering_vectors"]`` (offline), or their wire
    strings (``to_wire``) or JSON dicts (``model_dump(mode="json")``) over HTTP. The
    vector validates itself here; what depends on the model (hidden size, layer range,
    context length) is checked when the request is sent, and a misfit raises
    ``LensRequestError`` naming ``apply_steering_vectors[i]``.

    Activation patching, where position 5 after layer 3 becomes a clean run's row:

        SteeringVector(activations=clean[3, 5][None, None], layer_indices=[3],
                       position_indices=[5], mode="replace")

    Every field is a keyword argument of the constructor (a pydantic model):

    Keyword Args:
        activations (torch.Tensor | numpy.ndarray | dict): a tensor, numpy array or JSON
            tensor record, float32, float16 or bfloat16 (float64 is cast to float32),
            finite: ``(n_layers, hidden)`` or ``(n_layers, n_positions, hidden)`` (see the
            attribute below).
        layer_indices (list[int]): one decoder layer per row of ``activations``, distinct;
            ``[-1]`` alone addresses the token embeddings.
        scale (float): multiplies every vector (default ``1.0``; must be finite, and
            ``1.0`` with ``mode="replace"``).
        norm_match (bool): scale relative to the stream's norm (default ``False``; needs
            non-zero rows).
        position_indices (list[int] | None): with 3D activations, the distinct
            non-negative absolute position of each row (default ``None``: ``0 ..
            n_positions - 1``).
        hook_point (str): the tap point steered (default ``"resid_post"``).
        mode (str): ``"add"`` (default) or ``"replace"``.
        phase (str): ``"all"`` (default), ``"prefill"`` or ``"decode"``.
        condition (SteeringCondition | None): gates an ``"add"`` without ``norm_match``
            (default ``None``).

    Raises:
        pydantic.ValidationError: (a ``ValueError``) on construction, when a field breaks
            one of the rules above, or an unknown field is given; the message names it.

    Examples:
        >>> import torch
        >>> from vllm import SamplingParams
        >>> from vllm_lens import SteeringVector
        >>> sv = SteeringVector(activations=torch.randn(1, 128), layer_indices=[2], scale=4.0)
        >>> sp = SamplingParams(max_tokens=3, ignore_eos=True,
        ...                     extra_args={"apply_steering_vectors": [sv]})
        >>> len(llm.generate(["Hello"], sp)[0].outputs[0].token_ids)
        3
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True, extra="forbid")

    activations: torch.Tensor
    """``(n_layers, hidden)``: added at every position; or ``(n_layers, n_positions, hidden)``:
    row ``j`` added at absolute position ``position_indices[j]``. Cast to the model dtype on
    the worker."""
    layer_indices: list[int]
    """Decoder layer after which each ``activations[i]`` is added; ``[-1]`` addresses the token
    embeddings: the stream entering layer 0 (also ``hook_point="embed"``), i.e. layer 0's
    ``resid_pre``, which includes what the model adds before its first layer (position
    embeddings in GPT-2-style models, Gemma's embedding scale)."""
    scale: float = 1.0
    """Multiplies every vector before it is added."""
    norm_match: bool = False
    """Add ``scale * ||h|| * v / ||v||`` instead of ``scale * v`` (``h``: the residual stream at
    that token and layer), so the push is relative to the stream's size."""
    position_indices: list[int] | None = None
    """Absolute token positions for 3D activations (default ``0 .. n_positions - 1``)."""
    hook_point: str = "resid_post"
    """The tap point the vectors are added at: ``resid_pre``, ``attn_out``, ``resid_mid``,
    ``mlp_out`` or ``resid_post`` (``vllm_lens.common.points``), or ``embed`` (with
    ``layer_indices=[-1]``); ``norm_match`` measures the signal at that point."""
    mode: Literal["add", "replace"] = "add"
    """``add``: the stream gets ``scale * v`` added; ``replace``: the stream at those layers,
    point and positions *becomes* ``v`` (activation patching; ``scale`` 1, no
    ``norm_match``). Replacements at a site run before additions there."""
    phase: Literal["all", "prefill", "decode"] = "all"
    """Which positions are steered: all of them, the prompt's (``prefill``), or the generated
    ones (``decode``, which keeps the prompt's prefix-cache blocks shared with unsteered
    requests). The first generated token is sampled from the last prompt position, so
    ``decode`` steering changes tokens from the second one on."""
    condition: SteeringCondition | None = None
    """Gate the addition per token by the model's own activations (``SteeringCondition``);
    the gate values come back as ``steering_gates``."""

    @field_validator("activations", mode="before")
    @classmethod
    def _tensor_from_input(cls, value: Any) -> Any:
        """Accept a tensor, a numpy array or a JSON tensor record; float64 becomes float32
        (documented)."""
        if not isinstance(value, (dict, np.ndarray, torch.Tensor)):
            raise ValueError(
                f"activations must be a torch.Tensor or numpy array of shape (n_layers, hidden) "
                f"or (n_layers, n_positions, hidden), got {type(value).__name__}; e.g. "
                "torch.tensor(values, dtype=torch.float32)")
        return _as_tensor(value, "activations")

    @field_validator("layer_indices", "position_indices", mode="before")
    @classmethod
    def _plain_ints(cls, value: Any) -> Any:
        """numpy integers (and integer arrays) count as ints."""
        if isinstance(value, (np.ndarray, torch.Tensor)):
            value = value.tolist()
        if isinstance(value, (list, tuple)):
            return [int(v) if isinstance(v, np.integer) else v for v in value]
        return value

    @field_serializer("activations", when_used="json")
    def _tensor_to_json(self, value: torch.Tensor) -> dict[str, Any]:
        return wire.tensor_to_json(value)

    @model_validator(mode="after")
    def _check(self) -> SteeringVector:
        acts = self.activations
        if not isinstance(acts, torch.Tensor):
            raise ValueError(f"activations must be a torch.Tensor, got {type(acts).__name__}")
        if acts.dtype not in STEERING_DTYPES:
            raise ValueError(
                f"activations must be float32, float16 or bfloat16 (float64 is cast to "
                f"float32), got {acts.dtype}; e.g. activations.float()")
        if acts.dim() not in (2, 3):
            raise ValueError(
                f"activations must be 2D (n_layers, hidden) or 3D (n_layers, n_positions, "
                f"hidden), got shape {tuple(acts.shape)}")
        if acts.shape[0] != len(self.layer_indices):
            raise ValueError(
                f"activations.shape[0] is {acts.shape[0]} but len(layer_indices) is "
                f"{len(self.layer_indices)}")
        if not self.layer_indices:
            raise ValueError("layer_indices is empty")
        if (-1 in self.layer_indices or self.hook_point == EMBED_POINT) and (
                self.layer_indices != [-1] or self.hook_point not in ("resid_post", EMBED_POINT)):
            raise ValueError(
                "the token embeddings are addressed alone: layer_indices=[-1] with "
                f"hook_point 'embed' or 'resid_post' (got layer_indices {self.layer_indices}, "
                f"hook_point {self.hook_point!r}); put other layers in another SteeringVector")
        if self.condition is not None and (self.mode == "replace" or self.norm_match):
            raise ValueError("a condition gates a plain addition: mode='replace' and "
                             "norm_match=True take none")
        if self.mode == "replace" and (self.norm_match or self.scale != 1.0):
            raise ValueError(
                "mode='replace' writes the vector itself: scale must be 1.0 and norm_match "
                f"False (got scale={self.scale}, norm_match={self.norm_match}); scale the "
                "vector before sending it")
        if len(set(self.layer_indices)) != len(self.layer_indices):
            raise ValueError(
                f"layer_indices {self.layer_indices} has duplicates; sum the rows for a layer "
                "into one, or pass several SteeringVector objects")
        if not torch.isfinite(acts).all():
            raise ValueError("activations contain NaN or inf")
        if self.norm_match and (acts.float().norm(dim=-1) == 0).any():
            raise ValueError("norm_match needs non-zero vectors (a zero row has no direction)")
        if not math.isfinite(self.scale):
            raise ValueError(f"scale must be finite, got {self.scale}")
        if self.position_indices is not None:
            if acts.dim() != 3:
                raise ValueError("position_indices is only meaningful with 3D activations")
            if len(self.position_indices) != acts.shape[1]:
                raise ValueError(
                    f"len(position_indices) is {len(self.position_indices)} but activations "
                    f"have {acts.shape[1]} positions")
            if any(p < 0 for p in self.position_indices):
                raise ValueError("position_indices must be non-negative")
            if len(set(self.position_indices)) != len(self.position_indices):
                raise ValueError("position_indices contains duplicates")
        return self

    @property
    def positions(self) -> list[int] | None:
        """Absolute positions of 3D rows (``None`` for 2D vectors, which apply everywhere).

        Returns:
            ``position_indices`` if given, else ``[0, 1, ..., n_positions - 1]``, for 3D
            activations; ``None`` for 2D ones.
        """
        if self.activations.dim() == 2:
            return None
        return self.position_indices or list(range(self.activations.shape[1]))

    def to_wire(self) -> str:
        """Compact ASCII form: base64 of msgpack + zstd (what ``vllm_xargs`` can carry).

        Returns:
            An ASCII string holding every field, the tensor in its own dtype; an
            ``apply_steering_vectors`` item over HTTP, read back by ``from_wire``.
        """
        fields = self.model_dump(exclude={"activations"})
        return base64.b64encode(wire.dumps({**fields, "activations": self.activations})).decode()

    @classmethod
    def from_wire(cls, text: str) -> SteeringVector:
        """Inverse of ``to_wire``; undecodable input raises ``WireError``.

        Args:
            text: a ``to_wire`` string.

        Returns:
            The ``SteeringVector`` it holds, validated again.

        Raises:
            WireError: ``text`` is not base64, not a valid compressed msgpack payload, or
                does not hold a map of fields.
            pydantic.ValidationError: the fields decode but do not make a valid vector.
        """
        try:
            blob = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError, TypeError):
            raise WireError("steering vector wire string is not valid base64") from None
        fields = wire.loads(blob)
        if not isinstance(fields, dict):
            raise WireError("steering vector wire string does not hold a vector")
        return cls.model_validate(fields)
