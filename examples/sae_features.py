"""SAE features end to end: extract activations with vLLM, train an SAE on them with sae-lens,
serve its features per token, find what a few features respond to, and steer and clamp one.

    python examples/sae_features.py [--layer 10] [--d-sae 2304] [--steps 1500] \\
        [--workdir sae_features] [--out sae_features.png]

1. ``vllm-lens extract --format sae-lens`` runs SmolLM2 on 144 short texts (its own
   continuations of varied openings) and writes the residual stream after ``--layer`` in
   sae-lens' cached-activations layout.
2. sae-lens trains a ReLU SAE on those rows (``ActivationsStore`` reading the cache,
   ``SAETrainer``: a couple of minutes on two cores) and saves it.
3. The engine serves the SAE's features per token (``output_sae_features``): they equal
   sae-lens' own ``encode`` of the rows vLLM extracted.
4. The features that fire most sharply over the texts are listed with their top tokens, and
   drawn (``--out``: each feature's strongest contexts, tokens shaded by its activation).
5. One feature is steered (``{"sae", "feature", "scale"}``: its decoder row added) and
   clamped (``{"sae", "feature", "clamp"}``: set to a value at every position, the SAE's error
   kept); the texts are printed with how strongly that feature fires when they are read back.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

ENGINE = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes",
          str(512 << 20), "--enforce-eager"]
TOPICS = ["the ocean", "a busy city at night", "baking bread", "the French Revolution",
          "black holes", "a football match", "a lazy cat", "learning Python", "climbing a "
          "mountain", "jazz music", "the stock market", "a rainy afternoon", "the human heart",
          "an old library", "volcanoes", "a birthday party", "the moon landing", "chess",
          "a medieval castle", "coffee", "the Amazon rainforest", "electric cars",
          "a job interview", "winter in Norway"]
OPENINGS = ["Here is a short paragraph about {}:", "A few facts about {}.",
            "Write a sentence about {}.", "My favourite thing about {} is",
            "The history of {} begins", "Once upon a time, near {},"]


def corpus(path: Path) -> int:
    """The texts SmolLM2 continues: every opening for every topic (a JSONL prompt file)."""
    rows = [{"key": f"{t}|{o}", "prompt": o.format(t)} for t in TOPICS for o in OPENINGS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def extract(model: str, layer: int, prompts: Path, output: Path, max_tokens: int,
            context_size: int) -> None:
    """Step 1, as a user runs it (a re-run finds every key written and skips the engine).
    The first position (the attention sink, a row unlike any other) is left out."""
    command = [sys.executable, "-m", "vllm_lens.cli", "extract", "--model", model,
               "--input", str(prompts), "--output", str(output), "--layers", str(layer),
               "--points", "resid_post", "--positions", "all[1:]", "--max-tokens",
               str(max_tokens), "--format", "sae-lens", "--context-size", str(context_size),
               *ENGINE]
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True)


def train(cache: Path, layer: int, d_sae: int, steps: int, context_size: int,
          output: Path) -> None:
    """Step 2: a ReLU SAE trained by sae-lens on the cached rows, saved for inference.
    sae-lens scales the rows to norm sqrt(d_in) while it trains and folds that scale into
    the weights at the end, so the saved SAE reads the model's rows as they are."""
    import datasets as hf
    from sae_lens.config import LoggingConfig, SAETrainerConfig
    from sae_lens.saes.standard_sae import StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.training.activations_store import ActivationsStore
    from sae_lens.training.sae_trainer import SAETrainer

    hook = f"blocks.{layer}.hook_resid_post"
    d_in = hf.load_from_disk(str(cache)).features[hook].shape[1]
    n_contexts = len(hf.load_from_disk(str(cache)))
    # sae-lens' own reader of the cache, once over it: the rows fit in memory here.
    store = ActivationsStore(
        model=None, dataset=None, streaming=False, hook_name=hook, hook_head_index=None,
        context_size=context_size, d_in=d_in, n_batches_in_buffer=1,
        total_training_tokens=n_contexts * context_size, store_batch_size_prompts=n_contexts,
        train_batch_size_tokens=n_contexts * context_size, prepend_bos=False,
        normalize_activations="none", device=torch.device("cpu"), dtype="float32",
        cached_activations_path=str(cache))
    rows, _ = store.get_raw_llm_batch()
    batch = 512

    def batches():
        g = torch.Generator().manual_seed(0)
        while True:
            for chunk in torch.randperm(rows.shape[0], generator=g).split(batch):
                if chunk.numel() == batch:
                    yield rows[chunk]

    cfg = StandardTrainingSAEConfig(d_in=d_in, d_sae=d_sae, l1_coefficient=6.0,
                                    l1_warm_up_steps=steps // 10, dtype="float32",
                                    device="cpu", normalize_activations="expected_average_only_in")
    cfg.metadata.hook_name = hook
    torch.manual_seed(0)
    sae = StandardTrainingSAE(cfg)
    trainer = SAETrainer(
        SAETrainerConfig(total_training_samples=steps * batch, train_batch_size_samples=batch,
                         lr=1e-3, lr_end=1e-4, lr_warm_up_steps=steps // 20,
                         lr_decay_steps=steps // 5,
                         lr_scheduler_name="constant", n_batches_for_norm_estimate=20,
                         logger=LoggingConfig(log_to_wandb=False)),
        sae, data_provider=batches())
    print(f"training a {d_in} -> {d_sae} ReLU SAE with sae-lens on {n_contexts * context_size} "
          f"rows ({steps} steps of {batch})", flush=True)
    sae = trainer.fit()
    sae.save_inference_model(output)


