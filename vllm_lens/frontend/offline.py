"""Lens support for the synchronous engine behind ``LLM.generate`` / ``LLM.chat`` (runs in: front
end).

``LLM`` feeds every request through ``LLMEngine.add_request`` and collects results from
``LLMEngine.step``, so wrapping those two (plus ``abort_request``) covers both entry points:
validation happens before the request enters the engine, and a finished request's activations
are fetched from the workers in the same step call that reports it finished.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from vllm import SamplingParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.llm_engine import LLMEngine

from vllm_lens.common.messages import FetchAnswer, read_all
from vllm_lens.common.wrapping import wrap_attribute
from vllm_lens.frontend.admission import check_admission
from vllm_lens.errors import LensRequestError
from vllm_lens.frontend import collator
from vllm_lens.frontend.presets import Presets
from vllm_lens.frontend.session import LensSession, prompt_length
from vllm_lens.frontend.sae_names import offline_describer
from vllm_lens.spec import LensRequest, parse_extra_args
from vllm_lens.spec.monitors import check_sampling
from vllm_lens.spec.facts import facts_from_describe

__all__ = ["OfflineCall", "install"]


@dataclasses.dataclass
class OfflineCall:
    """What an ``LLMEngine`` keeps between ``LLM.generate`` checking its requests and adding
    them (its ``LensSession.feature``)."""

    describe_sae: Any = None
    """``(sae, hook_point) -> description``: loads an SAE on the workers (``spec.saes``)."""
    parsed_by_params: dict[int, tuple[Mapping[str, Any], LensRequest]] = dataclasses.field(
        default_factory=dict)
    """During one call: ``id(SamplingParams)`` -> (its ``extra_args``, the lens request parsed
    from them), so each request's values are parsed once."""

    @staticmethod
    def of(engine: LLMEngine) -> OfflineCall:
        call = LensSession.of(engine).feature(OfflineCall)
        if call.describe_sae is None:
            call.describe_sae = offline_describer(engine)
        return call


def install() -> None:
    from vllm.entrypoints.common.offline import OfflineInferenceMixin

    wrap_attribute(OfflineInferenceMixin, "_render_and_add_requests", _wrap_render_and_add)
    wrap_attribute(LLMEngine, "add_request", _wrap_add_request)
    wrap_attribute(LLMEngine, "step", _wrap_step)
    wrap_attribute(LLMEngine, "abort_request", _wrap_abort_request)


def _wrap_render_and_add(original):
    """``LLM.generate`` / ``LLM.chat`` add their requests one by one; every request's lens keys
    are checked first, so a bad one fails the call before any request runs, with an error that
    names its index in the caller's list (not vLLM's internal request id)."""

    def render_and_add(self, prompts, params, *args, **kwargs):
        # Every request add_request would parse (a misspelt key alone is no lens key).
        if not any(isinstance(p, SamplingParams) and p.extra_args for p in params):
            return original(self, prompts, params, *args, **kwargs)
        engine = self.llm_engine
        session = LensSession.of(engine)
        call = OfflineCall.of(engine)
        presets = Presets.of(session).specs
        prompts = list(prompts)  # engine inputs, tokenized: admission needs their lengths
        parsed: dict[int, tuple[Any, Any]] = {}
        sinks: set[Any] = set()  # of the requests before this one: two may not write one example
        for index, p in enumerate(params):
            if not isinstance(p, SamplingParams) or not p.extra_args:
                continue
            if session.needs_facts(p):
                session.facts = facts_from_describe(engine.collective_rpc("lens_describe"))
            try:
                if id(p) not in parsed:
                    _, lens = parse_extra_args(p.extra_args, lambda: session.facts,
                                                presets=presets, saes=call.describe_sae)
                    parsed[id(p)] = (dict(p.extra_args), lens)
                lens = parsed[id(p)][1]
                if lens is not None:
                    session.check_beside(lens, p.n, added=sinks)
                    check_sampling(lens.monitors, p)
                    sinks.add(lens.sink)
                if lens is not None and index < len(prompts):
                    check_admission(lens, session.facts, prompt_length(prompts[index]),
                                    p.max_tokens, p.n)
            except LensRequestError as exc:
                raise type(exc)(exc.field, exc.problem, index=index) from None
        # add_request reuses these instead of parsing every request's values again.
        call.parsed_by_params = {k: v for k, v in parsed.items() if v[1] is not None}
        try:
            return original(self, prompts, params, *args, **kwargs)
        finally:
            call.parsed_by_params = {}

    return render_and_add


def _wrap_add_request(original):
    def add_request(self: LLMEngine, request_id: str, prompt: Any, params: Any, *args, **kwargs):
        session = LensSession.of(self)
        call = OfflineCall.of(self)
        target = prompt.sampling_params if isinstance(prompt, EngineCoreRequest) else params
        if session.needs_facts(target):
            session.facts = facts_from_describe(self.collective_rpc("lens_describe"))
        engine_params, _ = session.prepare(target, request_id, prompt,
                                           call.parsed_by_params.get(id(target)),
                                           call.describe_sae, Presets.of(session).specs)
        if isinstance(prompt, EngineCoreRequest):
            prompt.sampling_params = engine_params  # the request object is the engine's own
        else:
            params = engine_params
        try:
            return original(self, request_id, prompt, params, *args, **kwargs)
        except BaseException:
            session.forget([request_id])
            raise

    return add_request


def _wrap_step(original):
    def step(self: LLMEngine):
        outputs = original(self)
        session = LensSession.of(self)
        if not session.in_flight:
            return outputs
        done = [o for o in outputs if o.finished and o.request_id in session.in_flight]
        if not done:
            return outputs
        lenses = [session.in_flight[o.request_id] for o in done]
        session.forget([o.request_id for o in done])
        captured = [(o, lens) for o, lens in zip(done, lenses) if lens.needs_fetch]
        if not captured:
            return outputs
        args = [
            session.fetch_args(
                lens,
                len(o.prompt_token_ids or ()),
                {c.index: len(c.token_ids) for c in o.outputs},
                len(o.outputs),
                (o.prompt_token_ids or (), o.outputs[0].token_ids if o.outputs else ()),
            )
            for o, lens in captured
        ]
        try:
            results = read_all(FetchAnswer, self.collective_rpc(
                "lens_fetch", args=session.fetch_rpc_args(args)))
        except Exception as exc:  # these requests fail, the batch goes on
            for o, lens in captured:
                collator.fail_output(o, lens, exc)
            return outputs
        try:
            for o, lens in captured:
                try:
                    collator.attach(o, lens, results, len(o.outputs), session.facts)
                except Exception as exc:  # this request's results only: the batch goes on
                    collator.fail_output(o, lens, exc)
        finally:
            collator.discard_unread(results)
        return outputs

    return step


def _wrap_abort_request(original):
    def abort_request(self: LLMEngine, request_ids: list[str], internal: bool = False):
        result = original(self, request_ids, internal)
        keys = LensSession.of(self).forget(request_ids)
        if keys:
            self.collective_rpc("lens_release", args=(keys,))
        return result

    return abort_request
