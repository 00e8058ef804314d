"""Hostile lens requests against offline validation (Hypothesis): every class of malformed or
oversized input (``tests/fuzz_cases.py``) is refused with a ``LensRequestError`` naming its
field, without allocating what it claims."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz_cases import ADMISSION, CLASSES, CONTEXT, HIDDEN, N_LAYERS, any_case, each_class
from vllm_lens import LensRequestError
from vllm_lens.frontend.admission import check_admission
from vllm_lens.spec import ModelFacts, parse_extra_args

FACTS = ModelFacts(model_class="LlamaForCausalLM", n_layers=N_LAYERS, hidden_size=HIDDEN,
                   max_model_len=CONTEXT, mapped=True)
#: Reproducible (derandomized: CI sees the same examples on every run), no example database
#: written into the checkout, no per-example deadline (speed is not what is tested).
FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _refused(xargs: dict, field: str) -> LensRequestError:
    with pytest.raises(LensRequestError) as info:
        parse_extra_args(xargs, lambda: FACTS)
    assert info.value.field.startswith(field), (info.value.field, field, str(info.value))
    return info.value


def test_there_are_at_least_30_classes():
    assert len(CLASSES) + len(ADMISSION) >= 30


@settings(FUZZ, max_examples=400)
@given(any_case())
def test_every_hostile_request_is_refused_naming_its_field(case):
    _, (xargs, field) = case
    _refused(xargs, field)


@settings(FUZZ, max_examples=3)
@given(st.data())
def test_each_class_is_refused(data):
    for name, (xargs, field) in each_class(data.draw).items():
        error = _refused(xargs, field)
        assert str(error).startswith("vllm-lens: invalid"), name


@pytest.mark.parametrize("name", sorted(ADMISSION))
def test_admission_classes_are_refused_before_scheduling(name):
    xargs, field, body = ADMISSION[name]
    _, lens = parse_extra_args(xargs, lambda: FACTS)  # well-formed ...
    with pytest.raises(LensRequestError) as info:  # ... but too large for this server
        check_admission(lens, FACTS, prompt_len=6, max_tokens=body["max_tokens"],
                        n=body.get("n", 1))
    assert info.value.field == field


def test_the_well_formed_neighbours_are_accepted():
    """Control: the same forms, well-formed, pass (so refusals above are about the defect)."""
    import json

    import torch

    from tests.fuzz_cases import _good_json_vector, _good_vector, _wire_vector

    for xargs in ({"output_residual_stream": json.dumps({"layers": [1], "positions": "prompt[1:]",
                                                         "reduce": "mean"})},
                  {"apply_steering_vectors": _wire_vector(**_good_vector())},
                  {"apply_steering_vectors": json.dumps([_good_json_vector()])},
                  {"apply_steering_vectors": _wire_vector(**_good_vector(
                      activations=torch.ones(1, 2, HIDDEN), position_indices=[5, 9]))}):
        _, lens = parse_extra_args(xargs, lambda: FACTS)
        assert lens is not None
