"""The transformers reference: decoder-layer outputs and greedy generation in float32."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


class HFReference:
    def __init__(self, path: str) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.layers = self.model.model.layers

    @torch.no_grad()
    def residual_stream(self, token_ids: list[int], layers: list[int]) -> torch.Tensor:
        """``[len(layers), len(token_ids), hidden]``: each listed decoder layer's output.

        Taken with forward hooks, so the last layer is its raw output (transformers'
        ``hidden_states[-1]`` is after the final norm).
        """
        seen: dict[int, torch.Tensor] = {}
        handles = [
            self.layers[layer].register_forward_hook(
                lambda _m, _i, out, layer=layer: seen.__setitem__(
                    layer, out[0] if isinstance(out, tuple) else out)
            )
            for layer in layers
        ]
        try:
            self.model(torch.tensor([token_ids]))
        finally:
            for h in handles:
                h.remove()
        return torch.stack([seen[layer][0] for layer in layers])

    @torch.no_grad()
    def hidden_states(self, token_ids: list[int]) -> tuple[torch.Tensor, ...]:
        out = self.model(torch.tensor([token_ids]), output_hidden_states=True)
        return tuple(h[0] for h in out.hidden_states)

    @torch.no_grad()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        out = self.model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )
        return out[0, len(prompt_ids):].tolist()


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest per-row ``|actual - expected| / |expected|`` (L2 norms over the hidden dim)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = (actual.float() - expected.float()).norm(dim=-1) / expected.float().norm(dim=-1)
    return float(err.max())
