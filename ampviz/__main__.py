"""``python -m ampviz ...`` is the ``ampviz`` command (see :mod:`ampviz.cli`)::

    python -m ampviz info runs/demo/run.npz
"""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
