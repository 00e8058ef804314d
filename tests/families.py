"""Tiny random checkpoints of the model families the suite proves, built from transformers
configs (no downloads; the tokenizer is SmolLM2's, so prompts are real text)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from vllm_lens.demo_models import _publish, cache_root, smollm2_dir

#: What every tiny model shares: 4 layers, hidden 128, 2 heads of 64 (one key head), MLP 256.
_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
              tie_word_embeddings=True)

#: GPT-2 names the same shape its own way (and has no key/value head count: 2 of each).
_GPT2_SHAPE = dict(n_embd=128, n_inner=256, n_layer=4, n_head=2, n_positions=2048,
                   tie_word_embeddings=True)
#: MoE: 4 experts of 64 columns, 2 chosen per token.
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=64)

#: family -> (transformers config class, model class, config fields beyond ``_SHAPE``, or
#: replacing it when they include ``"shape"``)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"head_dim": 64}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 64}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 64, "sliding_window": None}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": None}),
    # Soft-capped attention logits, every other layer a 16-token sliding window.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 64, "sliding_window": 16, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 64}),
    # q/k norms, sliding windows on layers 0-2 (layer 3 global), local RoPE base.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 64, "sliding_window": 16, "query_pre_attn_scalar": 64,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"shape": _GPT2_SHAPE}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "head_dim": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": None}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        **_MOE, "num_experts": 4, "shared_expert_intermediate_size": 128}),
    # Served by vLLM's Transformers backend. Pythia's shape: parallel attention + MLP, a
    # quarter of each head rotated, untied unembedding.
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {
        "shape": {k: v for k, v in _SHAPE.items() if k != "num_key_value_heads"},  # no GQA
        "rotary_pct": 0.25, "partial_rotary_factor": 0.25, "use_parallel_residual": True,
        "tie_word_embeddings": False}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # Transformers backend too: OLMo 2's post-norm layer, layers 0-2 with a 16-token window.
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {
        "sliding_window": 16, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}),
    # Transformers backend: Llama's layer, layer 3 without RoPE (NoPE).
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layers": [1, 1, 1, 0],
                                                        "pad_token_id": None}),
    # A multimodal model (SmolVLM's architecture): a tiny vision tower around the Llama above.
    "idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration", {"wraps": "llama"}),
}


#: Families without a written row: served through a layout derived from vLLM's module tree and
#: proven by the start-up check (``worker.layout_derivation``, ``worker.layout_check``);
#: ``tests/integration/test_derived_layouts.py`` runs those it names.
DERIVED_FAMILIES = {
    "granite": ("GraniteConfig", "GraniteForCausalLM", {
        "residual_multiplier": 0.5, "embedding_multiplier": 2.0, "attention_multiplier": 0.1,
        "logits_scaling": 2.0}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 64, "partial_rotary_factor": 0.5,
                                               "pad_token_id": None}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        **_MOE, "num_experts": 4, "head_dim": 64, "decoder_sparse_step": 1}),
    # GLM-4.5's MoE: a dense first layer, then sigmoid-routed experts and a shared expert.
    # Untied: vLLM's GLM-4-MoE loads no LM head from a tied checkpoint (every logit equal).
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {
        **_MOE, "head_dim": 64, "n_routed_experts": 4, "first_k_dense_replace": 1,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "partial_rotary_factor": 0.5,
        "pad_token_id": None, "tie_word_embeddings": False}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {"partial_rotary_factor": 0.25}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"head_dim": 64}),
    # vLLM's OLMoE does not tie its LM head to the embeddings: a tied checkpoint would load
    # with an empty head.
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                  "tie_word_embeddings": False}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2}),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", {"head_dim": 64}),
    # Untied: vLLM's gpt-oss loads no LM head from a tied checkpoint (every token 0).
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {
        "head_dim": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 2,
        "tie_word_embeddings": False}),
    # BLOOM: ALiBi instead of rotary positions, LayerNorm, GELU MLP of 4 x hidden.
    "bloom": ("BloomConfig", "BloomForCausalLM", {
        "shape": {"hidden_size": 128, "n_layer": 4, "n_head": 2, "tie_word_embeddings": True}}),
    # GPT-J: attention and MLP side by side on one LayerNorm (parallel blocks), partial rotary.
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {
        "shape": {"n_embd": 128, "n_inner": 256, "n_layer": 4, "n_head": 2, "rotary_dim": 32,
                  "n_positions": 2048, "tie_word_embeddings": False}}),
    # Refused (tests/integration/test_derived_layouts.py, REFUSED): parallel attention + MLP;
    # multi-head latent attention (vLLM's MLA module, not its Attention); an MLP of loose
    # fc1 / activation / fc2 children called from the layer.
    "falcon": ("FalconConfig", "FalconForCausalLM", {
        "shape": {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 2,
                  "num_kv_heads": 1, "tie_word_embeddings": True},
        "new_decoder_architecture": True, "parallel_attn": True, "bias": False}),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        **_MOE, "n_routed_experts": 4, "first_k_dense_replace": 1, "n_shared_experts": 1,
        "num_key_value_heads": 2, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64, "v_head_dim": 64, "n_group": 1, "topk_group": 1,
        "tie_word_embeddings": False}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {
        "head_dim": 64, "sliding_window": 16,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "logit_scale": 0.5,
        "pad_token_id": None}),
    # Qwen3-Next: gated delta-net (linear attention) layers between attention layers.
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        **_MOE, "head_dim": 64, "num_experts": 4, "shared_expert_intermediate_size": 64,
        "linear_num_value_heads": 2, "linear_num_key_heads": 1, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "full_attention_interval": 2}),
    "opt": ("OPTConfig", "OPTForCausalLM", {
        "shape": {"hidden_size": 128, "ffn_dim": 256, "num_hidden_layers": 4,
                  "num_attention_heads": 2, "max_position_embeddings": 2048,
                  "word_embed_proj_dim": 128, "tie_word_embeddings": True},
        "pad_token_id": 1}),
    # Gemma 3n: AltUp carries several copies of the stream between layers (and per-layer
    # inputs): the stream the layers hand on is not what the final norm reads.
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM", {
        "head_dim": 64, "sliding_window": 16,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "vocab_size_per_layer_input": 49152, "hidden_size_per_layer_input": 16,
        "laurel_rank": 8, "altup_num_inputs": 2, "num_kv_shared_layers": 0,
        "activation_sparsity_pattern": [0.0] * 4, "intermediate_size": [256] * 4}),
    # Gemma 4: sandwich norms and a per-layer scale on what each layer adds.
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", {
        "head_dim": 64, "sliding_window": 16,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}),
    # EXAONE 4: post-norm; its derived layout fails the continuity check (refused).
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {
        "head_dim": 64, "sliding_window": 16,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}),
    # DeepSeek-V3: latent attention with a query LoRA; the latent cache 512 + 64 wide, the
    # only size vLLM's CPU MLA kernel compiles for.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **_MOE, "n_routed_experts": 4, "first_k_dense_replace": 1, "n_shared_experts": 1,
        "num_key_value_heads": 2, "kv_lora_rank": 512, "q_lora_rank": 64, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64, "v_head_dim": 64, "n_group": 1, "topk_group": 1,
        "num_nextn_predict_layers": 0, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "tie_word_embeddings": False}),
    # Attention + Mamba-2 hybrids: layers 1 and 3 attention, 0 and 2 Mamba.
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", {
        "layer_types": ["mamba", "attention"] * 2, "num_local_experts": 4,
        "num_experts_per_tok": 2, "shared_intermediate_size": 128, "mamba_n_heads": 4,
        "mamba_d_head": 64, "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_chunk_size": 16,
        "position_embedding_type": "rope", "tie_word_embeddings": False}),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", {
        "head_dim": 64, "layers_block_type": ["mamba", "mlp", "attention", "mlp"],
        "mamba_num_heads": 4, "mamba_head_dim": 64, "ssm_state_size": 16, "n_groups": 1,
        "chunk_size": 16, "tie_word_embeddings": False}),
    # Qwen3.5: gated delta-net (linear attention) layers, every fourth full attention.
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {
        "head_dim": 64, "linear_num_value_heads": 2, "linear_num_key_heads": 1,
        "linear_key_head_dim": 64, "linear_value_head_dim": 64,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"]}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {
        **_MOE, "head_dim": 64, "num_experts": 4, "shared_expert_intermediate_size": 64,
        "linear_num_value_heads": 2, "linear_num_key_heads": 1, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"]}),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", {
        "head_dim": 64, "num_local_experts": 4, "num_experts_per_tok": 1,
        "intermediate_size_mlp": 256, "interleave_moe_layer_step": 2}),
}


def tiny_family_dir(family: str) -> str:
    """A seeded tiny random checkpoint of ``family`` (built once, cached beside the demo
    models). Biases and norm weights are randomised too, so that they matter."""
    final = cache_root() / f"tiny-{family}-h128-l4-v1"
    if (final / "config.json").exists():
        return str(final)
    import torch
    import transformers
    from transformers import AutoTokenizer

    config_name, model_name, extra = {**FAMILIES, **DERIVED_FAMILIES}[family]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    extra = dict(extra)
    processor = None
    if "wraps" in extra:
        config, processor = _idefics3_config(tokenizer, extra.pop("wraps"))
    else:
        shape = extra.pop("shape", _SHAPE)
        config = getattr(transformers, config_name)(
            vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, **{**shape, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.05)
            elif "norm" in name or ".ln_" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent) as tmp:
        build = Path(tmp) / "build"
        model.save_pretrained(build)
        (processor or tokenizer).save_pretrained(build)
        return str(_publish(build, final))


def _idefics3_config(tokenizer, text_family: str):
    """An Idefics3 config around ``text_family``'s (a tiny vision tower: 32-pixel images in
    patches of 8, 4 image tokens each) and its processor (which adds its tokens)."""
    import transformers
    from transformers import Idefics3Config, Idefics3ImageProcessor, Idefics3Processor

    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessor(size={"longest_edge": 32},
                                               max_image_size={"longest_edge": 32},
                                               do_image_splitting=False),
        tokenizer=tokenizer, image_seq_len=4)
    config_name, _, extra = FAMILIES[text_family]
    text = getattr(transformers, config_name)(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, **{**_SHAPE, **extra})
    vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 32, "patch_size": 8}  # 2: TP=2
    config = Idefics3Config(vision_config=vision, text_config=text.to_dict(), scale_factor=2,
                            image_token_id=processor.image_token_id, tie_word_embeddings=True)
    return config, processor
