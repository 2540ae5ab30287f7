"""Optional dependencies, by audience: one line naming the extra to install when one is missing.

``pip install ampviz`` records, saves, loads, summarises and diagnoses runs with torch and numpy alone.
The extras add the rest (see pyproject.toml)::

    viz       plotly, ipywidgets, anywidget      figures, widgets, the HTML report
    lessons   viz + JupyterLab, scikit-learn, tqdm   the notebooks, the demo and the examples' data
"""

from __future__ import annotations

import importlib.util

__all__ = ["require", "MissingExtra", "Unavailable", "EXTRA_OF"]

# the extra that provides each optional top-level module
# (tensorboard, wandb and pandas are named by package: a user of `ampviz export` or `Run.to_pandas` installs the
# one they want, not a whole extra)
EXTRA_OF = {"plotly": "viz", "ipywidgets": "viz", "anywidget": "viz", "sklearn": "lessons", "tqdm": "lessons",
            "jupyterlab": "lessons"}
_PACKAGE = {"sklearn": "scikit-learn"}


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message says which extra provides it."""


class Unavailable(RuntimeError):
    """An installed optional service cannot be used as set up (W&B without a login); the message says how."""


def require(module: str, feature: str) -> None:
    """Raise :class:`MissingExtra` naming the extra when ``module`` cannot be imported."""
    if importlib.util.find_spec(module) is None:
        extra = EXTRA_OF.get(module)
        how = f'pip install "ampviz[{extra}]"' if extra else f"pip install {_PACKAGE.get(module, module)}"
        raise MissingExtra(f"{feature} needs {_PACKAGE.get(module, module)}, which is not installed: {how}")
