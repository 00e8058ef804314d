"""The documentation site builds with ``mkdocs build --strict`` (what ``make docs`` runs): a
broken link or anchor between pages, a page missing from the nav, a missing included file or an
API reference that does not resolve fails it. And the README's links, which the site does not
build, lead to files and headings that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="the docs extra is not installed "
                                           '(pip install -e ".[docs]")')
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out


def test_the_site_builds_strictly(site):
    assert (site / "index.html").is_file()
    # The benchmarks page shows benchmarks/RESULTS.md itself, included at build time.
    first_section = re.search(r"^## (.+)$", (ROOT / "benchmarks" / "RESULTS.md").read_text(),
                              re.M).group(1)
    title = re.sub(r"`([^`]*)`", r"<code>\1</code>", first_section)
    assert title in (site / "benchmarks" / "index.html").read_text()
    # The API reference is generated from the docstrings of the public names.
    api = (site / "api" / "index.html").read_text()
    import vllm_lens
    for name in vllm_lens.__all__:
        assert f'id="vllm_lens.{name}"' in api, name


def test_readme_links_lead_somewhere(site):
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        assert target, f"README link {link!r}: the README's own sections moved to docs/"
        assert (ROOT / target).exists(), f"README link {link!r}: no such file"
        if anchor and target.startswith("docs/") and target.endswith(".md"):
            page = site / Path(target).relative_to("docs").with_suffix("") / "index.html"
            if page.parent.name == "index":  # docs/index.md, docs/api/index.md
                page = page.parent.parent / "index.html"
            assert f'id="{anchor}"' in page.read_text(), f"README link {link!r}: no such heading"
