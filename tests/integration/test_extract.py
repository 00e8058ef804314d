"""``vllm-lens extract``: a prompt file to an activation dataset on disk, equal to
transformers; bad rows listed (exit status 1, the good rows written); a re-run resumes."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.integration.reference import max_relative_error
from vllm_lens import datasets

pytestmark = pytest.mark.slow  # each test starts engines of its own

ENGINE = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "512",
          "--kv-cache-memory-bytes", str(256 << 20)]


def run_extract(model, source, output, *extra, points="resid_post,hook_attn_out", env=None):
    return subprocess.run(
        [sys.executable, "-m", "vllm_lens.cli", "extract", "--model", model, "--input",
         str(source), "--output", str(output), "--layers", "1,3", "--points", points,
         *extra, *ENGINE],
        capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


def assert_rows_equal_transformers(ex, ids, tiny_ref):
    """An example's rows, one per token of ``ids``, at layers 1 and 3 (``resid_post`` and
    ``attn_out``) equal transformers'; returns transformers' rows."""
    assert ex["positions"].tolist() == list(range(len(ids)))
    expected = tiny_ref.points(ids)
    for i, layer in enumerate((1, 3)):
        for point in ("resid_post", "attn_out"):
            assert max_relative_error(ex[point][i], expected[(point, layer)]) <= 1e-4
    return expected


def test_extract_writes_a_dataset_equal_to_transformers_and_resumes(tmp_path, tiny_path,
                                                                    tiny_ref):
    good = [{"prompt": "The capital of France is", "key": "fr"},
            {"prompt": "Once upon a time in a quiet village"},
            {"messages": [{"role": "user", "content": "Name three colours."}], "key": "chat"}]
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join([json.dumps(r) for r in good]
                                + ["not json", json.dumps({"prompt": ""}),
                                   json.dumps({"prompt": "again", "key": "fr"})]) + "\n")
    output = tmp_path / "acts"
    first = run_extract(tiny_path, source, output, "--max-tokens", "0")
    assert first.returncode == 1, first.stderr[-3000:]
    for line in ("line 4: not JSON", "line 5: needs a non-empty prompt",
                 "line 6: key 'fr' appears twice"):
        assert line in first.stderr
    ds = datasets.open(output)
    assert ds.keys() == ["fr", "2", "chat"]
    rows = sum(len(ex["positions"]) for ex in ds)
    assert f": 3 examples (3 new), {rows} rows, " in first.stderr  # the summary line
    assert ds.manifest["layers"] == [1, 3] and ds.manifest["dtype"] == "float32"
    assert ds.manifest["points"] == ["resid_post", "attn_out"]  # the alias, resolved
    chat = tiny_ref_tokenizer(tiny_path).apply_chat_template(
        good[2]["messages"], add_generation_prompt=True, tokenize=True)
    chat = chat["input_ids"] if hasattr(chat, "keys") else chat
    assert ds.get("chat")["prompt_token_ids"] == list(chat)
    for ex in ds:
        assert_rows_equal_transformers(ex, ex["prompt_token_ids"], tiny_ref)  # prompt rows only
    rows = ds.tensor("attn_out", 3)
    assert torch.equal(rows, torch.cat([ex["attn_out"][1] for ex in ds]))

    # More prompts, and a re-run: only the new keys are extracted.
    with source.open("a") as f:
        f.write(json.dumps({"prompt": "1, 2, 3, 4,", "key": "count"}) + "\n")
    second = run_extract(tiny_path, source, output, "--max-tokens", "0")
    assert "3 of 4 examples already written" in second.stderr, second.stderr[-3000:]
    assert ": 4 examples (1 new), " in second.stderr  # the summary line
    ds = datasets.open(output)
    assert ds.keys() == ["fr", "2", "chat", "count"]
    count = ds.get("count")
    expected = tiny_ref.points(count["prompt_token_ids"])
    assert max_relative_error(count["resid_post"][1], expected[("resid_post", 3)]) <= 1e-4
    other = run_extract(tiny_path, source, output, "--max-tokens", "0", "--positions",
                        "last_prompt")
    assert other.returncode != 0 and "made with positions='all'" in other.stderr


def test_extract_reduced_rows_with_generated_tokens(tmp_path, tiny_path, tiny_ref):
    """Also: the input is a Hugging Face dataset directory (``save_to_disk``), one split of
    two picked with ``--split``."""
    import datasets as hf

    source = tmp_path / "prompts"
    hf.DatasetDict({
        "train": hf.Dataset.from_dict({"key": ["a", "b"], "prompt": [
            "The capital of France is", "Once upon a time"]}),
        "unused": hf.Dataset.from_dict({"key": ["z"], "prompt": ["not this one"]}),
    }).save_to_disk(source)
    output = tmp_path / "acts"
    done = run_extract(tiny_path, source, output, "--split", "train", "--reduce", "mean",
                       "--max-tokens", "3", points="resid_post")
    assert done.returncode == 0, done.stderr[-3000:]
    assert datasets.open(output).keys() == ["a", "b"]
    for ex in datasets.open(output):
        entry = next(e for e in datasets.open(output).entries if e["key"] == ex["key"])
        ids = ex["prompt_token_ids"] + entry["token_ids"][:2]  # 3 generated, 2 run
        assert len(entry["token_ids"]) == 3 and ex["positions"].tolist() == list(range(len(ids)))
        expected = tiny_ref.points(ids)
        for i, layer in enumerate((1, 3)):
            mean = expected[("resid_post", layer)].mean(dim=0, keepdim=True)
            assert max_relative_error(ex["resid_post"][i], mean) <= 1e-4


def tiny_ref_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_extract_under_tensor_parallelism_equals_transformers(tmp_path, tiny_path, tiny_ref):
    """With -tp 2 the sink is written by TP rank 0, which holds the whole residual stream
    (and ``attn_out``, what attention adds after its all-reduce) and the SAE (``--sae``: its
    top features per row, equal to sae-lens' encode of transformers' rows, prompt and
    generated). The points split across the ranks are refused for sinks
    (``tests/unit/test_sinks.py``)."""
    from tests.integration.saes import saved_sae

    sae_dir = tmp_path / "sae"
    sae = saved_sae(sae_dir, "jumprelu", "blocks.2.hook_resid_post")
    source = tmp_path / "prompts.jsonl"
    source.write_text(json.dumps({"prompt": "The capital of France is", "key": "fr"}) + "\n")
    output = tmp_path / "acts"
    tp2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (CPU build)
    with_sae = ("--sae", str(sae_dir), "--top-k", "8", "--sae-reconstruction")
    done = run_extract(tiny_path, source, output, "--tensor-parallel-size", "2",
                       "--max-tokens", "3", *with_sae, env=tp2)
    assert done.returncode == 0, done.stderr[-3000:]
    ds = datasets.open(output)
    ex = ds.get("fr")
    ids = ex["prompt_token_ids"] + ex["token_ids"][:2]  # 3 generated, 2 run
    expected = assert_rows_equal_transformers(ex, ids, tiny_ref)
    (features,) = ex["sae_features"]
    assert ds.saes[0]["sae"] == str(sae_dir) and ds.saes[0]["layer"] == 2
    with torch.no_grad():
        dense = sae.encode(expected[("resid_post", 2)])
    top = dense.topk(8)
    torch.testing.assert_close(features["values"], top.values.clamp(min=0), rtol=1e-4, atol=1e-4)
    assert features["l0"].tolist() == (dense > 0).sum(-1).tolist()
    active = features["values"] > 0
    assert torch.equal(features["indices"][active], top.indices.int()[active])
    # Another top_k is another dataset: refused before any engine starts.
    other = run_extract(tiny_path, source, output, "--max-tokens", "3", "--sae", str(sae_dir),
                        "--top-k", "4", "--sae-reconstruction")
    assert other.returncode != 0 and "made with SAEs" in other.stderr, other.stderr[-2000:]


def test_extract_over_engines_of_vllm_dp_and_of_ray_writes_one_dataset(tmp_path, tiny_path,
                                                                         tiny_ref):
    """``--data-parallel-size 2`` (vLLM's own DP, on an ``AsyncLLM``), then a re-run with two
    more prompts over ``--ray --num-engines 2`` (Ray Data actors, each an engine, on a local
    Ray instance): one dataset, each engine a writer of its own, every example equal to
    transformers; the re-run resumes across writers (only the new keys run)."""
    prompts = ["The capital of France is", "Once upon a time in a quiet village",
               "1, 2, 3, 4,", "The quick brown fox", "Water boils at", "My favourite food is"]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": p, "key": f"k{i}"}) + "\n"
                              for i, p in enumerate(prompts)))
    output = tmp_path / "acts"
    two_cores = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per DP rank (CPU build)
    dp = run_extract(tiny_path, source, output, "--data-parallel-size", "2", "--batch-size",
                     "3", "--max-tokens", "2", env=two_cores)
    assert dp.returncode == 0, dp.stderr[-3000:]
    ds = datasets.open(output)
    assert sorted(ds.keys()) == [f"k{i}" for i in range(6)]
    dp_writers = {e["writer"] for e in ds.entries}
    assert len(dp_writers) == 2, dp_writers  # both engines got requests and wrote

    more = ["Roses are red,", "The largest planet is", "In 1492,", "Good morning! Today"]
    with source.open("a") as f:
        f.write("".join(json.dumps({"prompt": p, "key": f"k{6 + i}"}) + "\n"
                        for i, p in enumerate(more)))
    ray = run_extract(tiny_path, source, output, "--ray", "--num-engines", "2", "--batch-size",
                      "1", "--max-tokens", "2")
    assert ray.returncode == 0, ray.stderr[-3000:]
    assert "6 of 10 examples already written" in ray.stderr
    ds = datasets.open(output)
    assert sorted(ds.keys()) == sorted(f"k{i}" for i in range(10))
    writers = {e["writer"]: set() for e in ds.entries}
    for e in ds.entries:
        writers[e["writer"]].add(e["key"])
    assert set(writers) == dp_writers | {"ray0", "ray1"}, writers
    assert set().union(*(writers[w] for w in ("ray0", "ray1"))) == {"k6", "k7", "k8", "k9"}
    for ex in ds:
        entry = next(e for e in ds.entries if e["key"] == ex["key"])
        ids = ex["prompt_token_ids"] + entry["token_ids"][:1]  # 2 generated, 1 run
        assert_rows_equal_transformers(ex, ids, tiny_ref)
