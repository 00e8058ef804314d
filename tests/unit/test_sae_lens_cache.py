"""``vllm-lens extract --format sae-lens``: an activation dataset written in sae-lens' cached
activations layout, read back by sae-lens' own ``ActivationsStore`` (rows and tokens in
order, cut into contexts)."""

import pytest
import torch

from tests.sae_lens_reader import read_with_sae_lens
from vllm_lens import datasets
from vllm_lens.dataset.sae_lens_cache import write_sae_lens_cache
from vllm_lens.dataset.writer import ShardWriter

MANIFEST = {"model": "tiny", "points": ["resid_post", "attn_out"], "layers": [2, 4],
            "dtype": "bfloat16", "row_shapes": {"resid_post": [8], "attn_out": [8]},
            "positions": "all", "reduce": None}


def dataset(root):
    """Five examples of 2-4 prompt rows and a generated row each, over several shards."""
    g = torch.Generator().manual_seed(3)
    rows, tokens = [], []
    with ShardWriter(root, MANIFEST, rows_per_shard=4) as w:
        for i in range(5):
            n_prompt = 2 + i % 3
            prompt, generated = list(range(100 * i, 100 * i + n_prompt)), [100 * i + 50, 7]
            example = {p: torch.randn(2, n_prompt + 1, 8, generator=g) for p in MANIFEST["points"]}
            w.add(f"k{i}", example, positions=range(n_prompt + 1), prompt_token_ids=prompt,
                  token_ids=generated)
            rows.append(example["resid_post"][1])
            tokens += [*prompt, generated[0]]
    return datasets.open(root), torch.cat(rows).to(torch.bfloat16).float(), tokens


def test_sae_lens_reads_the_rows_and_tokens_in_order(tmp_path):
    ds, rows, tokens = dataset(tmp_path / "acts")
    out = tmp_path / "cache"
    made = write_sae_lens_cache(ds, out, context_size=4, point="resid_post", layer=4)
    n = len(tokens) // 4
    assert made == {"hook_name": "blocks.4.hook_resid_post", "contexts": n, "tokens": 4 * n,
                    "dropped": len(tokens) - 4 * n, "d_in": 8, "dtype": "float32"}
    acts, ids = read_with_sae_lens(out, "blocks.4.hook_resid_post", 4, 8, n)
    torch.testing.assert_close(acts, rows[:4 * n], rtol=0, atol=0)
    assert ids.tolist() == tokens[:4 * n]
    # Written again (a resumed job): replaced, not added to.
    assert write_sae_lens_cache(ds, out, context_size=4, point="resid_post", layer=4) == made
    assert len(list(out.glob("data-*.arrow"))) == 1


def test_what_sae_lens_cannot_train_on_is_refused(tmp_path):
    ds, _, _ = dataset(tmp_path / "acts")
    with pytest.raises(ValueError, match=r"2 points \(\['resid_post', 'attn_out'\]\): name one"):
        write_sae_lens_cache(ds, tmp_path / "c", 4)
    with pytest.raises(ValueError, match="not mlp_out at 2"):
        write_sae_lens_cache(ds, tmp_path / "c", 4, point="mlp_out", layer=2)
    with pytest.raises(ValueError, match="context_size must be >= 1"):
        write_sae_lens_cache(ds, tmp_path / "c", 0, point="resid_post", layer=2)
