"""Everything that is shown, runs: every module's doctests, the README's Python blocks, the docs figure script."""

import doctest
import importlib
import importlib.util
import os
import re
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


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    """The blocks run in order, in one namespace, in a fresh directory where `ampviz demo -o demo/` ran."""
    blocks = readme_python_blocks()
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)
    from ampviz.cli import main
    assert main(["demo", "-o", "demo", "--steps", "40", "--quiet"]) == 0
    namespace = {"__name__": "__readme__"}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as e:                    # name the block, not just the line inside it
            raise AssertionError(f"README python block {i + 1} failed: {type(e).__name__}: {e}\n{block}") from e


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
