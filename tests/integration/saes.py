"""Random SAEs saved by sae-lens itself, for the tests that serve SAE features."""

from __future__ import annotations

import torch


def saved_sae(path, architecture: str, hook: str, d_in: int = 128, **fields):
    """A sae-lens SAE with random weights at ``hook``, saved to ``path``; returns it."""
    from sae_lens import JumpReLUSAEConfig, StandardSAEConfig, TopKSAEConfig
    from sae_lens.saes.sae import SAE

    config = {"standard": StandardSAEConfig, "jumprelu": JumpReLUSAEConfig,
              "topk": TopKSAEConfig}[architecture]
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
