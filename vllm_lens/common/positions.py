"""Position selectors: which token positions of a request a capture keeps (runs in: front end,
worker).

The front end validates selectors; workers select rows.

A selector names a range of a request's absolute positions and optionally slices it with
Python's index/slice syntax:

- ``"all"``: every computed position; ``"prompt"``: ``0 .. n_prompt - 1``; ``"generated"``:
  ``n_prompt ..`` (generated tokens that went through a forward pass);
- ``"prompt[1:]"`` (the prompt without its first token, the attention sink), ``"prompt[-1]"``,
  ``"generated[-5:]"``, ``"all[-1]"``, ``"generated[:10]"`` ...: Python semantics on that range
  (negative indices count from its end, out-of-range slices are clipped, an index past the end
  selects nothing; no step);
- ``"last_prompt"``: ``"prompt[-1]"``.

The end of ``generated`` and ``all`` is known only when the request finishes. While it runs the
worker keeps a superset of the rows (``bounds`` without ``n_seen``; for a window at the end,
only the last ``keep_last`` positions plus ``ROLLING_SLACK``) and trims them to the exact window
when the rows are fetched (``bounds`` with ``n_seen``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

__all__ = ["BASES", "NAMED", "ROLLING_SLACK", "Selector", "parse_selector"]

BASES = ("all", "prompt", "generated")
#: Selector names accepted without brackets.
NAMED = (*BASES, "last_prompt")

#: Positions kept below a rolling window's reach (``Selector.keep_last``): the scheduler may run
#: a request a few steps past a stop string before the front end's abort reaches it, and the
#: window is relative to where the request really ended. A request that ran further past its
#: stop than this fails rather than return wrong rows.
ROLLING_SLACK = 64

_SYNTAX = re.compile(r"(all|prompt|generated)\[(-?\d{1,9})?(?:(:)(-?\d{1,9})?)?\]")


@dataclass(frozen=True)
class Selector:
    """``base[start:stop]`` over a request's absolute positions."""

    base: str
    start: int | None = None
    stop: int | None = None

    @property
    def may_read_prompt(self) -> bool:
        """False only for selectors that can never pick a prompt position."""
        return self.base != "generated"

    def bounds(self, n_prompt: int, n_seen: int | None = None) -> tuple[int, int | None]:
        """``[lo, hi)`` of the absolute positions selected.

        ``n_seen`` is the number of positions the request computed in all (known once it
        finished). Without it, the end of ``all`` / ``generated`` is unknown: the result is then
        the smallest range sure to contain the selection (``hi`` ``None`` = open-ended).
        """
        lo0 = n_prompt if self.base == "generated" else 0
        hi0 = n_prompt if self.base == "prompt" else n_seen
        if hi0 is None:
            lo = lo0 + self.start if self.start is not None and self.start > 0 else lo0
            hi = lo0 + self.stop if self.stop is not None and self.stop >= 0 else None
            return lo, hi
        window = range(lo0, max(lo0, hi0))[slice(self.start, self.stop)]
        return window.start, max(window.start, window.stop)

    @property
    def needs_end(self) -> bool:
        """Whether which positions it selects depends on where the request ends (a negative
        index into ``generated`` / ``all``): known only once it finished."""
        if self.base == "prompt":
            return False
        return any(bound is not None and bound < 0 for bound in (self.start, self.stop))

    @property
    def keep_last(self) -> int | None:
        """For a window at the end of ``generated`` / ``all`` (a negative start): how many of
        the last positions it can span. While the request runs the worker keeps only the rows
        of that many last positions (plus ``ROLLING_SLACK``); ``None`` for other selectors."""
        if self.base == "prompt" or self.start is None or self.start >= 0:
            return None
        return -self.start

    def held_bound(self, base_len: int) -> int:
        """Most rows the worker holds at once for this selector when its range (``prompt``,
        ``generated`` or ``all``) has at most ``base_len`` positions."""
        if self.base == "prompt":  # exact while running
            return len(range(base_len)[slice(self.start, self.stop)])
        start = self.start if self.start is not None and self.start >= 0 else None
        stop = self.stop if self.stop is not None and self.stop >= 0 else None
        superset = len(range(base_len)[slice(start, stop)])
        if self.keep_last is not None:  # a rolling window: kept rows + one step's new ones
            return min(superset, 2 * self.keep_last + ROLLING_SLACK + 16)
        return superset


@functools.lru_cache(maxsize=256)
def parse_selector(text: str) -> Selector | None:
    """The selector ``text`` names, or ``None`` if it is not one."""
    text = text.replace(" ", "")
    if text in BASES:
        return Selector(text)
    if text == "last_prompt":
        return Selector("prompt", -1, None)
    match = _SYNTAX.fullmatch(text)
    if match is None:
        return None
    base, start, colon, stop = match.groups()
    if colon is None:  # an index: one position
        if start is None:
            return None
        index = int(start)
        return Selector(base, index, None if index == -1 else index + 1)
    return Selector(base, None if start is None else int(start),
                    None if stop is None else int(stop))
