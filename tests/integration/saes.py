"""Random SAEs saved by sae-lens itself, for the tests that serve SAE features."""

from __future__ import annotations

import torch

from vllm_lens.common.messages import StatsAnswer, read_all


def saved_sae(path, architecture: str, hook: str, d_in: int = 128, **fields):
    """A sae-lens SAE with random weights at ``hook``, saved to ``path``; returns it."""
    from sae_lens import (
        AbsTopKSAEConfig,
        GatedSAEConfig,
        JumpReLUSAEConfig,
        StandardSAEConfig,
        TopKSAEConfig,
    )
    from sae_lens.saes.sae import SAE

    config = {"standard": StandardSAEConfig, "jumprelu": JumpReLUSAEConfig,
              "topk": TopKSAEConfig, "abstopk": AbsTopKSAEConfig,
              "gated": GatedSAEConfig}[architecture]
    cfg = config(d_in=d_in, d_sae=512, dtype="float32", device="cpu", **fields)
    sae = SAE.get_sae_class_for_architecture(cfg.architecture())(cfg)
    sae.cfg.metadata.hook_name = hook
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in sae.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.1)
        if architecture == "jumprelu":
            sae.threshold.copy_(torch.rand(512, generator=g) * 0.05)
    sae.save_model(path)
    return SAE.load_from_disk(path)


def saved_transcoder(path, architecture: str, layer: int, d_in: int = 128, d_sae: int = 512,
                     scale: float = 0.1, hook: str | None = None):
    """A sae-lens transcoder (any of its four architectures) with random weights standing in
    for ``layer``'s MLP (``blocks.L.hook_mlp_in`` -> ``blocks.L.hook_mlp_out``, or ``hook``
    as its input), saved to ``path``; returns it as sae-lens loads it."""
    from sae_lens.saes.sae import SAE
    from sae_lens.saes.transcoder import (
        JumpReLUSkipTranscoderConfig,
        JumpReLUTranscoderConfig,
        SkipTranscoderConfig,
        TranscoderConfig,
    )

    config = {"transcoder": TranscoderConfig, "skip_transcoder": SkipTranscoderConfig,
              "jumprelu_transcoder": JumpReLUTranscoderConfig,
              "jumprelu_skip_transcoder": JumpReLUSkipTranscoderConfig}[architecture]
    cfg = config(d_in=d_in, d_sae=d_sae, d_out=d_in, dtype="float32", device="cpu",
                 apply_b_dec_to_input=False)
    transcoder = SAE.get_sae_class_for_architecture(cfg.architecture())(cfg)
    transcoder.cfg.metadata.hook_name = hook or f"blocks.{layer}.hook_mlp_in"
    transcoder.cfg.metadata.hook_name_out = f"blocks.{layer}.hook_mlp_out"
    g = torch.Generator().manual_seed(11 + len(architecture))
    with torch.no_grad():
        for param in transcoder.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * scale)
        if architecture.startswith("jumprelu"):
            transcoder.threshold.copy_(torch.rand(d_sae, generator=g) * scale / 2)
    transcoder.save_model(path)
    return SAE.load_from_disk(path)


def replacement_edits(layer: int, transcoder, keep_error: bool,
                      clamp: dict[int, float] | None = None) -> dict:
    """transformers' edits (``HFReference.point_hooks``) replacing ``layer``'s MLP output
    by sae-lens' ``transcoder`` as ``replace_mlp`` does: its prediction from the MLP's
    input with the ``clamp``'s features set, or with ``keep_error`` the output plus the
    difference the clamp makes to the decoded features."""
    kept = {}

    def read(x):
        kept["x"] = x
        return x

    def write(y):
        x = kept.pop("x")
        with torch.no_grad():
            f = transcoder.encode(x)
            edited = f.clone()
            for feature, value in (clamp or {}).items():
                edited[:, feature] = value
            if keep_error:
                return y + transcoder.decode(edited) - transcoder.decode(f)
            predicted = transcoder.decode(edited)
            if hasattr(transcoder, "W_skip"):
                predicted = predicted + x @ transcoder.W_skip.T
            return predicted
    return {("mlp_in", layer): read, ("mlp_out", layer): write}


