"""Everything that is shown, runs: every module's doctests, the Python blocks of the README and docs/*.md (whose
relative links must point to files), the docs figure script."""

import doctest
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                 for p in (ROOT / "ampviz").rglob("*.py") if p.name != "__main__.py")


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = finder.find(module, name, globs={})
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} doctest examples failed"


DOCS = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
MIN_BLOCKS = {"README.md": 3, "docs/integrations.md": 4, "docs/doctor.md": 1}   # so a lost block is noticed


def python_blocks(doc: str) -> list[str]:
    return re.findall(r"```python\n(.*?)\n```", (ROOT / doc).read_text(), re.S)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    """`ampviz demo -o demo/`, run once for every page whose blocks read demo/run.npz."""
    where = tmp_path_factory.mktemp("demo")
    from ampviz.cli import main
    assert main(["demo", "-o", str(where / "demo"), "--steps", "40", "--quiet"]) == 0
    return where / "demo"


@pytest.mark.parametrize("doc", DOCS)
def test_python_blocks_run(doc, demo_dir, tmp_path, monkeypatch):
    """Each page's blocks run in order, in one namespace of their own (a page imports what it uses), in a fresh
    directory where `ampviz demo -o demo/` ran."""
    blocks = python_blocks(doc)
    assert len(blocks) >= MIN_BLOCKS.get(doc, 0), f"{doc}: {len(blocks)} python blocks"
    shutil.copytree(demo_dir, tmp_path / "demo")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__doc__"}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"{doc} python block {i + 1}", "exec"), namespace)
        except Exception as e:                    # name the block, not just the line inside it
            raise AssertionError(f"{doc} python block {i + 1} failed: {type(e).__name__}: {e}\n{block}") from e


def test_every_doc_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [doc for doc in DOCS[1:] if f"]({doc})" not in readme]
    assert not missing, f"README.md links to none of {missing}"


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_every_relative_link_in_the_readme_and_docs_points_to_a_file():
    broken, seen = [], 0
    for doc in DOCS + ["lessons/README.md", "CHANGELOG.md"]:
        for target in LINK.findall((ROOT / doc).read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):   # https:, mailto:, an anchor
                continue
            seen += 1
            path = (ROOT / doc).parent / target.split("#", 1)[0]
            if not path.exists():
                broken.append(f"{doc}: ({target})")
    assert seen >= 10, seen                       # the README's pictures and its links to docs/ at least
    assert not broken, "links to nothing:\n" + "\n".join(broken)


@pytest.mark.slow
def test_docs_figure_script_makes_both_pictures(tmp_path):
    if importlib.util.find_spec("kaleido") is None or not Path("/usr/bin/chromium").exists():
        pytest.skip("needs kaleido and Chromium to write PNGs")
    env = dict(os.environ, BROWSER_PATH="/usr/bin/chromium")
    out = subprocess.run([sys.executable, str(ROOT / "docs" / "readme_figures.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    for name in ("histogram.png", "scale_trace.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    assert "skipped" in out.stdout
