"""Named SAEs: the SAEs a front end serves by name, and how a request's ``sae`` becomes the
description the workers give of it (runs in: front end).

Adds to ``vllm.LLM`` and ``AsyncLLM`` (``frontend.engine_methods``)::

    register_sae(name, path, hook_point=None) -> description
    registered_saes() -> [{"name", "layout", "architecture", "hook_name", "point", "layer",
                           "d_in", "d_sae", "dtype", "labels"} (a transcoder's also
                           "hook_name_out", "out_point", "d_out")]

Registering asks the workers to read the SAE (``lens_load_sae``), checks it against the
served model as a request would, and keeps its description; the weights stay with the
workers, within ``VLLM_LENS_SAE_MAX_BYTES`` (the least recently used unloaded first, read
again when a request names it). The OpenAI server registers the SAEs of ``VLLM_LENS_SAES``
(a JSON file: ``{name: path}`` or ``{name: {"path": ..., "hook_point": ...}}``) before it
serves, and fails to start on a bad one, naming every bad entry (the file itself is read
before the engine starts, ``check_sae_file``); ``GET /v1/lens/saes`` lists them.

A request's ``"sae"`` is a registered name; where the caller owns the process (an offline
``LLM``, an ``AsyncLLM`` outside the server) it may also be a directory. Over HTTP a client
never makes the server open a path: anything but a registered name is refused, naming the
field. The same holds for the items steering by feature that a steering preset being
registered or a patching sweep's ``corrupt`` lists (``steering_described``): described
before they are parsed, names only in a server process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from vllm_lens import envs
from vllm_lens.common import wire
from vllm_lens.common.messages import SaeAnswer, SaeSliceAnswer, read_all
from vllm_lens.errors import LensRequestError
from vllm_lens.frontend.session import LensSession
from vllm_lens.frontend.engine_methods import Steps, drive_async, install_methods
from vllm_lens.saes.labels import label_file, read_labels
from vllm_lens.spec.keys import MONITORS_KEY, REPLACE_KEY, SAE_KEY, STEER_KEY
from vllm_lens.spec.monitors import monitor_sae_references
from vllm_lens.spec.replacement import replacement_references
from vllm_lens.spec.sae_steering import steering_sae_references
from vllm_lens.spec.facts import facts_from_describe
from vllm_lens.spec.saes import Describe, check_description, sae_references

__all__ = ["METHODS", "SaeNames", "async_describer", "check_sae_file", "described_beforehand",
           "describing",
           "install", "offline_describer", "read_sae_file", "register_sae_file",
           "steering_described"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: What ``registered_saes`` lists of a description (never a path on the server's disk).
_LISTED = ("layout", "architecture", "hook_name", "point", "layer", "d_in", "d_sae", "dtype")
#: And of a transcoder's: the point it predicts.
_LISTED_TRANSCODER = ("hook_name_out", "out_point", "d_out")


@dataclasses.dataclass
class SaeNames:
    """The SAEs one engine serves by name (its ``LensSession.feature``); changed only by
    ``register_sae``."""

    by_name: dict[str, tuple[str, str | None, dict[str, Any]]] = dataclasses.field(
        default_factory=dict)
    """name -> (directory, hook point, the workers' description)."""

    @staticmethod
    def of(session: LensSession) -> SaeNames:
        return session.feature(SaeNames)


def _register(session: LensSession, name: Any, path: Any, hook_point: Any = None) -> Steps:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise LensRequestError("name", f"{name!r} is not an SAE name (1 to 64 letters, digits, "
                               "'.', '_' or '-', starting with a letter or digit)")
    if not isinstance(path, (str, Path)) or not str(path):
        raise LensRequestError("path", "the directory holding the SAE")
    if hook_point is not None and not isinstance(hook_point, str):
        raise LensRequestError("hook_point", "a name such as 'blocks.3.hook_resid_post'")
    if session.facts is None:
        session.facts = facts_from_describe((yield "lens_describe", ()))
    try:
        info = answer((yield "lens_load_sae", (str(path), hook_point)))
    except ValueError as exc:
        raise LensRequestError("path", str(exc)) from None
    check_description(info, session.facts, "path")
    try:  # its labels are read now, so a bad file is the operator's error, not a client's
        read_labels(info["path"])
    except (ValueError, OSError) as exc:
        raise LensRequestError("path", str(exc)) from None
    SaeNames.of(session).by_name[name] = (info["path"], hook_point, info)  # again: replaced
    return _listing(name, info)


def _list(session: LensSession) -> Steps:
    registered = SaeNames.of(session).by_name
    return [_listing(name, info) for name, (_, _, info) in sorted(registered.items())]
    yield  # a generator that asks the workers nothing


def _listing(name: str, info: Mapping[str, Any]) -> dict[str, Any]:
    listed = {"name": name, **{k: info.get(k) for k in _LISTED},
              "labels": label_file(info["path"]) is not None}
    if info.get("out_point") is not None:
        listed.update({k: info.get(k) for k in _LISTED_TRANSCODER})
    return listed


def answer(answers: list[Any]) -> dict[str, Any]:
    """The workers' answers to ``lens_load_sae`` -> the SAE's description (ranks that do not
    keep it answer too: ``worker.saes``); a problem any rank had raises ``ValueError``."""
    read = read_all(SaeAnswer, [a for a in answers if a is not None])
    problem = next((a.error for a in read if a.error), None)
    described = [a.description for a in read if a.description is not None]
    if problem is not None or not described:
        raise ValueError(problem or "no worker could load it")
    return described[0]


def _resolve(session: LensSession, sae: str, hook_point: str | None,
             paths: bool) -> tuple[str, str | None]:
    """(directory, hook point) of what a request names: a registered name first, then (if
    ``paths``) a directory."""
    registered = SaeNames.of(session).by_name
    named = registered.get(sae)
    if named is not None:
        if not paths and hook_point is not None and hook_point != named[1]:
            # Each hook point is another copy of the weights on the workers: over HTTP an SAE
            # reads where the operator registered it.
            raise ValueError(f"{sae!r} is served at its registered hook point "
                             f"({named[1] or named[2].get('hook_name')}); a client cannot "
                             "move it (hook_point)")
        return named[0], hook_point if hook_point is not None else named[1]
    if not paths:
        names = ", ".join(sorted(registered)[:20]) or "none are registered"
        raise ValueError(f"{sae!r} is not an SAE this server serves (names: {names}; "
                         "GET /v1/lens/saes lists them, the operator registers them in "
                         "VLLM_LENS_SAES); a client cannot name a path")
    return sae, hook_point


def sae_slice(answers: list[Any]) -> dict[str, Any]:
    """The workers' answers to ``lens_sae_slice`` -> some features' decoder rows and encoder
    columns (the rank that keeps the SAE answers); a problem raises ``ValueError``."""
    for found in read_all(SaeSliceAnswer, answers):
        if found.error is not None:
            raise ValueError(found.error)
        if found.data is not None:
            return wire.loads(found.data)
    raise ValueError("no worker keeps it loaded (retry the request)")


class _OfflineLookup:
    """``spec.saes``' describe for an offline engine (``LLMEngine``): a registered name or a
    directory, loaded by the workers (once; a loaded one is shared); ``sae_slice`` for
    steering by feature."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._session = LensSession.of(engine)

    def __call__(self, sae: str, hook_point: str | None, clamp: bool = False
                 ) -> dict[str, Any]:
        given = _beforehand.get()
        if given is not None:
            return given(sae, hook_point)
        path, point = _resolve(self._session, sae, hook_point, paths=True)
        return answer(self._engine.collective_rpc("lens_load_sae", args=(path, point, clamp)))

    def sae_slice(self, sae: str, hook_point: str | None,
                  features: tuple[int, ...]) -> dict[str, Any]:
        given = _beforehand.get()
        if given is not None:
            return given.sae_slice(sae, hook_point, features)
        # Called right after ``__call__`` loaded it, in the same parse (nothing runs between).
        path, point = _resolve(self._session, sae, hook_point, paths=True)
        return sae_slice(self._engine.collective_rpc(
            "lens_sae_slice", args=(path, point, list(features))))


def offline_describer(engine: Any) -> Describe:
    return _OfflineLookup(engine)


class _Described:
    """What an asynchronous front end fetched for one request before parsing it: each SAE's
    description (or the problem), and the rows and columns its steering by feature selects."""

    def __init__(self) -> None:
        self.found: dict[tuple[str, str | None], dict[str, Any] | Exception] = {}
        self.slices: dict[tuple[str, str | None, tuple[int, ...]],
                          dict[str, Any] | Exception] = {}

    def __call__(self, sae: str, hook_point: str | None, clamp: bool = False
                 ) -> dict[str, Any]:
        # A clamped SAE was described with ``clamp`` (``describing``).
        return _value(self.found.get((sae, hook_point)))

    def sae_slice(self, sae: str, hook_point: str | None,
                  features: tuple[int, ...]) -> dict[str, Any]:
        return _value(self.slices.get((sae, hook_point, features)))


def _value(value: Any) -> Any:
    if value is None:
        raise ValueError("it was not described before the request was checked")
    if isinstance(value, Exception):
        raise value
    return value


def describing(session: LensSession, reads: Sequence[tuple[str, str | None]],
               steers: Sequence[tuple[str, str | None, tuple[int, ...], bool]],
               paths: bool) -> Steps:
    """Steps that describe the SAEs ``reads`` names (``sae_references``) and those ``steers``
    steers by (``steering_sae_references``; one a clamp names is kept by every rank steering
    it, if TopK), and fetch the steered features' slices; returns what the parse then looks
    them up in (a problem is kept and raised there, naming the field). ``paths``:
    directories are accepted (not over HTTP)."""
    described = _Described()
    clamped = {(sae, hook_point) for sae, hook_point, _, clamp in steers if clamp}
    # At most MAX_SAE_ENTRIES of each kind: a bounded number of worker calls.
    for sae, hook_point in [*reads, *((s, h) for s, h, _, _ in steers)]:
        if (sae, hook_point) in described.found:
            continue
        path = sae
        try:
            path, point = _resolve(session, sae, hook_point, paths)
            described.found[sae, hook_point] = answer((yield "lens_load_sae", (
                path, point, (sae, hook_point) in clamped)))
        except ValueError as exc:
            described.found[sae, hook_point] = _scrubbed(exc, sae, path, paths)
    for sae, hook_point, features, _ in steers:
        info = described.found[sae, hook_point]
        if (not features or isinstance(info, Exception)
                or (sae, hook_point, features) in described.slices):  # (a replacement: none)
            continue
        point = _resolve(session, sae, hook_point, paths)[1]
        try:
            described.slices[sae, hook_point, features] = sae_slice(
                (yield "lens_sae_slice", (info["path"], point, list(features))))
        except ValueError as exc:
            described.slices[sae, hook_point, features] = _scrubbed(exc, sae, info["path"],
                                                                    paths)
    return described


def steering_described(session: LensSession, raw: Any, paths: bool) -> Steps:
    """Steps that describe the SAEs a list of steering vectors outside a request steers by (a
    preset being registered, a patching sweep's ``corrupt``): what ``spec.parse_steering``
    then looks them up in, or ``None`` when it names none."""
    steers = steering_sae_references(raw)
    if not steers:
        return None
    return (yield from describing(session, (), steers, paths))


#: What a patching sweep described once for all its variants (``described_beforehand``).
_beforehand: ContextVar[_Described | None] = ContextVar("vllm_lens_described_beforehand",
                                                        default=None)


@contextlib.contextmanager
def described_beforehand(described: _Described | None) -> Iterator[None]:
    """Requests sent inside the block (a patching sweep's variants, which all steer by the
    features its ``corrupt`` lists) look the SAEs they name up in ``described``, fetched and
    checked once for all of them, instead of asking the workers each time."""
    token = _beforehand.set(described)
    try:
        yield
    finally:
        _beforehand.reset(token)


async def async_describer(engine: Any, extra_args: Mapping[str, Any] | None,
                          paths: bool) -> Describe | None:
    """``spec.saes``' describe for an ``AsyncLLM``: the SAEs ``extra_args`` name (features to
    read, features to steer by, transcoders replacing MLPs) are described and their slices
    fetched first, then the
    parse looks them up. ``paths``: directories are accepted (not over HTTP). ``None`` when
    the request names no SAE."""
    if not extra_args:
        return None
    given = _beforehand.get()
    if given is not None:
        return given
    reads = await _off_the_loop(sae_references, extra_args.get(SAE_KEY))
    steers = await _off_the_loop(steering_sae_references, extra_args.get(STEER_KEY))
    steers += await _off_the_loop(monitor_sae_references, extra_args.get(MONITORS_KEY))
    steers += await _off_the_loop(replacement_references, extra_args.get(REPLACE_KEY))
    if not reads and not steers:
        return None
    return await drive_async(engine, describing(LensSession.of(engine), reads, steers, paths))


#: Lens values longer than this are scanned for SAE names on a thread, never the event loop.
_SCAN_INLINE_CHARS = 64 << 10


async def _off_the_loop(scan: Any, raw: Any) -> list[Any]:
    """``scan(raw)``; a long JSON string (steering vectors run to megabytes) on a thread."""
    if raw is None or raw is False:
        return []
    if isinstance(raw, str) and len(raw) > _SCAN_INLINE_CHARS:
        return await asyncio.to_thread(scan, raw)
    return scan(raw)


def _scrubbed(exc: ValueError, name: str, path: str, paths: bool) -> ValueError:
    """``exc`` with the server's directory of a named SAE replaced by its name (a client that
    may not name paths is not told them either)."""
    if paths or name == path:
        return exc
    message = str(exc)
    for where in {os.path.realpath(path), path}:
        message = message.replace(where, f"<SAE {name}>")
    return ValueError(message)


def read_sae_file(path: str) -> dict[str, tuple[str, str | None]]:
    """The SAEs of a ``VLLM_LENS_SAES`` file: ``{name: path}`` or ``{name: {"path": ...,
    "hook_point": ...}}``; returns name -> (path, hook point). Checks what needs no worker
    (the JSON, each entry's name and fields); a bad entry raises ``ValueError`` naming every
    bad entry of the file at once."""
    try:
        data = json.loads(Path(path).read_text(), object_pairs_hook=_Entries)
    except (OSError, ValueError) as exc:
        raise ValueError(f"VLLM_LENS_SAES: cannot read {path}: {exc}") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"VLLM_LENS_SAES: {path} must hold a JSON object of name -> path")
    out: dict[str, tuple[str, str | None]] = {}
    problems: dict[str, str] = {}
    for name, value in data.pairs:
        if name in out or name in problems:
            problems[name] = "is listed twice"
            out.pop(name, None)
            continue
        try:
            out[name] = _file_entry(name, value)
        except ValueError as exc:
            problems[name] = str(exc)
    if problems:
        raise ValueError(_bad_entries(path, problems, len(data.pairs)))
    return out


class _Entries(dict):
    """A JSON object that also keeps its pairs in order, repeated names included."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.pairs = pairs


def _file_entry(name: str, value: Any) -> tuple[str, str | None]:
    shape = 'must be a path or {"path": ..., "hook_point": ...}'
    if not _NAME.fullmatch(name):
        raise ValueError("is not an SAE name (1 to 64 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit)")
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"path", "hook_point"})
        if unknown:
            raise ValueError(f"{shape} (unknown field {unknown[0]!r})")
        path, hook_point = value.get("path"), value.get("hook_point")
    else:
        path, hook_point = value, None
    if not isinstance(path, str) or not path:
        raise ValueError(shape + (" (path: the directory holding the SAE)"
                                  if isinstance(value, Mapping) else ""))
    if hook_point is not None and not isinstance(hook_point, str):
        raise ValueError("hook_point: a name such as 'blocks.3.hook_resid_post'")
    return path, hook_point


