"""Torch-level checks of the direct-logit-attribution worker code on a CUDA GPU, where vLLM need
not be installed: the readout proven on a bfloat16 RMSNorm and LM head (``worker.readout``),
its attributions against the same formula on the host in float64; the staged final-norm scale
of an SAE capture with attribution (``capture.READOUT``: pinned staging, the event recorded
after the last copy, synchronization debug mode set to error inside the forward-pass part);
the fetch-time attributions of features (``attribution.attribute_rows``) and of components
and heads (``attribution.component_rows``, the output projection's weight on the device) on
device tensors against the host's; a gated output projection refused by its proof.

    PYTHONPATH=. python tools/cuda_check_attribution.py     # exits 1 if a check fails

Needs torch with CUDA, numpy, safetensors, msgpack, msgspec, zstandard and pydantic (runs on
the host's CPU too, without the pinned-memory and event checks). Last run 2026-11-27 on an
H100 (torch 2.11.0+cu130): every check OK.
"""
import sys
from types import SimpleNamespace

import torch
from torch import nn

from vllm_lens.saes import SAE
from vllm_lens.worker import head_projection
from vllm_lens.worker.attribution import attribute_rows, component_rows
from vllm_lens.worker.capture import READOUT, capture_layer
from vllm_lens.worker.plan import CaptureGroup
from vllm_lens.worker.readout import Readout, build_readout

cuda = torch.cuda.is_available()
dev = torch.device("cuda" if cuda else "cpu")
print(torch.__version__, torch.cuda.get_device_name(0) if cuda else "no CUDA: host only")
g = torch.Generator().manual_seed(0)
d, vocab, n_heads, n_sae = 256, 1000, 8, 2048
ok = True


def check(name, got, want, tol):
    global ok
    got, want = got.double().cpu(), want.double().cpu()
    err = (got - want).abs().nan_to_num(0.0).max().item()
    scale = want.abs().nan_to_num(0.0).max().item()
    good = err <= tol * max(scale, 1e-6) and bool((got.isnan() == want.isnan()).all())
    ok &= good
    print(f"{'OK ' if good else 'BAD'} {name}: max err {err:.3g} (scale {scale:.3g})")


class RMSNorm(nn.Module):  # computes as vLLM's does: in float32, then the weight
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d, generator=g) + 0.5)
        self.variance_epsilon = 1e-6

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * self.weight.float()).to(x.dtype)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.norm = RMSNorm()
        self.model.layers = nn.ModuleList()
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.logits_processor = SimpleNamespace(scale=1.0, soft_cap=30.0, vocab_size=vocab)

    def compute_logits(self, hidden):
        logits = self.lm_head(hidden).float()
        return torch.tanh(logits / 30.0) * 30.0


model = Model().to(dev, torch.bfloat16).requires_grad_(False)
readout = build_readout(model, SimpleNamespace(layers_path="model.layers", n_layers=4),
                        tp_size=1, last_stage=True)
ok &= isinstance(readout, Readout)
print(f"{'OK ' if isinstance(readout, Readout) else 'BAD'} readout on {dev}: {readout!r:.80}")
w = model.model.norm.weight.double().cpu()
w_u = model.lm_head.weight.double().cpu()

# 1. Attributions onto tokens (one unknown) against float64 on the host.
stream = torch.randn(50, d, generator=g) * 3
tokens = torch.randint(0, vocab, (50,), generator=g)
tokens[7] = -1
directions, values = torch.randn(50, 6, d, generator=g), torch.rand(50, 6, generator=g)
scales = readout.norm_scale(stream.to(dev, torch.bfloat16))
got = readout.attribute(directions.to(dev), values.to(dev), scales, tokens.to(dev))
s = (stream.to(torch.bfloat16).double().pow(2).mean(-1) + 1e-6).sqrt()
want = values.double() * torch.einsum("nkd,nd->nk", directions.double(),
                                      w * w_u[tokens.clamp(min=0)]) / s[:, None]
want[7] = float("nan")
check("attribute (bf16 model)", got, want, 1e-3)

# 2. The forward-pass part: an SAE capture with attribution stages features and the scale.
sae = SAE(architecture="jumprelu", layout="t", W_enc=torch.randn(d, n_sae, generator=g) * 0.05,
          b_enc=torch.zeros(n_sae), W_dec=torch.randn(n_sae, d, generator=g) * 0.05,
          b_dec=torch.zeros(d), threshold=torch.rand(n_sae, generator=g) * 0.02,
          point="resid_post", layer=1).to(dev)
group = CaptureGroup(layers=(1,), signal="sae:x:resid_post", rows=slice(0, 40), owners=[],
                     n_rows=40, sae=(sae, 8, False), readout=readout)
