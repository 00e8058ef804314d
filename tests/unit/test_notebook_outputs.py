"""The notebooks in examples/notebooks/ are stored with their outputs stripped: no outputs and
no execution counts in git (tests/integration/test_examples_run.py executes them instead)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "examples" / "notebooks")
                   .glob("*.ipynb"))


def test_the_tour_notebook_is_there():
    assert "tour.ipynb" in [path.name for path in NOTEBOOKS]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(notebook):
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    kept = [(n, cell.get("id"), what)
            for n, cell in enumerate(cells) if cell["cell_type"] == "code"
            for what in ("outputs", "execution_count")
            if cell.get(what) not in ([], None)]
    assert not kept, (f"{notebook.name}: (cell, id, field) with saved output {kept}; strip them "
                      "(Clear All Outputs in Jupyter, then save) before committing")
