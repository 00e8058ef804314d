"""The SAEs loaded on this worker, shared by every request that names one (runs in: worker).

The front end asks for an SAE before it admits a request that reads it (``lens_load_sae``),
so loading (reading the files, moving the weights to the model's device) never happens in a
forward pass. An SAE whose files changed since it was read (their modification times) is read
again at the next such request. The weights kept are bounded by ``VLLM_LENS_SAE_MAX_BYTES``: to load another,
the least recently used SAE that no request holds is unloaded; if that is not enough the
load is refused. SAEs asked for in the last ``ADMISSION_GRACE_S`` seconds are unloaded last:
the request one was loaded for was admitted but may not have started yet (only a running
request holds its SAEs), and unloading it then would fail that request; when room is needed
and only they are left, they go too (least recently used first) rather than refusing —
except those asked for to *change* the model's computation (a TopK clamp, a transcoder
replacing an MLP: ``pin``): their requests' prefix-cache salt promises that edit, so they
are not unloaded for ``PINNED_S`` (ten minutes) after the last request asked for them, and
a load that needs their room is refused instead. A rank keeps an SAE where it captures the SAE's layer, and also, for a
request clamping a TopK SAE's features or replacing an MLP by a transcoder, on every TP rank
of the stage holding that layer (``worker.steer``, ``worker.replacement``).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Mapping
from typing import Any

import torch

from vllm_lens.saes import LAYOUTS, SAE, SAEFormatError, detect_layout, load_sae
from vllm_lens.saes.model import WHOLE_CLAMP

__all__ = ["ADMISSION_GRACE_S", "PINNED_S", "SAERegistry"]

#: How long an SAE asked for at a request's admission is unloaded only after all others.
ADMISSION_GRACE_S = 60.0
#: How long an SAE asked for to change the computation (``pin``) is not unloaded at all: a
#: request waiting longer than this in the queue may find it gone (and fails).
PINNED_S = 600.0

Key = tuple[str, "str | None"]
#: Whether this rank keeps an SAE, from its description (``describe``).
Wanted = Callable[[Mapping[str, Any]], bool]


class SAERegistry:
    def __init__(self, max_bytes: int, *, grace_s: float = ADMISSION_GRACE_S,
                 pinned_s: float = PINNED_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.grace_s = grace_s
        self.pinned_s = pinned_s
        self._clock = clock
        self._asked: dict[Key, float] = {}
        """When each SAE was last asked for (``describe``, ``load``)."""
        self._pinned: dict[Key, float] = {}
        """When each SAE was last asked for to change the computation (``pin``)."""
        self._loaded: OrderedDict[Key, SAE] = OrderedDict()
        """(real path, hook point override) -> the SAE on the device, least recently used
        first."""
        self._stamps: dict[Key, tuple[int, ...]] = {}
        """Modification times of each read SAE's files, when it was read."""
        self._elsewhere: dict[Key, dict[str, Any]] = {}
        """Descriptions of SAEs read here but kept by other ranks (their layer is not
        captured here), so that they are read once, not at every request."""

    def _touch(self, key: Key, pin: bool = False) -> tuple[set[Key], set[Key]]:
        """Note that ``key`` was asked for now (``pin``: to change the computation); returns
        the keys asked for within the grace period, and those pinned within ``pinned_s``
        (those older are forgotten, so the records stay small)."""
        now = self._clock()
        self._asked = {k: t for k, t in self._asked.items() if now - t < self.grace_s}
        self._pinned = {k: t for k, t in self._pinned.items() if now - t < self.pinned_s}
        self._asked[key] = now
        if pin:
            self._pinned[key] = now
        return set(self._asked), set(self._pinned)

    def _keep_pinned(self, key: Key, sae: SAE) -> None:
        """Only an SAE a request computes with whole is pinned (a standard or JumpReLU clamp
        carries its features' columns and needs no copy here)."""
        if not (sae.architecture in WHOLE_CLAMP or sae.is_transcoder):
            self._pinned.pop(key, None)

    @staticmethod
    def key(path: str, hook_point: str | None) -> Key:
        return os.path.realpath(path), hook_point

    @property
    def nbytes(self) -> int:
        return sum(sae.nbytes for sae in self._loaded.values())

    def __len__(self) -> int:
        return len(self._loaded)

    def get(self, path: str, hook_point: str | None, *, resolved: bool = False) -> SAE | None:
        """The loaded SAE, or ``None``. ``resolved``: ``path`` is already the real path (as
        the description gives it), so no file system call is made (each step asks)."""
        key = (path, hook_point) if resolved else self.key(path, hook_point)
        sae = self._loaded.get(key)
        if sae is not None:
            self._loaded.move_to_end(key)
        return sae

    def version(self, path: str, hook_point: str | None) -> tuple[int, ...] | None:
        """The ``version`` (``describe``) of the files a loaded SAE was read from, by its
        real path; ``None`` if it is not loaded."""
        key = (path, hook_point)
        return self._stamps.get(key) if key in self._loaded else None

    def describe(self, path: str, hook_point: str | None, device: torch.device,
                 held: Container[Key], wanted: Wanted,
                 dtype: torch.dtype | None = None, pin: bool = False) -> dict[str, Any]:
        """``load`` it (or only read it, if not ``wanted`` here) and describe it, with the
        ``hook_point`` it is kept under and the ``version`` of its files (their modification
        times when read: what a TopK clamp's prefix-cache salt names). ``pin``: a request
        will change the computation with it (see the module's docstring)."""
        key = self.key(path, hook_point)
        self._touch(key, pin)
        if key in self._stamps and self._stamps[key] != _stamp(key[0]):  # changed on disk
            if key in self._loaded and key in held:
                raise ValueError("its files changed while running requests read the copy "
                                 "loaded before; retry when they finish")
            self._loaded.pop(key, None)
            self._elsewhere.pop(key, None)
        known = self._elsewhere.get(key)
        if known is not None and not wanted(known):
            return known
        sae = self.load(path, hook_point, device, held, wanted, dtype, pin)
        description = {**describe(sae, path), "hook_point": hook_point,
                       "version": list(self._stamps[key])}
        if key in self._loaded:
            self._elsewhere.pop(key, None)  # read elsewhere before, wanted here now
        else:
            self._elsewhere[key] = description
        return description

    def load(self, path: str, hook_point: str | None, device: torch.device,
             held: Container[Key], wanted: Wanted = lambda info: True,
             dtype: torch.dtype | None = None, pin: bool = False) -> SAE:
        """The SAE at ``path`` on ``device``, loaded once. ``held``: keys running requests
        read (never unloaded). An SAE ``wanted`` says no to (given its description) is read
        and described but not kept (a rank that neither captures nor clamps its layer).
        ``dtype``: the rows' dtype; an SAE narrower than it is kept widened once (and counted
        so), wider ones as they are. An SAE that computes on the host makes its encoder's
        reordered copy here (``SAE.prepare``, counted), never in a forward pass. ``pin``:
        as for ``describe``."""
        key = self.key(path, hook_point)
        recent, pinned = self._touch(key, pin)
        found = self.get(path, hook_point)
        if found is not None:
            self._keep_pinned(key, found)
            return found
        stamp = _stamp(key[0])
        sae = load_sae(key[0], hook_point)
        self._stamps[key] = stamp
        self._keep_pinned(key, sae)
        if not wanted(describe(sae, key[0])):
            return sae
        if dtype is not None and torch.promote_types(sae.dtype, dtype) != sae.dtype:
            sae = sae.to("cpu", torch.promote_types(sae.dtype, dtype))
        if sae.W_enc.device == torch.device(device):
            sae.prepare()  # computes where it was read: its encoder's copies now, counted
        if sae.nbytes > self.max_bytes:
            raise ValueError(f"its weights take {sae.nbytes:,} bytes, more than "
                             f"VLLM_LENS_SAE_MAX_BYTES ({self.max_bytes:,})")
        # Least recently used first; never one a running request reads, nor one a request
        # admitted within the grace period will change the computation with.
        free = [k for k in self._loaded if k not in held and k not in pinned]
        for other in [k for k in free if k not in recent] + [k for k in free if k in recent]:
            if self.nbytes + sae.nbytes <= self.max_bytes:
                break
            del self._loaded[other]
        if self.nbytes + sae.nbytes > self.max_bytes:
            raise ValueError(f"the SAEs running (or just admitted) requests read take "
                             f"{self.nbytes:,} bytes of "
                             f"VLLM_LENS_SAE_MAX_BYTES ({self.max_bytes:,}); {sae.nbytes:,} "
                             "more do not fit: retry when they finish, or raise the setting")
        self._loaded[key] = sae = sae.to(device)
        return sae


def _stamp(directory: str) -> tuple[int, ...]:
    """Modification times of the files the SAE is read from (its layout's: a labels file
    beside it is not the SAE, ``saes.labels``); every file's if no layout is recognised."""
    try:
        files = LAYOUTS[detect_layout(directory)]
        return tuple(os.stat(os.path.join(directory, name)).st_mtime_ns for name in files)
    except (SAEFormatError, OSError):
        try:
            return tuple(sorted(entry.stat().st_mtime_ns for entry in os.scandir(directory)))
        except OSError:
            return ()


def describe(sae: SAE, path: str) -> dict[str, Any]:
    """What the front end checks a request against (never the weights)."""
    described = {"path": os.path.realpath(path), "layout": sae.layout,
                 "architecture": sae.architecture, "d_in": sae.d_in, "d_sae": sae.d_sae,
                 "point": sae.point, "layer": sae.layer, "hook_name": sae.hook_name,
                 "dtype": str(sae.dtype).removeprefix("torch.")}
    if sae.is_transcoder:
        described.update(d_out=sae.d_out, out_point=sae.out_point,
                         hook_name_out=sae.hook_name_out)
    return described
