"""Persistent hooks: hooks registered on the engine that run on every request until cleared (runs
in: front end).

Adds to ``vllm.LLM`` and ``AsyncLLM`` (the OpenAI server's ``/v1/hooks/*`` routes use the
latter)::

    register_hooks(hooks, prefetch_params=None)   collect_hook_results()   clear_hook_results()
    clear_hooks()   prefetch_params(names)   clear_prefetched()

``collect_hook_results`` is non-destructive and returns ``{request id: {"0": saved of the first
hook, ...}}`` (a ``HookError`` in place of the dict for a request whose hook raised); workers
keep the results of the last ``VLLM_LENS_HOOK_RESULTS_MAX`` requests. Each operation is written
once as a generator of ``(rpc method, args)`` steps (``frontend.engine_methods``).

Persistent hooks see the tokens each step computes: prompt tokens served from the prefix
cache are not run again, so start the engine with ``enable_prefix_caching=False`` when the
hooks must see every prompt token or change the stream.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from vllm_lens.common import wire
from vllm_lens.common.messages import HookResultsAnswer, ParamsAnswer, read_all
from vllm_lens.frontend.merge import merge_hook_results
from vllm_lens.frontend.session import LensSession
from vllm_lens.frontend.engine_methods import Steps as _Steps
from vllm_lens.frontend.engine_methods import install_methods
from vllm_lens.errors import LensRequestError
from vllm_lens.common.points import QK_HOOK_POINT
from vllm_lens.spec import check_engine, parse_hooks
from vllm_lens.spec.facts import facts_from_describe
from vllm_lens.common import hook_results

__all__ = ["METHODS", "PersistentHooks", "install"]

# vLLM appends "-<8 random characters>" to each request id it is given (input_processor).
_INTERNAL_SUFFIX = re.compile(r"-[0-9A-Za-z]{8}$")


@dataclasses.dataclass
class PersistentHooks:
    """What the front end keeps of an engine's persistent hooks (its ``LensSession.feature``)."""

    trusted: bool = False
    """Some registered hook was pickled, i.e. registered by a trusted caller (their results
    may come back pickled)."""

    @staticmethod
    def of(session: LensSession) -> PersistentHooks:
        return session.feature(PersistentHooks)


def _register(session: LensSession, hooks: Any,
              prefetch_params: Sequence[str] | None = None) -> _Steps:
    session.facts = facts_from_describe((yield "lens_describe", ()))
    check_engine(session.facts, "hooks", hooks=True)
    specs = parse_hooks(hooks, session.facts)
    for i, spec in enumerate(specs):
        if spec.point == QK_HOOK_POINT:
            # Q/K hooks keep state per request (attention_to_span keeps K) and persistent
            # hooks also see prefix-cached requests, whose early positions never run.
            raise LensRequestError(f"hooks[{i}].hook_point", f"{QK_HOOK_POINT} hooks run per "
                                   "request only (apply_hooks), not as persistent hooks")
    PersistentHooks.of(session).trusted = any(s.pickled is not None for s in specs)
    if prefetch_params:
        yield from _prefetch(prefetch_params)
    yield "lens_register_hooks", ([s.to_payload() for s in specs],)


def _collect(session: LensSession) -> _Steps:
    stages_by_req: dict[str, list[dict[str, Any]]] = {}
    trusted = PersistentHooks.of(session).trusted
    for rank in read_all(HookResultsAnswer, (yield "lens_collect_hook_results", ())):
        for req_id, blob in rank.results.items():
            stages_by_req.setdefault(req_id, []).append(hook_results.decode(blob, trusted))
    out: dict[str, Any] = {}
    for req_id, stages in stages_by_req.items():
        results, error = merge_hook_results(stages)
        out[_INTERNAL_SUFFIX.sub("", req_id)] = error if error is not None else results
    return out


def _prefetch(names: Sequence[str]) -> _Steps:
    merged: dict[str, bytes] = {}
    for rank in read_all(ParamsAnswer, (yield "lens_prefetch_params", (list(names),))):
        merged.update(rank.params)
    missing = sorted(set(names) - set(merged))
    if missing:
        raise KeyError(f"no stage of the model has parameter(s) {missing}")
    yield "lens_set_prefetched", (merged,)
    return {name: tuple(wire.loads(b).shape) for name, b in merged.items()}


def _single(method: str) -> Any:
    def steps(session: LensSession) -> _Steps:
        yield method, ()

    return steps


#: name -> generator function(session, *args); the public method names on LLM / AsyncLLM.
METHODS = {
    "register_hooks": _register,
    "collect_hook_results": _collect,
    "clear_hook_results": _single("lens_clear_hook_results"),
    "clear_hooks": _single("lens_clear_hooks"),
    "prefetch_params": lambda session, names: _prefetch(names),
    "clear_prefetched": _single("lens_clear_prefetched"),
}


def install() -> None:
    install_methods(METHODS, "vllm_lens.frontend.persistent_hooks")
