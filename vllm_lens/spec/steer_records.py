"""Steering records: ``SteerSpec`` (one validated vector), its condition ``GateSpec`` and its
SAE clamp ``ClampSpec``, in the form that travels to the workers, and the digest of them that
salts the prefix cache (runs in: front end, worker).

``spec.steering`` and ``spec.sae_steering`` build them; workers decode them from the payload.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ClampSpec", "GateSpec", "SteerSpec", "steering_digest"]


@dataclass(frozen=True)
class GateSpec:
    """A steering vector's condition: its scale is multiplied per token by
    ``sigmoid(sharpness * (h · probe - threshold))``, ``h`` read at (``layer``, ``point``)."""

    layer: int
    point: str
    threshold: float
    sharpness: float
    probe: bytes
    """``wire.dumps`` of the ``(hidden,)`` probe."""

    def to_payload(self) -> dict[str, Any]:
        return {"layer": self.layer, "point": self.point, "threshold": self.threshold,
                "sharpness": self.sharpness, "probe": self.probe}

    @classmethod
    def from_payload(cls, d: Mapping[str, Any]) -> GateSpec:
        return cls(layer=int(d["layer"]), point=str(d["point"]), threshold=float(d["threshold"]),
                   sharpness=float(d["sharpness"]), probe=bytes(d["probe"]))


@dataclass(frozen=True)
class ClampSpec:
    """Clamping SAE features (``spec.sae_steering``): at each steered row the features are
    computed from the stream before any steering at that site, and ``decode(f') - decode(f)``
    is added (``f'``: ``f`` with the features set to the targets; the SAE's error term kept).
    The vector's ``vectors`` are the features' decoder rows ``[k, d_in]``. A standard or
    JumpReLU clamp brings their encoder columns (``encoder``); a TopK clamp names the SAE
    the workers hold for it (``path``, ``hook_point``), which encodes whole rows."""

    architecture: str
    """The SAE's architecture (``saes.model.ARCHITECTURES``)."""
    targets: tuple[float, ...]
    encoder: bytes
    """``wire.dumps`` of ``{"W_enc" [d_in, k], "b_enc" [k], "b_dec" [d_in], "threshold" [k]
    or None, "apply_b_dec_to_input"}``; of ``{}`` for a TopK clamp."""
    path: str | None = None
    """TopK: the SAE's real path and ``hook_point`` on the workers (``worker.saes``' key),
    which every rank steering its layer keeps while the request runs; ``None`` otherwise."""
    hook_point: str | None = None
    version: tuple[int, ...] = ()
    """TopK: the version of the SAE's files the workers read (``worker.saes``), so that the
    prefix-cache salt changes with the weights."""
    features: tuple[int, ...] = ()
    """TopK: the clamped features' indices, in the targets' order."""
    field: str = ""
    """TopK: the request's field naming the SAE, for a worker's error."""

    def to_payload(self) -> dict[str, Any]:
        payload = {"architecture": self.architecture, "targets": list(self.targets),
                   "encoder": self.encoder}
        if self.path is not None:
            payload.update(path=self.path, hook_point=self.hook_point,
                           version=list(self.version), features=list(self.features),
                           field=self.field)
        return payload

    @classmethod
    def from_payload(cls, d: Mapping[str, Any]) -> ClampSpec:
        return cls(architecture=str(d["architecture"]),
                   targets=tuple(float(t) for t in d["targets"]), encoder=bytes(d["encoder"]),
                   path=d.get("path"), hook_point=d.get("hook_point"),
                   version=tuple(int(v) for v in d.get("version", ())),
                   features=tuple(int(f) for f in d.get("features", ())),
                   field=str(d.get("field", "")))

    def digest_into(self, digest: Any) -> None:
        """Feed what decides the clamp into ``digest``: the encoder columns it brings, or
        the SAE it names and the version of its files."""
        digest.update(repr((self.architecture, self.targets, self.path, self.hook_point,
                            self.version, self.features)).encode())
        digest.update(self.encoder)


@dataclass(frozen=True)
class SteerSpec:
    """One validated steering vector, in the form that travels to the workers."""

    layers: tuple[int, ...]
    vectors: bytes
    """``wire.dumps`` of the activations: ``[n_layers, hidden]`` or ``[n_layers, n_pos, hidden]``
    in the caller's dtype (the worker casts to the model dtype); one row, ``[1, ...]``, used
    at every one of ``layers`` (``layer_indices="all"``)."""
    scale: float
    norm_match: bool
    positions: tuple[int, ...] | None
    """Absolute positions of 3D rows; ``None`` for 2D vectors, which apply at every position."""
    point: str = "resid_post"
    """The tap point the vectors are added at (``points.STEERABLE``)."""
    mode: str = "add"
    """``add``, ``replace`` (the stream at those rows becomes the vector), ``ablate`` (the
    component along each vector's direction removed), ``cap`` (the projection onto it clamped
    into ``cap``) or ``clamp`` (SAE features set to targets: ``clamp``)."""
    phase: str = "all"
    """``all``, ``prefill`` (prompt positions) or ``decode`` (generated positions)."""
    condition: GateSpec | None = None
    """Per-token gate of the addition, computed in the same forward pass."""
    clamp: ClampSpec | None = None
    """For ``mode="clamp"``: the features' encoder and targets."""
    cap: tuple[float | None, float | None] | None = None
    """For ``mode="cap"``: ``(lower, upper)``, ``None`` for an open side."""

    def to_payload(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers), "vectors": self.vectors, "scale": self.scale,
            "norm_match": self.norm_match, "point": self.point,
            "positions": None if self.positions is None else list(self.positions),
            "mode": self.mode, "phase": self.phase,
            "condition": None if self.condition is None else self.condition.to_payload(),
            "clamp": None if self.clamp is None else self.clamp.to_payload(),
            "cap": None if self.cap is None else list(self.cap),
        }

    @classmethod
    def from_payload(cls, d: Mapping[str, Any]) -> SteerSpec:
        positions = d["positions"]
        return cls(
            layers=tuple(int(x) for x in d["layers"]), vectors=bytes(d["vectors"]),
            scale=float(d["scale"]), norm_match=bool(d["norm_match"]),
            positions=None if positions is None else tuple(int(p) for p in positions),
            point=str(d.get("point", "resid_post")), mode=str(d.get("mode", "add")),
            phase=str(d.get("phase", "all")),
            condition=None if d.get("condition") is None else GateSpec.from_payload(
                d["condition"]),
            clamp=None if d.get("clamp") is None else ClampSpec.from_payload(d["clamp"]),
            cap=None if d.get("cap") is None else tuple(
                None if b is None else float(b) for b in d["cap"]),
        )

    def digest_into(self, digest: Any) -> None:
        """Feed everything that decides what this vector does into ``digest``."""
        digest.update(repr((self.layers, self.scale, self.norm_match, self.positions,
                            self.point, self.mode, self.phase, self.cap)).encode())
        digest.update(self.vectors)
        if self.condition is not None:
            digest.update(repr(dataclasses.astuple(self.condition)).encode())
        if self.clamp is not None:
            self.clamp.digest_into(digest)


def steering_digest(specs: Sequence[SteerSpec]) -> str | None:
    if not specs:
        return None
    digest = hashlib.sha256()
    for spec in specs:
        spec.digest_into(digest)
    return "vllm-lens:" + digest.hexdigest()[:32]