def check_transcoder(llm, ref, path, transcoder, layer: int, prompt: str,
                     loaded: list[int]) -> None:
    """On ``llm`` (any parallel layout): ``replace_mlp`` by sae-lens' ``transcoder`` (saved
    at ``path``, standing in for ``layer``'s MLP) gives transformers' tokens with the same
    edit, and its features with reconstruction read in the same request equal sae-lens' on
    transformers' rows (the prediction it wrote reconstructs itself). ``loaded``: how many
    more SAEs each worker then keeps (every rank running the layer keeps the transcoder)."""
    from vllm import SamplingParams

    before = [w.saes for w in read_all(StatsAnswer, llm.collective_rpc("lens_stats"))]
    ids = llm.get_tokenizer().encode(prompt)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, extra_args={
            "replace_mlp": [{"transcoder": str(path), "keep_error": False}],
            "output_sae_features": {"sae": str(path), "top_k": 8, "reconstruction": True}}))[0]
    assert out.lens_error is None
    edits = replacement_edits(layer, transcoder, keep_error=False)
    tokens = list(out.outputs[0].token_ids)
    assert tokens == ref.point_greedy(ids, 6, edits)
    rows = ref.points((ids + tokens)[:-1], edits)[("mlp_in", layer)]
    (found,) = out.sae_features
    with torch.no_grad():
        top = transcoder.encode(rows).topk(8)
    torch.testing.assert_close(found["values"], top.values * (top.values > 0), rtol=1e-4,
                               atol=1e-4)
    assert float(found["nmse"].abs().max()) < 1e-6
    after = [w.saes for w in read_all(StatsAnswer, llm.collective_rpc("lens_stats"))]
    assert [a - b for a, b in zip(after, before)] == loaded


def check_features_and_clamp(llm, ref, path, sae, prompt: str, kept: list[int]) -> None:
    """On ``llm`` (any parallel layout): the features of ``sae`` (a jumprelu at
    ``blocks.2.hook_resid_post``, saved at ``path``) equal sae-lens' ``encode`` on
    transformers' rows, and clamping two of its features gives transformers' tokens with the
    same edit in a hook (not the unsteered ones). ``kept``: the SAEs each worker then keeps
    loaded (only where its layer's rows are captured)."""
    from vllm import SamplingParams

    ids = llm.get_tokenizer().encode(prompt)
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, extra_args={
        "output_sae_features": {"sae": str(path), "top_k": 16, "reconstruction": True}})
    out = llm.generate([{"prompt_token_ids": ids}], sp)[0]
    assert out.lens_error is None
    every = ids + list(out.outputs[0].token_ids)
    (found,) = out.sae_features
    with torch.no_grad():
        dense = sae.encode(ref.points(every[:-1])[("resid_post", 2)])
    assert found["positions"].tolist() == list(range(len(every) - 1))
    assert found["l0"].tolist() == (dense > 0).sum(-1).tolist()
    top = dense.topk(16)
    torch.testing.assert_close(found["values"], top.values * (top.values > 0), rtol=1e-4,
                               atol=1e-4)
    check_clamp(llm, ref, path, sae, ids, [11, 300], [6.0, 0.0])
    assert [w.saes for w in read_all(StatsAnswer, llm.collective_rpc("lens_stats"))] == kept


def check_clamp(llm, ref, path, sae, ids: list[int], features: list[int],
                targets: list[float]) -> None:
    """Clamping ``features`` of ``sae`` (saved at ``path``, read at layer 2's resid_post) to
    ``targets`` gives transformers' tokens with the same edit in a hook, and not the unsteered
    ones."""
    from vllm import SamplingParams

    index, goal = torch.tensor(features), torch.tensor(targets)

    def clamp(x):
        with torch.no_grad():
            return x + (goal - sae.encode(x)[:, index]) @ sae.W_dec[index]

    clamped = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, extra_args={"apply_steering_vectors": [
            {"sae": str(path), "feature": features, "clamp": targets}]}))[0]
    assert clamped.lens_error is None
    assert list(clamped.outputs[0].token_ids) == ref.point_greedy(
        ids, 6, {("resid_post", 2): clamp})
    assert list(clamped.outputs[0].token_ids) != ref.point_greedy(ids, 6, {})  # it mattered


