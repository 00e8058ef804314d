"""The model-family compatibility matrix, generated from the family tests' results.

    python tools/family_matrix.py --run          # run the family tests, then write the matrix
    python tools/family_matrix.py --junit FILE...   # from the junit XML of finished pytest runs

Writes ``docs/model_families.md``. A cell says ``tested`` only when every test behind it
passed in that run (``tests/integration/test_families.py``, ``test_families_tp.py``,
``test_derived_layouts.py``),
``refused`` when the test that the point is refused by name passed, ``FAILED`` when a test
behind it failed, and ``not run`` when the run has no result for it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.families import DERIVED_FAMILIES, FAMILIES  # noqa: E402
from tests.integration import test_derived_layouts as derived  # noqa: E402
from tests.integration import test_families as single  # noqa: E402
from tests.integration.test_families_tp import TP_FAMILIES  # noqa: E402
from vllm_lens.worker.layouts import LAYOUTS  # noqa: E402

OUT = ROOT / "docs" / "model_families.md"
TESTS = ["tests/integration/test_families.py", "tests/integration/test_families_tp.py",
         "tests/integration/test_derived_layouts.py"]
ALL_POINTS = [*single.POINTS, "final_norm", "router_logits"]
EVERY_POINT = "test_every_layer_every_point_and_attention_match_transformers"
LACKING = "test_points_a_family_lacks_are_refused_by_name"
COLUMNS = {  # column -> the tests behind it (per family)
    "steering 2D/3D": ["test_2d_and_3d_steering_match_transformers"],
    "hooks": ["test_hooks_replace_and_read_as_transformers"],
    "ablate/cap": ["test_ablation_and_cap_match_transformers"],
    "attention steering": ["test_attention_steering_matches_transformers"],
    "stop monitor": ["test_a_stop_monitor_stops_where_the_transformers_scores_cross"],
    "plain tokens = no plugin": ["test_plain_requests_are_token_identical_to_vllm_without_plugin"],
}
REFUSED_TEST = "test_a_layout_not_derived_or_not_proven_is_refused_with_why"
IMPORT_TEST = "test_an_architecture_the_cpu_build_cannot_import_fails_for_the_measured_reason"
APART_TEST = ("test_a_layout_measured_apart_passes_its_check_serves_plain_tokens_and_is_still_"
              "apart")
TP_TESTS = ["test_tp2_every_point_and_attention_match_transformers",
            "test_tp2_steering_matches_transformers",
            "test_tp2_a_stop_monitor_stops_where_the_transformers_scores_cross",
            "test_tp2_ablation_and_cap_match_transformers",
            "test_tp2_attention_steering_matches_transformers"]


def outcomes(junit: Path) -> dict[tuple[str, str], str]:
    """``(test function, family) -> passed | failed | skipped`` from a junit XML file."""
    found = {}
    for case in ET.parse(junit).iter("testcase"):
        # pytest-xdist's loadgroup appends "@<group>" to the test's name.
        name = case.get("name", "").rsplit("@", 1)[0]
        if "[" not in name:
            continue
        function, family = name[:-1].split("[", 1)
        tags = {child.tag for child in case}
        found[(function, family)] = ("failed" if tags & {"failure", "error"}
                                     else "skipped" if "skipped" in tags else "passed")
    return found


def cell(results: dict, family: str, tests: list[str], ok: str = "tested") -> str:
    states = [results.get((test, family)) for test in tests]
    if any(s == "failed" for s in states):
        return "FAILED"
    if any(s is None or s == "skipped" for s in states):
        return "not run"
    return ok


def runs_as(family: str) -> tuple[str, object]:
    """How vLLM runs ``family`` (markdown) and its ``Layout``."""
    model_class = FAMILIES[family][1]
    key = model_class if model_class in LAYOUTS else f"TransformersForCausalLM:{model_class}"
    return f"`{key}`", LAYOUTS.get(key)


def render(results: dict) -> str:
    header = ["family", "vLLM runs it as", "block", "mode", "resid_post (all layers)",
              *ALL_POINTS, "Q/K patterns", *COLUMNS, "image in prompt", "TP=2"]
    rows = []
    for family in sorted(FAMILIES):
        name, layout = runs_as(family)
        shape = f"{layout.block}, {layout.norms}-norm" if layout else "unmapped"
        every = cell(results, family, [EVERY_POINT])
        points = [every if p in single.points_of(family) or p == "final_norm"  # every family's
                  else cell(results, family, [LACKING], ok="refused") for p in ALL_POINTS]
        extra = [cell(results, family, tests) for tests in COLUMNS.values()]
        tp = cell(results, family, TP_TESTS) if family in TP_FAMILIES else "not run"
        image = every if family in single.MULTIMODAL else "(text only)"
        mode = "compiled" if family in single.COMPILED else "eager"
        rows.append([family, name, shape, mode, every, *points, every, *extra, image, tp])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


DERIVED_COLUMNS = {  # column -> the tests behind it (per derived family)
    "derived and proven at start-up": ["test_the_layout_is_derived_and_proven_at_start_up"],
    "proven points = transformers": [
        "test_proven_points_match_transformers_and_refused_ones_name_the_invariant"],
    "steering": ["test_steering_a_derived_layout_matches_transformers"],
    "plain tokens = no plugin": [
        "test_plain_requests_are_token_identical_to_vllm_without_plugin"],
}


DERIVED_TP_TESTS = ["test_tp2_the_layout_is_derived_and_proven_at_start_up",
                    "test_tp2_proven_points_match_transformers",
                    "test_tp2_steering_a_derived_layout_matches_transformers"]


def render_derived(results: dict) -> str:
    header = ["family", "vLLM runs it as", "refused by the start-up check", *DERIVED_COLUMNS,
              "TP=2"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for family in sorted(derived.DERIVED):
        refused = ", ".join(f"`{p}` ({why})" for p, why in derived.DERIVED[family].items())
        cells = [cell(results, family, tests) for tests in DERIVED_COLUMNS.values()]
        cells.append(cell(results, family, DERIVED_TP_TESTS) if family in derived.DERIVED_TP
                     else "not run")
        lines.append("| " + " | ".join([family, f"`{DERIVED_FAMILIES[family][1]}`",
                                         refused or "none", *cells]) + " |")
    return "\n".join(lines)


def render_architectures(results: dict) -> str:
    """Every text-generation architecture vLLM registers, and what vllm-lens does with it."""
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

    written = {key.split(":")[-1]: key for key in LAYOUTS}
    proven = {DERIVED_FAMILIES[f][1]: f for f in derived.DERIVED}
    refused = {DERIVED_FAMILIES[f][1]: f for f in derived.REFUSED}
    unimportable = {arch: f for f, (arch, _, _) in derived.NOT_IMPORTABLE.items()}
    apart = {DERIVED_FAMILIES[f][1]: f for f in derived.MEASURED_APART}
    by_class = {model_class: family for family, (_, model_class, _) in FAMILIES.items()}
    lines = ["| architecture | vLLM class | status |", "|---|---|---|"]
    wrappers = [(arch, (None, arch)) for arch in sorted(unimportable)
                if arch not in _TEXT_GENERATION_MODELS]  # multimodal ones measured
    for arch, (_, vllm_class) in [*sorted(_TEXT_GENERATION_MODELS.items()), *wrappers]:
        if arch in written or vllm_class in written:
            family = by_class.get(arch)
            status = (f"written row, proven against transformers (`{family}` above)" if family
                      else "written row (shares a proven family's layer)")
        elif arch in proven:
            family = proven[arch]
            ok = all(cell(results, family, t) == "tested" for t in DERIVED_COLUMNS.values())
            status = (f"derived at load, proven against transformers (`{family}` above)"
                      if ok else "derived at load; its tests did not all pass in this run")
        elif arch in refused:
            family = refused[arch]
            ok = results.get((REFUSED_TEST, family)) == "passed"
            status = (f"refused, measured (`{family}`): {derived.REFUSED[family]}" if ok
                      else f"refused (`{family}`); its test did not pass in this run")
        elif arch in apart:
            family = apart[arch]
            ok = results.get((APART_TEST, family)) == "passed"
            status = (f"derived at load and proven by its start-up check, plain tokens = no "
                      f"plugin, but measured apart from transformers (`{family}`: "
                      f"{derived.MEASURED_APART[family]}; cause not known), so not listed as "
                      "proven" if ok else f"measured apart (`{family}`); its test did not pass "
                      "in this run")
        elif arch in unimportable:
            family = unimportable[arch]
            _, module, error = derived.NOT_IMPORTABLE[family]
            ok = results.get((IMPORT_TEST, family)) == "passed"
            status = (f"not runnable on the CPU build, measured (`{family}`): `{module}` fails "
                      f"to import ({error}); elsewhere its layout is derived at load where its "
                      "layers allow (not over recurrent state), and only what the start-up "
                      "check proves is served" if ok
                      else f"not importable (`{family}`); its test did not pass in this run")
        else:
            status = ("not measured on the CPU build: a layout is derived at load where the "
                      "module tree allows, and only what its start-up check proves is served")
        lines.append(f"| `{arch}` | `{vllm_class}` | {status} |")
    return "\n".join(lines)


PREAMBLE = """# Model families: what is proven

