"""Idempotent method wrapping (runs in: any).

Every process that loads the plugin.

vLLM loads general plugins once per process, but several processes (and some tests) import
them again; wrapping twice would run vllm-lens twice per call. Each wrapper remembers the
original in ``__wrapped__`` and is recognised by a marker, so a second install is a no-op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["is_wrapped", "wrap_attribute"]

_MARK = "__vllm_lens_wrapper__"


def wrap_attribute(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.name`` by ``make(original)`` unless vllm-lens already wrapped it."""
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _MARK, True)
    setattr(owner, name, wrapper)


def is_wrapped(value: Any) -> bool:
    """Whether ``value`` is a wrapper that ``wrap_attribute`` installed."""
    return bool(getattr(value, _MARK, False))