h1, r1 = (torch.randn(60, d, generator=g).to(dev, torch.bfloat16) for _ in range(2))
h3, r3 = (torch.randn(60, d, generator=g).to(dev, torch.bfloat16) for _ in range(2))
if cuda:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
try:
    capture_layer(group, 0, h1, r1, site="post")
    capture_layer(group, READOUT, h3, r3, site="post")
finally:
    if cuda:
        torch.cuda.set_sync_debug_mode("default")
if cuda:
    ok &= group.staging.is_pinned() and group.ready is not None
    print(f"{'OK ' if group.staging.is_pinned() else 'BAD'} staging pinned, event recorded")
    group.ready.synchronize()
staged = group.staging[0].clone()
expected_scale = ((h3[:40] + r3[:40]).double().pow(2).mean(-1) + 1e-6).sqrt()
check("staged final-norm scale", staged[:, -1], expected_scale, 1e-5)
top = sae.top_features((h1[:40] + r1[:40]), 8)
check("staged feature values", staged[:, 8:16], top["values"], 1e-5)

# 3. At fetch: features' attributions on the device against the host's formula.
positions = torch.arange(40)
ids = {"prompt_token_ids": torch.randint(0, vocab, (30,), generator=g).tolist(),
       "token_ids": torch.randint(0, vocab, (11,), generator=g).tolist()}
spec = SimpleNamespace(top_k=8, attribution_token=None)
rows = attribute_rows(staged, positions, spec, sae, readout, ids)
sequence = ids["prompt_token_ids"] + ids["token_ids"]
following = torch.tensor(sequence[1:41])
w_dec = sae.W_dec.double().cpu()
idx, vals = staged[:, :8].long(), staged[:, 8:16].double()
want = torch.zeros(40, 8, dtype=torch.float64)
for p in range(40):
    for j in range(8):
        if idx[p, j] >= 0:
            want[p, j] = vals[p, j] * (w_dec[idx[p, j]] * w) @ w_u[following[p]] / staged[p, -1]
check("features' attributions", rows[:, 16:24], want, 1e-3)
ok &= rows[:, -1].long().tolist() == following.tolist()

# 4. Components and heads, the projection's weight on the device.
head_dim = d // n_heads
o_proj = nn.Linear(d, d, bias=False).to(dev, torch.bfloat16).requires_grad_(False)
W_O = head_projection.matrix(o_proj, d)
ok &= W_O.data_ptr() == o_proj.weight.data_ptr()
z = torch.randn(2, 40, n_heads, head_dim, generator=g).to(torch.bfloat16)
attn = torch.stack([(z[i].reshape(40, d).to(dev) @ W_O.t()).cpu() for i in range(2)])
parts = {"resid_pre": torch.randn(1, 40, d, generator=g).to(torch.bfloat16),
         "attn_out": attn, "mlp_out": torch.randn(2, 40, d, generator=g).to(torch.bfloat16),
         "resid_post": (stream[:40] * 2)[None].to(torch.bfloat16), "attn_z": z}
captures = {k: {"positions": positions, "tensor": v} for k, v in parts.items()}
spec = SimpleNamespace(token=None, heads=n_heads, layers=(1, 2))
rows, _ = component_rows(captures, spec, readout, ids, {1: W_O, 2: W_O})
s = (parts["resid_post"][0].double().pow(2).mean(-1) + 1e-6).sqrt()
u = w * w_u[following] / s[:, None]
check("attn_out's attribution", rows[:, 2:4].t(), (parts["attn_out"].double() * u).sum(-1), 1e-3)
heads = rows[:, 6:].reshape(40, 2, n_heads).transpose(0, 1)
# (attn_out was rounded to bfloat16 once made; the heads' parts are summed in float32)
check("heads sum to attn_out's", heads.sum(-1), rows[:, 2:4].t(), 1e-2)

# 5. A gate between the kernel and the projection fails the proof.
class Gated(nn.Module):  # a gate between the kernel and the projection (Qwen3-Next's kind)
    def __init__(self, inner):
        super().__init__()
        self.weight = inner.weight

    def forward(self, x):
        return torch.sigmoid(x) @ self.weight.t()


kernel = {1: z[0].reshape(40, d).float().to(dev)}
why = head_projection.prove({1: Gated(o_proj)}, kernel, {1: attn[0].float().to(dev)},
                            lambda actual, delta: bool(((actual - delta).norm(dim=-1)
                                                        <= 3e-2 * delta.norm(dim=-1)).all()))
ok &= why is not None
print(f"{'OK ' if why else 'BAD'} a gated projection is refused: {why}")
why = head_projection.prove({1: o_proj}, kernel, {1: attn[0].float().to(dev)},
                            lambda actual, delta: bool(((actual - delta).norm(dim=-1)
                                                        <= 3e-2 * delta.norm(dim=-1)).all()))
ok &= why is None
print(f"{'OK ' if why is None else 'BAD'} the plain projection is proven")
print("ALL OK" if ok else "SOME CHECKS FAILED")
sys.exit(0 if ok else 1)