Generated by `python tools/family_matrix.py --run` from a run of
`tests/integration/test_families.py`, `tests/integration/test_families_tp.py` and
`tests/integration/test_derived_layouts.py` (the `families` step of `make test`:
`pytest -m families`). Do not edit by hand.

Each family is a tiny random model built from a transformers config (`tests/families.py`:
4 layers, hidden 128, heads of 64, biases and norm weights randomised) and checked in float32
against transformers with forward hooks on its modules. **tested**: the values match
transformers to 1e-4 (relative, per row; attention patterns to 1e-5), on prompt and decode
rows, with the prompt prefilled in chunks of 16 tokens. **refused**: the point does not exist
in that family and a request for it fails up front naming it. `router_experts` (the experts
each token is routed to) comes with `router_logits`. **ablate/cap**: `mode="ablate"` at every
layer with a one-sided `cap`, against hooks doing the same edits; **attention steering**:
`steer_attention` (PASTA and a key bias) against transformers' eager attention doing the same
edit. The TP=2 column covers every point, Q/K, steering, ablate/cap, attention steering and
the stop monitor with two tensor-parallel workers (but Q and K around OLMo 2/3's norms, which
span every head and are not tapped under tensor parallelism).

"""


DERIVED_PREAMBLE = """## Derived layouts

