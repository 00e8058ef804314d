"""Tensor parallel 2 on every family, against transformers: every tap point the family has
(heads and MLP columns joined from both ranks, a single key head replicated on both), Q/K
attention patterns, and 2D/3D steering (applied on both ranks); MoE experts are split across
the ranks, their router replicated. Eager engines, one worker per core.

Marked ``families``: the second step of ``make test`` (``pytest -m families``); a plain
``pytest`` (whose default options hold ``-m 'not families'``) leaves these out, also when
named by path."""

import pytest

from tests.families import FAMILIES, tiny_family_dir
from tests.integration import test_families as single
from tests.integration.engines import env, running_llm
from tests.integration.reference import HFReference
from vllm_lens.common.messages import DescribeAnswer, read_all

#: The families run here (``tools/family_matrix.py`` reads this for its TP=2 column).
TP_FAMILIES = tuple(sorted(FAMILIES))

pytestmark = [pytest.mark.slow, pytest.mark.families]


@pytest.fixture(scope="module", params=TP_FAMILIES)
def family(request):
    path = tiny_family_dir(request.param)
    with env(VLLM_CPU_OMP_THREADS_BIND="0|1"), running_llm(
            path, tensor_parallel_size=2, enforce_eager=True, **single.CHUNKED) as llm:
        describe = read_all(DescribeAnswer, llm.collective_rpc("lens_describe"))
        assert [d.tp_rank for d in describe] == [0, 1]
        yield request.param, path, llm, HFReference(path)


def test_tp2_every_point_and_attention_match_transformers(family):
    single.test_every_layer_every_point_and_attention_match_transformers(family)


def test_tp2_steering_matches_transformers(family):
    single.test_2d_and_3d_steering_match_transformers(family)


def test_tp2_a_stop_monitor_stops_where_the_transformers_scores_cross(family):
    single.test_a_stop_monitor_stops_where_the_transformers_scores_cross(family)


def test_tp2_attention_steering_matches_transformers(family):
    """Each rank steers its own head (the key head replicated on both)."""
    single.test_attention_steering_matches_transformers(family)


def test_tp2_ablation_and_cap_match_transformers(family):
    """Applied on both ranks, on the whole stream."""
    single.test_ablation_and_cap_match_transformers(family)
