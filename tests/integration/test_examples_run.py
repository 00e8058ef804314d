"""The steering example does what the README says: at the default scales the steering is
visible in the answers' own activations (probe score rises with the scale) and it writes its
picture. (The other examples' pictures are described from measured runs in the README.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