def serve(llm, sae_dir: Path, rows_dir: Path, top_k: int) -> tuple[list, float, float]:
    """Step 3: the engine reads the SAE's features of every text (the tokens extraction ran,
    sent back as prompts); they equal sae-lens' ``encode`` of the rows vLLM extracted.
    Returns ([(token ids, entry)] per text, max |served - sae-lens|, mean NMSE)."""
    from sae_lens.saes.sae import SAE
    from vllm import SamplingParams

    from vllm_lens import datasets

    ds = datasets.open(rows_dir)
    texts = [ex["prompt_token_ids"] + ex["token_ids"][:-1] for ex in ds]
    sp = SamplingParams(max_tokens=1, temperature=0, extra_args={"output_sae_features": {
        "sae": str(sae_dir), "positions": "prompt[1:]", "top_k": top_k,
        "reconstruction": True}})
    outs = llm.generate([{"prompt_token_ids": ids} for ids in texts], sp, use_tqdm=False)
    reference = SAE.load_from_disk(str(sae_dir))
    worst, nmse = 0.0, []
    for ex, out in zip(ds, outs):
        (entry,) = out.sae_features
        assert entry["positions"].tolist() == ex["positions"].tolist()
        with torch.no_grad():
            dense = reference.encode(ex["resid_post"][0].float())
        top = dense.topk(top_k)
        worst = max(worst, float((top.values.clamp(min=0) - entry["values"]).abs().max()))
        nmse.append(entry["nmse"])
    return ([(ids, out.sae_features[0]) for ids, out in zip(texts, outs)], worst,
            float(torch.cat(nmse).mean()))


def pick_features(served: list, d_sae: int, how_many: int) -> list[int]:
    """Step 4: features that fire strongly in many texts but not everywhere: ranked by their
    fifth-strongest text (each text counted by its highest value), among those active on at
    most 5 % of the tokens."""
    per_text = torch.zeros(len(served), d_sae)
    count = torch.zeros(d_sae)
    for row, (_, entry) in enumerate(served):
        active = entry["indices"] >= 0
        idx, val = entry["indices"][active].long(), entry["values"][active]
        per_text[row].scatter_reduce_(0, idx, val, reduce="amax")
        count.index_add_(0, idx, torch.ones_like(val))
    n_tokens = sum(entry["indices"].shape[0] for _, entry in served)
    fifth = per_text.topk(5, dim=0).values[-1]
    fifth[count > 0.05 * n_tokens] = 0
    order = torch.argsort(fifth, descending=True)
    return [int(i) for i in order[:how_many] if fifth[i] > 0]


def strongest(served: list, feature: int, n: int) -> list[tuple[float, list[int], int, dict]]:
    """The ``n`` tokens where ``feature`` fires most (at most one per text): (value, the
    text's token ids, the position, its entry)."""
    found = []
    for ids, entry in served:
        hit = entry["indices"] == feature
        if hit.any():
            values = torch.where(hit, entry["values"], torch.zeros(())).sum(-1)
            at = int(values.argmax())
            found.append((float(values[at]), ids, int(entry["positions"][at]), entry))
    return sorted(found, key=lambda f: -f[0])[:n]


def activation(entry: dict, feature: int) -> torch.Tensor:
    """``feature``'s value at each position of an entry (0 where it is not in the top k)."""
    hit = entry["indices"] == feature
    return torch.where(hit, entry["values"], torch.zeros(())).sum(-1)


def describe(tokenizer, served: list, features: list[int]) -> None:
    for feature in features:
        tops = strongest(served, feature, 5)
        shown = [f"{tokenizer.decode([ids[p]])!r} ({v:.1f})" for v, ids, p, _ in tops]
        print(f"feature {feature}: {', '.join(shown)}")


