"""Test-suite wiring for the whole repository (tests/ and the notebooks in lessons/).

* The notebooks run as tests whenever nbmake is installed (``pip install -e ".[test]"``): a plain
  ``python -m pytest`` runs everything, and ``python -m pytest tests/test_run.py`` works without nbmake.
* Every test gets one suite marker from where it lives, so a suite is one ``-m``:

  ==============  ============================================  =============================================
  marker          what                                          run it alone
  ==============  ============================================  =============================================
  ``core``        tests/*.py: the practitioner core             ``python -m pytest -m "core and not slow"``
  ``classroom``   tests/lessons/: the lessons' helper modules   ``python -m pytest -m classroom``
  ``notebook``    lessons/*.ipynb, executed headless            ``python -m pytest -m notebook``
  ``integration`` tests/integrations/: HF, Lightning, ...       ``python -m pytest -m integration``
  ``browser``     tests/browser/: JupyterLab and the report     ``python -m pytest -m browser``
  ==============  ============================================  =============================================
"""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
SUITES = {"tests/lessons": "classroom", "tests/integrations": "integration", "tests/browser": "browser",
          "lessons": "notebook", "tests": "core"}


def pytest_configure(config):
    if config.pluginmanager.hasplugin("nbmake"):
        config.option.nbmake = True          # collect lessons/*.ipynb (what `--nbmake` does)


def suite_of(path: Path) -> str | None:
    """The suite marker of a test file: the longest of SUITES' folders that holds it."""
    rel = path.resolve().relative_to(ROOT).as_posix() if path.resolve().is_relative_to(ROOT) else None
    if rel is None:
        return None
    folders = [f for f in SUITES if rel.startswith(f + "/")]
    return SUITES[max(folders, key=len)] if folders else None


def pytest_collection_modifyitems(config, items):
    for item in items:
        suite = suite_of(Path(str(item.path)))
        if suite is not None:
            item.add_marker(getattr(pytest.mark, suite))
