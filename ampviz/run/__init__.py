"""The run: a recording's arrays (:class:`Run`), its file format, its checks and its vocabulary.

    from ampviz.run import Run, load
    run = load("runs/demo")                        # the same as Run.load: a file, or a directory of rank files
    run.counts_in("unscaled")                      # (ranks, steps, tensors, bins)

``run.py`` holds :class:`Run`; ``_schema`` the vocabulary (``KINDS``, ``DOMAINS``, and ``KIND_DOMAIN``: which
kind is stored scaled or unscaled); the private modules the file format (``_file``), writing (``_write``),
reading untrusted files within a memory budget (``_zipread``, ``_load``) and the checks (``_checks``); per-row
cast predictions are ``histogram.fate_rows``. The names below ``__all__`` are for ampviz's own modules (the
recorder's saves, ``ampviz info``, the report), not a supported API.
"""

from ._blocks import RunBlocks
from ._file import SCHEMA_VERSION, RunFileError
from ._load import load
from ._schema import DOMAINS, KIND_DOMAIN, KINDS, SCALE_FREE
from .run import VIEWS, Run

__all__ = ["Run", "RunBlocks", "RunFileError", "load", "SCHEMA_VERSION", "DOMAINS", "VIEWS", "KINDS", "KIND_DOMAIN",
           "SCALE_FREE"]

# for ampviz's own modules (record/ saves, cli, report): not a supported API
from ._file import MAGIC, Budget, strict_json  # noqa: E402, F401
from ._write import RunFileWriter  # noqa: E402, F401
from ._zipread import holds_run  # noqa: E402, F401