def assert_top_features(found, dense, k) -> None:
    """Each row's returned features are the ``k`` largest of sae-lens' ``dense`` features,
    the active ones only (then -1), and ``l0`` counts the active ones."""
    for row in range(dense.shape[0]):
        active = int((dense[row] > 0).sum())
        assert int(found["l0"][row]) == active
        kept = min(active, k)
        top = dense[row].topk(kept)
        torch.testing.assert_close(found["values"][row, :kept], top.values, rtol=1e-4,
                                   atol=1e-5)
        assert found["indices"][row, :kept].tolist() == top.indices.tolist()
        assert (found["indices"][row, kept:] == -1).all()


def architecture_saes(root) -> list:
    """(directory, sae-lens SAE) of a standard SAE at layer 1's attn_out and a TopK SAE at
    layer 2's resid_post (PP=2: one on each stage), saved by sae-lens."""
    return [(root / "standard", saved_sae(root / "standard", "standard",
                                          "blocks.1.hook_attn_out")),
            (root / "topk", saved_sae(root / "topk", "topk", "blocks.2.hook_resid_post", k=16))]


def topk_clamp(sae, features, targets, keep=lambda p: True):
    """transformers' edit for a TopK clamp: ``decode(f') - decode(f)`` with sae-lens' own
    ``encode`` and ``decode`` of the whole row, ``f'`` being ``f`` with ``features`` set to
    ``targets``, at the positions ``keep`` says."""

    def edit(x):
        with torch.no_grad():
            f = sae.encode(x)
            edited = f.clone()
            edited[:, features] = torch.tensor(targets)
            delta = sae.decode(edited) - sae.decode(f)
        rows = torch.tensor([keep(p) for p in range(x.shape[0])])
        return x + delta * rows[:, None]
    return edit


def inside_and_outside(sae, rows) -> list[int]:
    """Two features of a TopK ``sae`` on ``rows``: one among the top k of some rows, not all
    (a clamp to 0 lowers it there), and one among the top k of none (a clamp raises it)."""
    with torch.no_grad():
        active = (sae.encode(rows) > 0).sum(0)
    n = rows.shape[0]
    inside = int((active * (active < n)).argmax())
    assert 0 < int(active[inside]) < n
    return [inside, int((active == 0).nonzero()[0])]


def check_architectures(llm, ref, saes, prompt: str, kept: list[int]) -> None:
    """On ``llm`` (any parallel layout or mode): the features of each SAE of
    ``architecture_saes``, prompt and generated rows, equal sae-lens' ``encode`` of
    transformers' rows; clamping the TopK SAE's features gives transformers' tokens with the
    same edit in a hook. ``kept``: the SAEs each worker then keeps loaded (a TopK SAE a
    request clamps: on every rank that steers its layer)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, extra_args={
        "output_sae_features": [{"sae": str(path), "top_k": 20, "reconstruction": True}
                                for path, _ in saes]})
    out = llm.generate([prompt], sp)[0]
    assert out.lens_error is None
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)[:-1]
    rows = ref.points(ids)
    for found, (_, sae), point in zip(out.sae_features, saes, (("attn_out", 1),
                                                               ("resid_post", 2))):
        assert found["positions"].tolist() == list(range(len(ids)))
        with torch.no_grad():
            dense = sae.encode(rows[point])
        assert_top_features(found, dense, 20)
    (path, topk), prompt_ids = saes[1], list(out.prompt_token_ids)
    features = inside_and_outside(topk, rows[("resid_post", 2)][:len(prompt_ids)])
    clamped = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, extra_args={"apply_steering_vectors": [
            {"sae": str(path), "feature": features, "clamp": [0.0, 8.0]}]}))[0]
    assert clamped.lens_error is None
    hooked = {("resid_post", 2): topk_clamp(topk, features, [0.0, 8.0])}
    tokens = list(clamped.outputs[0].token_ids)
    assert tokens == ref.point_greedy(prompt_ids, 6, hooked)
    assert tokens != ref.point_greedy(prompt_ids, 6, {})  # it mattered
    assert [w.saes for w in read_all(StatsAnswer, llm.collective_rpc("lens_stats"))] == kept
