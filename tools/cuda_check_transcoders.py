"""Torch-level checks of the transcoder worker code on a CUDA GPU, where vLLM need not be
installed: the transcoder's arithmetic (float32 and bfloat16 rows) against the host's, the
replacement groups (rows together and apart, ``keep_error`` and a clamp) with PyTorch's
synchronization debug mode set to error inside their read and write, and the two-site
capture of a transcoder's features with reconstruction (pinned staging, the event recorded
after the last copy).

    PYTHONPATH=. python tools/cuda_check_transcoders.py     # exits 1 if a check fails

Needs torch with CUDA, numpy, safetensors, msgpack, msgspec, zstandard and pydantic. Last
run 2026-11-27 on an H100 (torch 2.11.0+cu130): every check OK (largest relative error 4e-3,
bfloat16 rows).
"""
import sys
from types import SimpleNamespace

import torch

from vllm_lens.saes import SAE
from vllm_lens.spec.replacement import ReplaceSpec
from vllm_lens.worker.capture import capture_layer
from vllm_lens.worker.plan import CaptureGroup
from vllm_lens.worker.replacement import ReplacementGroup, prepare_replacement

dev = torch.device("cuda")
print(torch.__version__, torch.cuda.get_device_name(0))
g = torch.Generator().manual_seed(0)
d, n_sae = 256, 2048


def rnd(*shape, s=0.05):
    return torch.randn(*shape, generator=g) * s


cpu_tc = SAE(architecture="jumprelu_skip_transcoder", W_enc=rnd(d, n_sae), b_enc=rnd(n_sae),
             W_dec=rnd(n_sae, d), b_dec=rnd(d), layout="t", threshold=torch.rand(n_sae, generator=g) * 0.02,
             W_skip=rnd(d, d), apply_b_dec_to_input=False, point="mlp_in", layer=1,
             out_point="mlp_out")
tc = cpu_tc.to(dev)
ok = True


def check(name, got, want, tol):
    global ok
    err = (got.float().cpu() - want.float().cpu()).abs().max().item()
    scale = want.float().abs().max().item()
    good = err <= tol * max(scale, 1e-6)
    ok &= good
    print(f"{'OK ' if good else 'BAD'} {name}: max err {err:.3g} (scale {scale:.3g})")


# 1. The transcoder's arithmetic on CUDA, bf16 rows cast up, equals the host's.
x32 = torch.randn(300, d, generator=g)
for dtype in (torch.float32, torch.bfloat16):
    x = x32.to(dtype)
    check(f"forward {dtype}", tc.forward(x.to(dev)), cpu_tc.forward(x), 1e-3)
    y = torch.randn(300, d, generator=g).to(dtype)
    got = tc.top_features(x.to(dev), 16, reconstruction=True, target=y.to(dev))
    want = cpu_tc.top_features(x, 16, reconstruction=True, target=y)
    check(f"top_features values {dtype}", got["values"], want["values"], 1e-3)
    check(f"top_features nmse {dtype}", got["nmse"], want["nmse"], 1e-3)

# 2. Replacement groups on CUDA: rows apart (index path) and together (slice path), bf16
#    model rows; with keep_error and a clamp; no synchronizing op inside read/write.
for keep, clamp in ((False, ()), (False, ((3, 2.0), (40, 0.0))), (True, ((3, 2.0), (40, 0.0)))):
    spec = ReplaceSpec(transcoder="t", path="p", hook_point=None, point="mlp_in", layer=1,
                       keep_error=keep, clamp=clamp)
    prep = prepare_replacement(spec, tc, split=False)
    for members in (((0, 5), (9, 20)), ((0, 5), (5, 20))):
        req = [(SimpleNamespace(req_id=str(i), start=a, end=b), prep)
               for i, (a, b) in enumerate(members)]
        group = ReplacementGroup.build(req, dev)
        a_in = torch.randn(24, d, generator=g).to(torch.bfloat16)
        a_out = torch.randn(24, d, generator=g).to(torch.bfloat16)
        expected = a_out.clone()
        for a, b in members:
            x = a_in[a:b].float()
            f = cpu_tc.encode(x)
            edited = f.clone()
            for i, v in clamp:
                edited[:, i] = v
            if keep:
                expected[a:b] = (a_out[a:b].float() + cpu_tc.decode(edited) - cpu_tc.decode(f)).to(torch.bfloat16)
            else:
                expected[a:b] = cpu_tc.predict(x, edited).to(torch.bfloat16)
        out = a_out.to(dev)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            group.read(a_in.to(dev, non_blocking=True), None)
            group.write(out, None)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        kind = "slice" if isinstance(group.rows, slice) else "index"
        check(f"replace keep_error={keep} clamp={bool(clamp)} {kind}", out, expected, 2e-2)

# 3. A transcoder's features with reconstruction read at two sites on CUDA: staged on the
#    host (pinned), the event recorded after the last copy, equal to the host's.
rows = torch.tensor([1, 4, 5, 9], device=dev)
group = CaptureGroup(layers=(1,), signal="sae:abc:mlp_in", rows=rows, owners=[], n_rows=4)
group.sae, group.target_site = (tc, 8, True), "post"
a_in = torch.randn(12, d, generator=g).to(torch.bfloat16)
a_out = torch.randn(12, d, generator=g).to(torch.bfloat16)
capture_layer(group, 0, a_in.to(dev), None, None, site="mlp_in")
assert group.staging is None and not group.complete
capture_layer(group, 0, a_out.to(dev), torch.zeros(12, d, dtype=torch.bfloat16, device=dev), None,
              site="post")
assert group.complete and group.ready is not None and group.staging.is_pinned()
group.ready.synchronize()
want = cpu_tc.top_features(a_in[[1, 4, 5, 9]].float(), 8, reconstruction=True,
                           target=a_out[[1, 4, 5, 9]].float())
staged = group.staging[0]
check("two-site capture values", staged[:, 8:16], want["values"], 1e-3)
check("two-site capture nmse", staged[:, 16], want["nmse"], 1e-3)
assert torch.equal(staged[:, 17].long(), want["l0"].long())
print("ALL OK" if ok else "SOME CHECKS FAILED")
sys.exit(0 if ok else 1)