def draw(tokenizer, served: list, features: list[int], out: Path) -> None:
    """Each feature's strongest contexts, every token shaded by the feature's value there."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = []
    for feature in features:
        tops = strongest(served, feature, 3)
        peak = max(v for v, *_ in tops)
        lines.append((f"feature {feature}", None, None))
        for _, ids, at, entry in tops:
            values = dict(zip(entry["positions"].tolist(), activation(entry, feature).tolist()))
            window = range(max(1, at - 10), min(len(ids), at + 6))
            lines.append(([tokenizer.decode([ids[p]]) for p in window],
                          [values.get(p, 0.0) / peak for p in window], None))
    fig = plt.figure(figsize=(11, 0.32 * len(lines) + 0.4))
    renderer = fig.canvas.get_renderer()
    for row, (tokens, shades, _) in enumerate(lines):
        y = 1 - (row + 0.8) / (len(lines) + 0.4)
        if shades is None:
            fig.text(0.01, y, tokens, fontsize=10, weight="bold", family="monospace")
            continue
        x = 0.03
        for token, shade in zip(tokens, shades):
            text = fig.text(x, y, token.replace("\n", "\\n").replace("$", r"\$"),
                            fontsize=9, family="monospace",
                            bbox={"facecolor": (1.0, 1 - 0.8 * shade, 1 - 0.9 * shade),
                                  "edgecolor": "none", "pad": 1.5})
            box = text.get_window_extent(renderer)
            x += box.width / fig.bbox.width + 0.002
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def steer(llm, tokenizer, sae_dir: Path, feature: int, peak: float) -> dict[str, float]:
    """Step 5: the same prompt plain, steered by the feature (its decoder row times half its
    peak value added at every position) and clamped to that value (set to it at every
    position: where the feature is off, the same edit; where it already fires, only the
    difference is added); each text is then read back, unsteered, for how strongly the
    feature fires on it. Returns the mean read-back value per variant."""
    from vllm import SamplingParams

    prompt = "My favourite thing about the weekend is"
    ids = tokenizer.encode(prompt)
    value = round(peak / 2)
    variants = {
        "plain": [],
        f"scale {value}": [{"sae": str(sae_dir), "feature": feature, "scale": value}],
        f"clamp {value}": [{"sae": str(sae_dir), "feature": feature, "clamp": value}],
    }
    read_back = {}
    for name, items in variants.items():
        extra = {"apply_steering_vectors": items} if items else {}
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
            max_tokens=32, temperature=0, extra_args=extra), use_tqdm=False)[0]
        generated = list(out.outputs[0].token_ids)
        again = llm.generate([{"prompt_token_ids": ids + generated}], SamplingParams(
            max_tokens=1, extra_args={"output_sae_features": {
                "sae": str(sae_dir), "positions": f"prompt[{len(ids)}:]", "top_k": 64}}),
            use_tqdm=False)[0]
        read_back[name] = float(activation(again.sae_features[0], feature).mean())
        print(f"[{name} | feature {feature} reads {read_back[name]:.2f}] "
              f"{prompt}{tokenizer.decode(generated)!r}")
    return read_back


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", type=int, default=10, help="the layer the SAE reads")
    parser.add_argument("--d-sae", type=int, default=2304, help="the SAE's features")
    parser.add_argument("--steps", type=int, default=1500,
                        help="training steps (of 512 rows)")
    parser.add_argument("--max-tokens", type=int, default=48,
                        help="tokens SmolLM2 writes after each opening")
    parser.add_argument("--workdir", type=Path, default=Path("sae_features"),
                        help="where the activations and the SAE are written")
    parser.add_argument("--out", type=Path, default=Path("sae_features.png"),
                        help="the picture of the features' strongest contexts")
    args = parser.parse_args()

    from vllm import LLM

    from vllm_lens.demo_models import smollm2_dir

    model = str(smollm2_dir())
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    n_texts = corpus(work / "texts.jsonl")
    cache = work / "acts"
    extract(model, args.layer, work / "texts.jsonl", cache, args.max_tokens, 64)
    sae_dir = work / "sae"
    if (sae_dir / "cfg.json").exists():  # a re-run: delete it to train again
        print(f"using the SAE trained before in {sae_dir}")
    else:
        train(cache, args.layer, args.d_sae, args.steps, 64, sae_dir)

    llm = LLM(model=model, dtype="float32", max_model_len=512,
              kv_cache_memory_bytes=512 << 20, enforce_eager=True)
    tokenizer = llm.get_tokenizer()
    served, worst, nmse = serve(llm, sae_dir, cache / "vllm-lens-rows", top_k=16)
    print(f"served the features of {n_texts} texts; max |served - sae-lens encode of the "
          f"extracted rows| = {worst:.2e}; mean NMSE of the SAE's reconstruction {nmse:.3f}")
    features = pick_features(served, args.d_sae, 4)
    describe(tokenizer, served, features)
    draw(tokenizer, served, features, args.out)
    peak = strongest(served, features[0], 1)[0][0]
    read_back = steer(llm, tokenizer, sae_dir, features[0], peak)
    print(json.dumps({"max_difference": worst, "nmse": nmse, "features": features,
                      "read_back": read_back}))


if __name__ == "__main__":
    main()
