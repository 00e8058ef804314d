"""``SteeringVector``: what a user adds to (or writes into) the residual stream (runs in: caller,
front end).

A steering vector is a pydantic model so that it validates itself on construction and
round-trips through JSON (``model_dump(mode="json")`` / ``model_validate``) and through the
compact wire string (``to_wire`` / ``from_wire``, msgpack + zstd in base64) that the HTTP API
carries in ``vllm_xargs``.

The module is one public class and runs a little past 450 lines: most of it is the fields'
documentation and the validators that name a bad field (``mode``, ``cap``, ``positions``,
``phase``...), which users read in the API reference.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any, Literal

import numpy as np
import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from vllm_lens.common import wire
from vllm_lens.errors import WireError

__all__ = ["ABLATION_POINTS", "EMBED_POINT", "STEERING_DTYPES", "SteeringCondition",
           "SteeringVector"]

#: Floating dtypes a steering tensor may have; it is cast to the model dtype on the worker.
STEERING_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: ``hook_point`` of the token embeddings (the stream entering layer 0), with
#: ``layer_indices=[-1]``.
EMBED_POINT = "embed"
#: The points ``SteeringVector.ablation`` ablates at every layer it names (Arditi et al.'s
#: recipe): the stream entering each layer and what attention and the MLP add to it.
ABLATION_POINTS = ("resid_pre", "attn_out", "mlp_out")
#: ``layer_indices`` of a vector steering every decoder layer with its one row.
ALL_LAYERS = "all"


class _FieldError(ValueError):
    """A rule that involves several fields, broken: ``field`` is the one to fix (the front
    end names it, ``apply_steering_vectors[i].<field>``, in its ``LensRequestError``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


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
    ``mode="replace"``, written over it; with ``mode="ablate"`` or ``mode="cap"``, the
    directions whose component is removed or bounded).

    Pass a list of them as ``extra_args["apply_steering_vectors"]`` (offline), or their wire
    strings (``to_wire``) or JSON dicts (``model_dump(mode="json")``) over HTTP. The
    vector validates itself here; what depends on the model (hidden size, layer range,
    context length) is checked when the request is sent, and a misfit raises
    ``LensRequestError`` naming ``apply_steering_vectors[i]``.

    Activation patching, where position 5 after layer 3 becomes a clean run's row:

        SteeringVector(activations=clean[3, 5][None, None], layer_indices=[3],
                       position_indices=[5], mode="replace")

    Directional ablation (the component along ``direction`` removed at every layer,
    everywhere the stream is written: ``ablation``), and a cap on the projection onto it
    after layer 10:

        SteeringVector.ablation(direction)
        SteeringVector(activations=direction[None], layer_indices=[10], mode="cap",
                       cap=(None, 4.0))

    Every field is a keyword argument of the constructor (a pydantic model):

    Keyword Args:
        activations (torch.Tensor | numpy.ndarray | dict): a tensor, numpy array or JSON
            tensor record, float32, float16 or bfloat16 (float64 is cast to float32),
            finite: ``(n_layers, hidden)`` or ``(n_layers, n_positions, hidden)`` (see the
            attribute below).
        layer_indices (list[int] | str): one decoder layer per row of ``activations``,
            distinct; ``[-1]`` alone addresses the token embeddings; ``"all"``: every
            decoder layer, with one row (``activations`` ``(1, hidden)`` or ``(1, n_positions,
            hidden)``) used at each.
        scale (float): multiplies every vector (default ``1.0``; must be finite, and
            ``1.0`` with ``mode`` ``"replace"``, ``"ablate"`` or ``"cap"``).
        norm_match (bool): scale relative to the stream's norm (default ``False``; needs
            non-zero rows; only with ``mode="add"``).
        position_indices (list[int] | None): with 3D activations, the distinct
            non-negative absolute position of each row (default ``None``: ``0 ..
            n_positions - 1``).
        hook_point (str): the tap point steered (default ``"resid_post"``).
        mode (str): ``"add"`` (default), ``"replace"``, ``"ablate"`` or ``"cap"``.
        phase (str): ``"all"`` (default), ``"prefill"`` or ``"decode"``.
        condition (SteeringCondition | None): gates an ``"add"`` without ``norm_match``
            (default ``None``).
        cap (tuple[float | None, float | None] | None): ``(lower, upper)`` for
            ``mode="cap"`` (and only then): finite, ``lower <= upper``, at most one
            ``None`` (no bound on that side).

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
    layer_indices: list[int] | Literal["all"]
    """Decoder layer after which each ``activations[i]`` is added; ``[-1]`` addresses the token
    embeddings: the stream entering layer 0 (also ``hook_point="embed"``), i.e. layer 0's
    ``resid_pre``, which includes what the model adds before its first layer (position
    embeddings in GPT-2-style models, Gemma's embedding scale). ``"all"``: every decoder
    layer of the served model (``0 .. n_layers - 1``) at ``hook_point``, each with the one
    row of ``activations``."""
    scale: float = 1.0
    """Multiplies every vector before it is added."""
    norm_match: bool = False
    """Add ``scale * ||h|| * v / ||v||`` instead of ``scale * v`` (``h``: the residual stream at
    that token and layer), so the push is relative to the stream's size."""
    position_indices: list[int] | None = None
    """Absolute token positions for 3D activations (default ``0 .. n_positions - 1``)."""
    hook_point: str = "resid_post"
    """The tap point the vectors are added at: ``resid_pre``, ``attn_out``, ``resid_mid``,
    ``attn_in`` and ``mlp_in`` (what attention and the MLP read, where the model has them), ``mlp_out`` or ``resid_post`` (``vllm_lens.common.points``), or ``embed`` (with
    ``layer_indices=[-1]``); ``norm_match`` measures the signal at that point."""
    mode: Literal["add", "replace", "ablate", "cap"] = "add"
    """``add``: the stream gets ``scale * v`` added; ``replace``: the stream at those layers,
    point and positions *becomes* ``v`` (activation patching; ``scale`` 1, no
    ``norm_match``). Replacements at a site run before additions there. ``ablate``: the
    component along ``r = v / ||v||`` is removed, ``x <- x - (x . r) r``; ``cap``: the
    projection ``x . r`` is clamped into ``cap``, ``x <- x + (clamp(x . r) - x . r) r``, the
    part orthogonal to ``r`` untouched (both: ``scale`` 1, no ``norm_match``, no
    ``condition``; ``r`` taken in float32 on the worker). They run after every other
    steering at their site."""
    phase: Literal["all", "prefill", "decode"] = "all"
    """Which positions are steered: all of them, the prompt's (``prefill``), or the generated
    ones (``decode``, which keeps the prompt's prefix-cache blocks shared with unsteered
    requests). The first generated token is sampled from the last prompt position, so
    ``decode`` steering changes tokens from the second one on."""
    condition: SteeringCondition | None = None
    """Gate the addition per token by the model's own activations (``SteeringCondition``);
    the gate values come back as ``steering_gates``."""
    cap: tuple[float | None, float | None] | None = Field(default=None, validate_default=True)
    """``(lower, upper)``: the interval ``mode="cap"`` keeps each projection in; ``None`` on
    one side leaves that side open."""

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
    def _plain_ints(cls, value: Any, info: ValidationInfo) -> Any:
        """numpy integers (and integer arrays) count as ints; ``layer_indices`` may also be
        ``"all"``."""
        if isinstance(value, str) and not (info.field_name == "layer_indices"
                                           and value == ALL_LAYERS):
            what = "a list of ints or 'all'" if info.field_name == "layer_indices" else \
                "a list of ints"
            raise ValueError(f"{info.field_name} must be {what}, got {value!r}")
        if isinstance(value, (np.ndarray, torch.Tensor)):
            value = value.tolist()
        if isinstance(value, (list, tuple)):
            return [int(v) if isinstance(v, np.integer) else v for v in value]
        return value

    @field_validator("cap")
    @classmethod
    def _cap_bounds(cls, value: Any, info: ValidationInfo) -> Any:
        """``cap`` goes with ``mode="cap"`` (and it with ``cap``): finite, ordered bounds, at
        least one of them."""
        mode = info.data.get("mode")
        if value is None:
            if mode == "cap":
                raise ValueError("mode='cap' needs cap=(lower, upper) (either may be None, "
                                 "not both)")
            return value
        if mode != "cap":
            raise ValueError(f"cap is only meaningful with mode='cap' (got mode={mode!r})")
        lower, upper = value
        if lower is None and upper is None:
            raise ValueError("cap=(None, None) bounds nothing; give a lower or an upper bound "
                             "(or use mode='ablate' to remove the component)")
        if any(b is not None and not math.isfinite(b) for b in value):
            raise ValueError(f"cap bounds must be finite or None, got {value}")
        if lower is not None and upper is not None and lower > upper:
            raise ValueError(f"cap lower bound {lower} is above the upper bound {upper}")
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
        every_layer = self.layer_indices == ALL_LAYERS
        if every_layer and acts.shape[0] != 1:
            raise _FieldError("activations", (
                f"layer_indices='all' uses one row at every layer, but activations.shape[0] "
                f"is {acts.shape[0]}; pass activations[:1], or list the layers"))
        if not every_layer and acts.shape[0] != len(self.layer_indices):
            raise ValueError(
                f"activations.shape[0] is {acts.shape[0]} but len(layer_indices) is "
                f"{len(self.layer_indices)}")
        if not self.layer_indices:
            raise ValueError("layer_indices is empty")
        layers = [] if every_layer else self.layer_indices
        if (-1 in layers or self.hook_point == EMBED_POINT) and (
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
        if len(set(layers)) != len(layers):
            raise ValueError(
                f"layer_indices {self.layer_indices} has duplicates; sum the rows for a layer "
                "into one, or pass several SteeringVector objects")
        if not torch.isfinite(acts).all():
            raise ValueError("activations contain NaN or inf")
        if self.norm_match and (acts.float().norm(dim=-1) == 0).any():
            raise ValueError("norm_match needs non-zero vectors (a zero row has no direction)")
        if not math.isfinite(self.scale):
            raise ValueError(f"scale must be finite, got {self.scale}")
        if self.mode in ("ablate", "cap"):
            self._check_projection()
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

    def _check_projection(self) -> None:
        """``ablate`` and ``cap`` take a direction per row and nothing that scales it."""
        what = f"mode={self.mode!r} projects onto each row's direction"
        if self.scale != 1.0:
            raise _FieldError("scale", f"{what}, so it takes no scale (got scale="
                              f"{self.scale})")
        if self.norm_match:
            raise _FieldError("norm_match", f"{what}, so it takes no norm_match")
        if self.condition is not None:
            raise _FieldError("condition", f"{what}; a condition gates mode='add' only")
        norms = self.activations.float().norm(dim=-1)
        if not torch.isfinite(norms).all() or (norms == 0).any():
            raise _FieldError("activations", f"{what}, but a row has no direction (its norm "
                              "is zero, or too large for float32)")

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

    @classmethod
    def ablation(cls, direction: Any, layers: list[int] | str = ALL_LAYERS, *,
                 points: tuple[str, ...] = ABLATION_POINTS,
                 phase: Literal["all", "prefill", "decode"] = "all") -> list[SteeringVector]:
        """Directional ablation as Arditi et al. (2024) run it: the component along
        ``direction`` removed at ``resid_pre``, ``attn_out`` and ``mlp_out`` of every layer, at
        every position, so that neither the stream at any point of any layer nor anything a
        layer adds to it keeps a component along it.

        Args:
            direction: ``(hidden,)``: a tensor, numpy array or list of floats, non-zero
                (normalised on the worker).
            layers: ``"all"`` (default: every decoder layer of the served model) or a list
                of decoder layers.
            points: the points ablated at each of ``layers`` (default ``ABLATION_POINTS``;
                any points steering writes).
            phase: ``"all"`` (default), ``"prefill"`` or ``"decode"``.

        Returns:
            One ``mode="ablate"`` vector per point, to put in ``apply_steering_vectors``
            (with any other steering).

        Raises:
            pydantic.ValidationError: (a ``ValueError``) ``direction`` is not one non-zero,
                finite row, or ``layers`` is not ``"all"`` nor a list of distinct layers.

        Examples:
            >>> import torch
            >>> vectors = SteeringVector.ablation(torch.ones(576))
            >>> [v.hook_point for v in vectors], vectors[0].layer_indices, vectors[0].mode
            (['resid_pre', 'attn_out', 'mlp_out'], 'all', 'ablate')
        """
        row = _as_tensor(direction, "direction")
        if row.dim() != 1:
            raise ValueError(f"direction must be 1D (hidden,), got shape {tuple(row.shape)}")
        rows = row[None] if layers == ALL_LAYERS else row[None].repeat(len(layers), 1)
        return [cls(activations=rows, layer_indices=layers, hook_point=point, mode="ablate",
                    phase=phase) for point in points]

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
