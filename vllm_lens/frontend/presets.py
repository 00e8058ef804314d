"""Named steering presets: vectors the operator registers once and clients select by name (runs in:
front end).

Adds to ``vllm.LLM`` and ``AsyncLLM`` (``frontend.engine_methods``)::

    register_steering(name, vectors, model=None)   unregister_steering(name)
    steering_presets() -> [{"name", "model", "vectors": [{"layers", "point", "mode", ...}]}]

A request selects a preset with ``"preset:<name>"`` among its ``apply_steering_vectors``
(offline, or over HTTP without any opt-in: the vectors are the operator's, the client only
names them). Registration validates the vectors against the served model exactly as a
request's are (hidden size, layers, points, positions), and refuses a preset whose ``model``
names another model. An item steering by SAE feature (``spec.sae_steering``) is resolved when
the preset is registered: the preset keeps the vector made of the decoder rows (``scale``), or
the rows, encoder columns and targets (``clamp``), so it steers as the same item in a request
did then, whatever happens to the SAE afterwards (a TopK SAE's clamp, which needs the whole
SAE on the workers while it runs, is refused by field). In a server process only SAEs
registered by name (``VLLM_LENS_SAES``) may be named, never a directory, as in a request. The
OpenAI server registers the presets of ``VLLM_LENS_STEERING_PRESETS`` (a JSON file) before it
serves, after its SAEs, and fails to start on a bad one; ``GET /v1/steering`` lists them, and
``/v1/steering/register`` / ``/v1/steering/unregister`` answer only with the operator's opt-in
(``VLLM_LENS_ALLOW_STEERING_ROUTES=1``), like ``/v1/hooks/*``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_lens.common import wire
from vllm_lens.errors import LensRequestError
from vllm_lens.frontend.session import LensSession
from vllm_lens.frontend.engine_methods import Steps, install_methods
from vllm_lens.frontend.sae_names import steering_described
from vllm_lens.sinks.config import serves_http
from vllm_lens.spec import SteerSpec, parse_steering
from vllm_lens.spec.facts import facts_from_describe

__all__ = ["METHODS", "Presets", "install", "read_preset_file"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclasses.dataclass
class Presets:
    """The presets one engine serves (its ``LensSession.feature``), validated against its
    model; changed only by this module's methods (and put back by ``restore``)."""

    specs: dict[str, tuple[SteerSpec, ...]] = dataclasses.field(default_factory=dict)
    """name -> the steering items it applies, as a request's ``apply_steering_vectors`` would."""
    info: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """name -> what ``steering_presets`` lists of it (computed at registration)."""

    @staticmethod
    def of(session: LensSession) -> Presets:
        return session.feature(Presets)

    def snapshot(self, name: str) -> tuple[Any, Any]:
        """What ``name`` is now, for ``restore``."""
        return self.specs.get(name), self.info.get(name)

    def restore(self, name: str, before: tuple[Any, Any]) -> None:
        """Put ``name`` back as ``snapshot`` saw it (absent, or its specs and listing)."""
        specs, info = before
        if specs is None:
            self.specs.pop(name, None)
            self.info.pop(name, None)
        else:
            self.specs[name], self.info[name] = specs, info


def _register(session: LensSession, name: Any, vectors: Any, model: str | None = None) -> Steps:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise LensRequestError("name", f"{name!r} is not a preset name (1 to 64 letters, digits, "
                               "'.', '_' or '-', starting with a letter or digit)")
    if model is not None and not _names_model(model, session.model_names):
        raise LensRequestError("model", f"preset {name!r} is for {model!r}, but this engine "
                               f"serves {session.model_names[0]!r}")
    session.facts = facts_from_describe((yield "lens_describe", ()))
    # A client of the server never makes it open a path, also through a preset.
    saes = yield from steering_described(session, vectors, paths=not serves_http())
    specs = parse_steering(vectors, session.facts, f"presets.{name}", saes)
    _check_kept(specs, name)
    presets = Presets.of(session)
    presets.specs[name] = specs  # a name registered again is replaced
    presets.info[name] = _describe(name, specs, model)
    return presets.info[name]


def _check_kept(specs: tuple[SteerSpec, ...], name: str) -> None:
    """A preset keeps what its items made; a TopK clamp makes nothing to keep (it encodes
    with the whole SAE, which the workers hold only while a request that names it runs)."""
    for i, spec in enumerate(specs):
        if spec.clamp is not None and spec.clamp.path is not None:
            raise LensRequestError(
                f"presets.{name}[{i}].clamp", "a TopK, AbsTopK or gated SAE's clamp encodes with the whole SAE, "
                "which the workers load for each request that clamps it; a preset cannot keep "
                "it (send the item in the request's apply_steering_vectors)")


def _unregister(session: LensSession, name: Any) -> Steps:
    presets = Presets.of(session)
    if not isinstance(name, str) or name not in presets.specs:
        raise LensRequestError("name", f"no steering preset {name!r} is registered")
    presets.restore(name, (None, None))
    return True
    yield  # a generator that asks the workers nothing


def _list(session: LensSession) -> Steps:
    presets = Presets.of(session)
    return [presets.info[name] for name in sorted(presets.specs)]
    yield  # a generator that asks the workers nothing


def _describe(name: str, specs: tuple[SteerSpec, ...], model: str | None) -> dict[str, Any]:
    return {"name": name, "model": model, "vectors": [
        {"layers": list(s.layers), "point": s.point, "mode": s.mode, "phase": s.phase,
         "scale": s.scale, "norm_match": s.norm_match,
         "positions": None if s.positions is None else list(s.positions),
         "shape": list(wire.loads(s.vectors).shape),
         **({} if s.cap is None else {"cap": list(s.cap)})} for s in specs]}


def _names_model(model: str, served: tuple[str, ...]) -> bool:
    """``model`` names the served model: its path or name, a served name, or the last part of
    the path."""
    return any(model in (name, Path(name).name) for name in served)


def read_preset_file(path: str) -> dict[str, tuple[Any, str | None]]:
    """The presets of a JSON file: ``{name: [vector, ...]}`` or ``{name: {"vectors": [...],
    "model": "..."}}``, each vector a ``SteeringVector`` as JSON (``model_dump(mode="json")``)
    or an item steering by a registered SAE's feature; returns name -> (vectors, model)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"VLLM_LENS_STEERING_PRESETS: cannot read {path}: {exc}") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"VLLM_LENS_STEERING_PRESETS: {path} must hold a JSON object of "
                         "name -> vectors")
    out: dict[str, tuple[Any, str | None]] = {}
    for name, value in data.items():
        if isinstance(value, Mapping):
            out[name] = (value.get("vectors"), value.get("model"))
        else:
            out[name] = (value, None)
    return out


#: name -> generator function(session, *args); the public method names on LLM / AsyncLLM.
METHODS = {
    "register_steering": _register,
    "unregister_steering": _unregister,
    "steering_presets": _list,
}


def install() -> None:
    install_methods(METHODS, "vllm_lens.frontend.presets")
