"""Test-only fault injection (runs in: front end, worker).

With ``VLLM_LENS_TEST_FAULTS=1`` in the environment of the engine (front end and workers), a
request may carry ``extra_args["lens_test_fault"] = "<stage>"`` and the worker raises
``InjectedFault`` at that stage while handling it. The suite uses this to prove that an
exception anywhere in the lens path fails only the requests it concerns and the engine serves
on. Without the variable the key is refused like any unknown lens key.

With the same variable, ``VLLM_LENS_TEST_LAYOUT`` (JSON: model class -> ``Layout`` fields)
changes a model's layout when its taps are installed, so that the suite can prove the
start-up check (``worker.layout_check``) refuses a wrong one.
"""

from __future__ import annotations

from vllm_lens import envs

__all__ = ["FAULT_KEY", "STAGES", "InjectedFault", "check", "layout_override"]

FAULT_KEY = "lens_test_fault"
#: Where a fault can be injected, in the order a request meets them. ``step`` raises in the
#: tap outside every per-request stage: the whole step's lens requests fail. ``steer_groups``
#: raises while the step's steering of every request is joined (``worker.steer``).
STAGES = ("plan", "steer", "steer_groups", "steer_attention", "replace_mlp", "hooks", "capture",
          "step", "fetch", "handoff")


class InjectedFault(RuntimeError):
    """Raised on purpose by ``check`` (never outside tests)."""


def check(fault: str | None, stage: str) -> None:
    """Raise ``InjectedFault`` when a request asked for a fault at ``stage``."""
    if fault == stage and envs.test_faults():
        raise InjectedFault(f"fault injected at stage {stage!r} (VLLM_LENS_TEST_FAULTS)")


def layout_override(model_key: str) -> dict[str, object]:
    """The ``Layout`` fields ``VLLM_LENS_TEST_LAYOUT`` changes for ``model_key`` (tests only)."""
    import json

    raw = envs.test_layout()
    return dict(json.loads(raw).get(model_key, {})) if raw else {}
