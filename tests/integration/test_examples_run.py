"""The steering, attention-tracker, probe-monitor, refusal-direction, PASTA and causal-tracing
examples do what the docs say: at the default scales the steering is visible in the answers'
own activations (probe score rises with the scale); the attention tracker's held-out AUROC
beats prompt length; emphasising a note moves the answers to it; the causal trace built on
``patching_sweep`` shows the picture docs/hooks.md describes; each writes its picture. (The
other examples' pictures are described from measured runs on their pages in docs/.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # each test starts engines of its own


def test_steering_example_moves_the_probe_and_writes_a_png(tmp_path):
    out = tmp_path / "steering.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "steering.py"), "--scales", "-0.3", "0", "0.3",
         "--max-tokens", "24", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    scores: dict[str, dict[float, float]] = {}
    for question, scale, probe in re.findall(
            r"\[('.*?') \| scale ([+-][\d.]+) \| probe ([+-][\d.]+)\]", proc.stdout):
        scores.setdefault(question, {})[float(scale)] = float(probe)
    assert len(scores) == 3, proc.stdout[-3000:]
    for question, by_scale in scores.items():
        assert by_scale[0.3] > by_scale[-0.3], (question, by_scale)
    assert "the sink at position 0 has" in proc.stdout
    assert out.stat().st_size > 10_000


def test_attention_tracker_example_scores_held_out_prompts_in_the_engine(tmp_path):
    out = tmp_path / "attention_tracker.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "attention_tracker.py"), "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = re.search(r"held-out AUROC .*?: ([\d.]+); prompt length alone: ([\d.]+)",
                      proc.stdout)
    assert found, proc.stdout[-3000:]
    held, length = float(found.group(1)), float(found.group(2))
    # Measured 0.89 vs 0.56 for length alone (docs/inside_the_layer.md): the heads chosen on
    # the calibration half carry the signal on the held-out half, and it is not prompt length.
    assert held > 0.75 and held > length + 0.15, (held, length)
    spread = re.search(r"median held-out AUROC ([\d.]+)", proc.stdout)
    assert spread and float(spread.group(1)) > 0.6, proc.stdout[-2000:]  # measured 0.76
    assert out.stat().st_size > 10_000


def test_probe_monitor_scores_streamed_tokens_like_the_in_engine_probe(tmp_path):
    """The probe fitted on an extracted dataset separates held-out reviews, the streamed rows
    score every generated token but the last, the in-engine ``linear_probe`` hook gives the
    same scores, and the probe as a stop monitor ends the generation where they cross."""
    import json

    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "probe_monitor.py"), "--max-tokens", "32",
         "--workdir", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["held_out_accuracy"] >= 0.8, result  # measured 1.00 (docs/datasets.md)
    assert 4 <= result["tokens_scored"] <= 31, result
    assert result["max_difference"] <= 1e-3, result
    # The guardrail stops right after the first generated token whose streamed score crosses
    # (measured: "... I loved the food at the restaurant, but"), and says which monitor.
    guard, crossing = result["guard"], result["streamed_first_crossing"]
    assert crossing is not None and guard["position"] == crossing, result
    assert guard["stop_reason"] == "negativity", result
    assert guard["tokens"] == crossing - guard["n_prompt"] + 2, result  # and the EOS token
    assert "\x1b[48;5;" in proc.stdout  # the coloured line
    assert (tmp_path / "sentiment-acts" / "index.jsonl").exists()


def test_refusal_direction_example_ablates_the_direction_at_every_layer(tmp_path):
    """The difference-of-means direction separates held-out harmful from harmless
    instructions; ablated at every layer, nothing of it is left in any layer's output (the
    plain stream has some), the answers change, and a plain request beside the ablated ones
    is unchanged."""
    import json

    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "refusal_direction.py"), "--max-tokens", "24"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # The summary line (vLLM may print after it while the engine shuts down).
    result = json.loads(next(line for line in reversed(proc.stdout.splitlines())
                             if line.startswith('{"layer"')))
    assert result["separation"] > 1.0, result
    assert result["max_component_left"] <= 1e-3 * result["plain_component"], result
    assert result["answers_changed"] >= 1, result
    assert result["plain_beside_ablated_unchanged"], result


def test_pasta_example_moves_the_answers_to_the_emphasised_note(tmp_path):
    """Emphasising either of two contradicting notes makes more answers follow it than the
    plain run does (docs/attention_steering.md quotes the measured counts)."""
    import json

    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "pasta.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(next(line for line in reversed(proc.stdout.splitlines())
                             if line.startswith('{"layers"')))
    follows = result["follows"]
    assert follows["note 1 emphasised"]["1"] > follows["plain"]["1"] + 6, follows
    assert follows["note 2 emphasised"]["2"] > follows["plain"]["2"] + 2, follows


def test_causal_tracing_example_draws_the_readme_picture_without_hooks(tmp_path):
    """The sweep-based causal trace shows what docs/hooks.md describes: the corruption removes
    the fact, the last layer's output at the last token restores the clean answer, and the
    middle subject token restores it at early layers while the last subject token does not."""
    out = tmp_path / "causal_tracing.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "causal_tracing.py"), "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = re.search(r"clean p=([\d.]+), corrupted p=([\d.]+)", proc.stdout)
    assert found, proc.stdout[-3000:]
    clean, corrupted = float(found.group(1)), float(found.group(2))
    assert clean > 0.5 and corrupted < 0.2, (clean, corrupted)
    best = {token: float(p) for token, p in re.findall(r"^\s+(\S+)\s+best p=([\d.]+)",
                                                        proc.stdout, re.M)}
    assert best["iffel*"] > 0.3 and best["␣Tower*"] < best["iffel*"], best
    assert out.stat().st_size > 10_000


def test_sae_features_example_closes_the_loop_with_sae_lens(tmp_path):
    """Extract with ``--format sae-lens``, train with sae-lens, serve: the served features
    equal sae-lens' encode of the extracted rows, the SAE reconstructs the rows, features
    that fire on specific tokens are found and drawn, and steering by one of them makes the
    generated text read as that feature (unsteered, read back)."""
    import json

    out = tmp_path / "sae_features.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "sae_features.py"), "--steps", "800",
         "--d-sae", "1152", "--workdir", str(tmp_path / "work"), "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # The summary line (vLLM may print after it while the engine shuts down).
    result = json.loads(next(line for line in reversed(proc.stdout.splitlines())
                             if line.startswith('{"max_difference"')))
    assert result["max_difference"] <= 1e-3, result  # measured 1.7e-5
    assert result["nmse"] < 0.2, result  # measured 0.08 (0.04 at the default size)
    assert len(result["features"]) == 4, result
    read_back = result["read_back"]
    steered = [v for k, v in read_back.items() if k != "plain"]
    assert all(v > read_back["plain"] for v in steered), read_back  # measured 0.16 vs 0.00
    assert out.stat().st_size > 10_000
    assert (tmp_path / "work" / "sae" / "cfg.json").exists()


def test_tour_notebook_runs_every_step(tmp_path, monkeypatch):
    """examples/notebooks/tour.ipynb, executed by nbclient in a fresh kernel of this Python:
    the capture has every layer, the logit lens's last layer agrees with vLLM's token, the
    steered and clamped texts differ from the plain ones, the SAE's features come back and
    the clamped feature reads its target, and the lens draws its picture."""
    import json
    import time

    import nbformat
    from nbclient import NotebookClient

    # A kernel spec of its own naming this interpreter (a "python3" spec elsewhere on the
    # machine could start another Python, without vLLM).
    spec = tmp_path / "jupyter" / "kernels" / "vllm-lens-tour"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "vllm-lens tour", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    nb = nbformat.read(ROOT / "examples" / "notebooks" / "tour.ipynb", as_version=4)
    client = NotebookClient(nb, kernel_name="vllm-lens-tour", timeout=600,
                            resources={"metadata": {"path": str(tmp_path)}})
    started = time.monotonic()
    client.execute()  # a cell that raises fails here, with its traceback
    print(f"tour.ipynb ran in {time.monotonic() - started:.0f} s")

    def printed(cell_id: str) -> str:
        (cell,) = [c for c in nb.cells if c.get("id") == cell_id]
        return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")

    assert "engine: 30 layers, hidden size 576" in printed("start")
    assert re.search(r"captured residual_stream: shape \(30, \d+, 576\)", printed("capture"))
    lens = printed("lens")
    found = re.search(r"the last layer predicts (.+); vLLM generated (.+)$", lens, re.M)
    assert found and found.group(1) == found.group(2), lens
    assert len(re.findall(r"^\s*\d+  ", lens, re.M)) == 30, lens  # one row per layer
    (plot,) = [c for c in nb.cells if c.get("id") == "lens-plot"]
    assert any("image/png" in o.get("data", {}) for o in plot.outputs)
    steered = dict(re.findall(r"^\[steering scale ([+-][\d.]+)\] (.*)$", printed("steer"),
                              re.M))
    assert set(steered) == {"+0.0", "+0.3", "-0.3"}, printed("steer")
    assert len(set(steered.values())) == 3, steered  # each scale its own answer
    assert "RANDOM JumpReLU SAE" in printed("sae-make")
    assert re.search(r"SAE features: \d+ positions", printed("sae-read")), printed("sae-read")
    clamp = printed("clamp")
    found = re.search(r"to (\d+): it reads ([\d.]+)\.\.([\d.]+)", clamp)
    assert found, clamp
    target, low, high = (float(g) for g in found.groups())
    # c where the feature was active; where it was off, c plus its pre-activation, which is
    # below the notebook's threshold of 15 (and above -c/2 on these few tokens).
    assert target / 2 < low <= high <= target + 15, clamp
    texts = dict(re.findall(r"^\[(plain|clamped)\]\s+(.*)$", clamp, re.M))
    assert texts["plain"] != texts["clamped"], texts