Model classes without a written row get a layout derived from vLLM's module tree and proven on
the model's own weights when the engine serves its first lens request
([Model families](families.md#models-without-a-row-a-layout-derived-from-the-model-proven-on-its-own-weights)).
These are compared with transformers by `tests/integration/test_derived_layouts.py`: the
residual stream at every layer, every point the check proved at two layers (`attn_in` and
`mlp_in` but on post-norm layers, `attn_out_pre_norm` and `mlp_out_pre_norm` where a norm
follows the sublayers), `final_norm`, the attention kernel's points where they are served
(Q/K patterns, `attn_z` and `value` at two layers), steering, and plain requests
token-identical to vLLM without the plugin. `mlp_post` and `router_logits` are not offered on
a derived layout. The TP=2 column runs the check, the point comparison and steering with two
tensor-parallel workers.

"""

ARCHITECTURES_PREAMBLE = """## Every architecture vLLM registers

vLLM 0.32 registers these text-generation architectures
(`vllm.model_executor.models.registry._TEXT_GENERATION_MODELS`); the multimodal wrappers
measured follow them (their text models are the families above).

"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--junit", type=Path, nargs="+",
                        help="junit XML of finished pytest runs (the suite's and the families')")
    parser.add_argument("--run", action="store_true", help="run the family tests first")
    args = parser.parse_args()
    if args.run == (args.junit is not None):
        parser.error("give exactly one of --run and --junit")
    junits = args.junit
    if args.run:
        junits = [Path(tempfile.mkdtemp()) / "families.xml"]
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "families or not families",
                        *TESTS, f"--junitxml={junits[0]}"], cwd=ROOT, check=False)
    results = {}
    for junit in junits:
        results.update(outcomes(junit))
    table = render(results)
    OUT.write_text(PREAMBLE + table + "\n\n" + DERIVED_PREAMBLE + render_derived(results)
                   + "\n\n" + ARCHITECTURES_PREAMBLE + render_architectures(results) + "\n")
    print(table)
    print(f"written to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
