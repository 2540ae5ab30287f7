"""The core type-checks: mypy, with the project's [tool.mypy] settings, finds no error in PACKAGES."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the core whose annotations are checked: the recorder, the run and its file format, the histogram and formats, the
# replayed loss-scaler policies, the counting backends, the doctor, the block statistics
PACKAGES = ("ampviz/record", "ampviz/run", "ampviz/histogram.py", "ampviz/formats.py", "ampviz/replay",
            "ampviz/_counting", "ampviz/doctor", "ampviz/blocks")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                       reason="mypy is not installed (it is in ampviz[test]: pip install -e '.[test]')"),
]


def mypy(*targets) -> subprocess.CompletedProcess:
    """mypy run from the repository root (so it reads pyproject.toml's [tool.mypy]) by this interpreter."""
    return subprocess.run([sys.executable, "-m", "mypy", *map(str, targets)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)


def test_the_core_has_no_type_errors():
    out = mypy(*PACKAGES)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    files = sum(1 if (ROOT / p).is_file() else len(list((ROOT / p).rglob("*.py"))) for p in PACKAGES)
    checked = re.search(r"Success: no issues found in (\d+) source files", out.stdout)
    assert checked and int(checked[1]) == files, out.stdout[-2000:]       # every file of PACKAGES was checked


def test_the_settings_report_a_type_error(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def half(x: int) -> int:\n    return x / 2\n")
    out = mypy(bad)
    assert out.returncode == 1 and 'Incompatible return value type (got "float", expected "int")' in out.stdout, \
        out.stdout[-2000:] + out.stderr[-2000:]
