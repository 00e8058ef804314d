"""Hostile lens requests against the real OpenAI server (Hypothesis): every class in
``tests/fuzz_cases.py`` gets a 4xx naming its field, the API server's memory stays bounded
(bombs never inflate), and a correct request afterwards is served."""

from __future__ import annotations

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz_cases import ADMISSION, each_class

PROMPT = "The capital of France is"


def _peak_and_current_rss(pid: int) -> tuple[int, int]:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmHWM", "VmRSS"):
                fields[name] = int(value.split()[0]) * 1024
    return fields["VmHWM"], fields["VmRSS"]


def test_every_hostile_class_is_refused_over_http(smol_server):
    base = smol_server.base_url
    peak_before, _ = _peak_and_current_rss(smol_server.pid)
    seen: dict[str, int] = {}

    @settings(max_examples=2, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def fuzz(data):
        for name, (xargs, field) in each_class(data.draw).items():
            r = httpx.post(base + "/v1/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": 2, "vllm_xargs": xargs})
            assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:500])
            error = r.json()["error"]
            assert str(error["param"]).startswith(field), (name, error)
            seen[name] = seen.get(name, 0) + 1

    fuzz()
    for name, (xargs, field, body) in ADMISSION.items():
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "prompt": PROMPT, **body, "vllm_xargs": xargs})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (name, r.text)
    assert len(seen) + len(ADMISSION) >= 30
    peak_after, current = _peak_and_current_rss(smol_server.pid)
    grown = peak_after - peak_before
    print(f"API server peak RSS grew by {grown / 2**20:.0f} MiB over {sum(seen.values())} "
          f"hostile requests (now {current / 2**20:.0f} MiB)")
    assert grown < 128 << 20  # a single 256-512 MiB bomb would have shown here
    ok = httpx.post(base + "/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
        "vllm_xargs": {"output_residual_stream": "[3]"}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["activations"]
