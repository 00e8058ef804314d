"""``vllm_lens.plot`` (no engine): each figure shows what it was given — the pattern's
weights as the image, the grid's top tokens and probabilities, the tokens' colours ordered by
their scores, the features' labels, the attribution's bars — and saves as a PNG."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_lens import plot


def test_attention_pattern_shows_the_weights_of_the_chosen_heads(tmp_path):
    pattern = torch.softmax(torch.randn(4, 5, 5), dim=-1).tril()
    tokens = ["a", "b", "c", "d", "e"]
    fig = plot.attention_pattern(pattern, tokens, heads=[1, 3], layer=2)
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["layer 2, head 1", "layer 2, head 3"]
    for ax, head in zip(panels, (1, 3)):
        shown = torch.tensor(ax.images[0].get_array(), dtype=torch.float32)
        assert torch.allclose(shown, pattern[head])
        assert [t.get_text() for t in ax.get_xticklabels()] == tokens
    one = plot.attention_pattern(pattern[0], tokens)
    assert len([ax for ax in one.axes if ax.get_title()]) == 1
    every = plot.attention_pattern(pattern, tokens)
    assert len([ax for ax in every.axes if ax.get_title()]) == 4
    fig.savefig(tmp_path / "pattern.png")
    assert (tmp_path / "pattern.png").read_bytes()[:4] == b"\x89PNG"


def test_logit_lens_grid_has_a_cell_per_layer_and_position():
    saved = {"token_ids": {"3": torch.tensor([[5, 1], [6, 2]]), "1": torch.tensor([[7, 1],
                                                                                  [8, 2]])},
             "logprobs": {"3": torch.tensor([[-0.1, -3.0], [-1.0, -2.0]]),
                          "1": torch.tensor([[-2.0, -3.0], [-0.5, -2.0]])}}
    fig = plot.logit_lens(saved, ["x", "y"], decode=lambda i: f"t{i}")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.texts] == ["t7", "t8", "t5", "t6"]  # layer 1 first
    grid = torch.tensor(ax.images[0].get_array(), dtype=torch.float64)
    assert torch.allclose(grid, torch.tensor([[math.exp(-2.0), math.exp(-0.5)],
                                              [math.exp(-0.1), math.exp(-1.0)]],
                                             dtype=torch.float64))
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1", "3"]
    # Rows of generated positions (past the tokens given) are labelled by their number.
    saved["positions"] = {"1": torch.tensor([1, 2]), "3": torch.tensor([1, 2])}
    ax = plot.logit_lens(saved, ["x", "$y$"]).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["$y$", "2"]


def test_token_scores_colour_by_score_and_refuse_a_mismatch():
    from matplotlib import colormaps

    fig = plot.token_scores(["low", "mid", "high"], torch.tensor([-2.0, 0.0, 1.0]))
    faces = [tuple(p.get_facecolor()) for p in fig.axes[0].patches]
    cmap = colormaps["RdBu_r"]  # symmetric around 0: -2 the bottom, 1 three quarters up
    for face, at in zip(faces, (0.0, 0.5, 0.75)):
        assert face == pytest.approx(tuple(cmap(at)), abs=1e-2)
    with pytest.raises(ValueError, match="3 tokens but 2 scores"):
        plot.token_scores(["a", "b", "c"], [1.0, 2.0])


def test_top_features_and_attribution_bars():
    entry = {"sae": "l10", "positions": torch.tensor([4, 5]),
             "indices": torch.tensor([[1, 2, 3], [9, 8, -1]]),
             "values": torch.tensor([[3.0, 2.0, 1.0], [5.0, 4.0, 0.0]]),
             "labels": {8: "the sea"}}
    ax = plot.top_features(entry, position=1).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["9", "8: the sea"]
    assert [p.get_width() for p in ax.patches] == [5.0, 4.0]
    assert ax.get_title() == "l10: top features at position 5"
    with pytest.raises(ValueError, match="no position"):
        plot.top_features({**entry, "positions": torch.tensor([], dtype=torch.long),
                           "indices": torch.zeros(0, 3), "values": torch.zeros(0, 3)})
    result = {"layers": [0, 1, 2], "positions": torch.tensor([0, 1]),
              "tokens": torch.tensor([11, 12]), "embed": torch.tensor([0.0, 1.0]),
              "attn_out": torch.tensor([[0.0, 1.0], [0.0, 2.0], [0.0, 3.0]]),
              "mlp_out": torch.tensor([[0.0, -1.0], [0.0, 0.5], [0.0, 0.5]])}
    ax = plot.logit_attribution(result, position=1, decode=lambda i: f"<{i}>").axes[0]
    heights = [p.get_height() for p in ax.patches]
    assert heights == [1.0, 1.0, 2.0, 3.0, -1.0, 0.5, 0.5]
    assert ax.get_title() == "direct effect on the logit of <12> at position 1 (total 7)"


def test_side_by_side_wraps_both_texts():
    fig = plot.side_by_side("word " * 30, "short", titles=("a", "b"), width=20)
    left, right = (ax.texts[0].get_text() for ax in fig.axes)
    assert max(len(line) for line in left.splitlines()) <= 20 and right == "short"
