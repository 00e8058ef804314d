"""Make the pictures of docs/pictures.md with ``vllm_lens.plot``, from runs on the embedded model
(SmolLM2-135M-Instruct, eager, on this machine's CPU); each request is the one the page shows.

    PYTHONPATH=. python tools/make_doc_pictures.py     # writes docs/pictures/*.png

A random JumpReLU SAE (sae-lens' format, seeded) stands in for a trained one: its features'
numbers mean nothing, the pictures show their layout.
"""
import sys
import tempfile
from pathlib import Path

import torch
from vllm import LLM, SamplingParams

from vllm_lens import NamedHook
from vllm_lens.attention import attention_patterns
from vllm_lens.demo_models import smollm2_dir
from vllm_lens.plot import (
    attention_pattern,
    logit_attribution,
    logit_lens,
    side_by_side,
    token_scores,
    top_features,
)
from vllm_lens.recipes import contrastive_vector

OUT = Path(__file__).resolve().parents[1] / "docs" / "pictures"


def _random_sae(path: Path) -> None:
    from sae_lens import JumpReLUSAEConfig
    from sae_lens.saes.sae import SAE

    cfg = JumpReLUSAEConfig(d_in=576, d_sae=2304, dtype="float32", device="cpu")
    sae = SAE.get_sae_class_for_architecture(cfg.architecture())(cfg)
    sae.cfg.metadata.hook_name = "blocks.12.hook_resid_post"
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in sae.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.05)
        sae.threshold.copy_(torch.rand(2304, generator=g) * 2.0)
    sae.save_model(path)


def main() -> int:
    OUT.mkdir(exist_ok=True)
    llm = LLM(smollm2_dir(), dtype="float32", max_model_len=1024, enforce_eager=True,
              kv_cache_memory_bytes=1 << 29)
    tokenizer = llm.get_tokenizer()
    prompt = "The Eiffel Tower is located in the city of"
    ids = tokenizer.encode(prompt)
    tokens = [tokenizer.decode([t]) for t in ids]

    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, extra_args={
        "output_qk": [9], "apply_hooks": [NamedHook("logit_lens_topk", list(range(0, 30, 3)),
                                                    {"k": 1})]}))[0]
    pattern = attention_patterns(out.activations, 9)
    attention_pattern(pattern, tokens, heads=[0, 1, 2, 3], layer=9).savefig(
        OUT / "attention_pattern.png", dpi=90)
    saved = out.hook_results["0"]
    logit_lens(saved, tokens, decode=lambda t: tokenizer.decode([t])).savefig(
        OUT / "logit_lens.png", dpi=90)

    attribution = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, extra_args={
        "output_logit_attribution": {"positions": "last_prompt"}}))[0].logit_attribution
    logit_attribution(attribution, decode=lambda t: repr(tokenizer.decode([t]))).savefig(
        OUT / "logit_attribution.png", dpi=90)

    with tempfile.TemporaryDirectory() as tmp:
        sae_dir = Path(tmp) / "sae"
        _random_sae(sae_dir)
        text = "My favourite thing about the weekend is going to the sea"
        found = llm.generate([text], SamplingParams(max_tokens=1, temperature=0, extra_args={
            "output_sae_features": {"sae": str(sae_dir), "positions": "prompt[1:]",
                                    "top_k": 8}}))[0]
        features, text_ids = found.sae_features[0], found.prompt_token_ids
        feature = int(features["indices"][-1, 0])
        values = [float(v[i == feature].sum()) for i, v in zip(features["indices"],
                                                               features["values"])]
        shown = [tokenizer.decode([text_ids[p]]) for p in features["positions"].tolist()]
        token_scores(shown, values, title=f"random SAE feature {feature} at each token"
                     ).savefig(OUT / "token_scores.png", dpi=90)
        top_features(features).savefig(OUT / "top_features.png", dpi=90)

    happy = ["I love this, it makes me so happy.", "What a wonderful, joyful day!"]
    sad = ["I hate this, it makes me so sad.", "What a terrible, miserable day!"]
    sv = contrastive_vector(llm, happy, sad, layers=[10], normalize=True, scale=0.5,
                            norm_match=True)
    plain, steered = llm.generate(["I think that"] * 2, [
        SamplingParams(max_tokens=32, temperature=0),
        SamplingParams(max_tokens=32, temperature=0,
                       extra_args={"apply_steering_vectors": [sv]})])
    side_by_side(plain.outputs[0].text, steered.outputs[0].text,
                 titles=("plain", "steered (happy - sad, layer 10)")).savefig(
        OUT / "side_by_side.png", dpi=90)
    print("wrote", sorted(p.name for p in OUT.glob("*.png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
