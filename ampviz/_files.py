"""Writing files safely: atomically (a temp file beside the target, then a rename), with the usual permissions.

A process that dies mid-write leaves the previous file intact and, at worst, a temp file named
``.<target>.<random>.ampviz-tmp`` beside it, which a later write of that target removes once it
is ten minutes old (a younger one may belong to a writer still at work).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

__all__ = ["atomic_write", "TMP_SUFFIX"]

TMP_SUFFIX = ".ampviz-tmp"
_STALE_SECONDS = 600


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(target, write, *, text: bool = False) -> Path:
    """Call ``write(f)`` on a temp file in ``target``'s directory, fsync it, and rename it over ``target``.

    The file gets the permissions of an ordinary new file (0666 minus the umask; ``mkstemp`` alone
    makes 0600). Parent directories are created. Returns ``target`` as a Path.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.*{TMP_SUFFIX}"):     # left by a killed writer
        try:
            if time.time() - stale.stat().st_mtime > _STALE_SECONDS:
                stale.unlink()
        except OSError:
            pass
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TMP_SUFFIX, dir=target.parent)
    try:
        with os.fdopen(fd, "w" if text else "wb", **({"encoding": "utf-8"} if text else {})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)            # atomic: readers see the old file or the new one
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target