def _bad_entries(path: str, problems: Mapping[str, str], entries: int) -> str:
    listed = "".join(f"\n  SAE {name!r}: {problem}" for name, problem in problems.items())
    return (f"VLLM_LENS_SAES ({path}): the server does not start: {len(problems)} of the "
            f"{entries} SAEs listed cannot be served (fix or remove them):{listed}")


def check_sae_file() -> None:
    """Read ``VLLM_LENS_SAES`` (if set) as ``register_sae_file`` will: what needs no worker is
    checked before the engine starts, a bad file stopping the server in seconds."""
    path = envs.saes_path()
    if path is not None:
        read_sae_file(path)


async def register_sae_file(engine: Any) -> list[str]:
    """Register every SAE of ``VLLM_LENS_SAES`` on ``engine`` (an ``AsyncLLM``); an SAE that
    cannot be read or does not fit the model stops the server from starting: the error names
    every bad one (each is tried), so that the server never serves part of the list.
    Returns the names registered."""
    path = envs.saes_path()
    if path is None:
        return []
    entries = read_sae_file(path)
    problems: dict[str, str] = {}
    for name, (directory, hook_point) in entries.items():
        try:
            await engine.register_sae(name, directory, hook_point)
        except LensRequestError as exc:  # "path": its name and fields were read above
            problems[name] = exc.problem
        except ValueError as exc:
            problems[name] = str(exc)
    if problems:
        raise ValueError(_bad_entries(path, problems, len(entries)))
    return list(entries)


#: name -> generator function(session, *args); the public method names on LLM / AsyncLLM.
METHODS = {"register_sae": _register, "registered_saes": _list}


def install() -> None:
    install_methods(METHODS, "vllm_lens.frontend.sae_names")
