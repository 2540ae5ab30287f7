"""Where a Recorder saves, checked at construction, not after hours of training::

    path = check_path("runs/exp.npz")                # ValueError now if it could never be written
    rank_file(path, world=2, rank=1)                 # runs/exp.rank1.npz
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["check_path", "rank_file"]


def check_path(path):
    """``path`` as a Path if a run can be written there: a file ending in ``.npz``, or a directory (which
    receives ``rank{r}.npz``); a clear error otherwise. Nothing is created yet."""
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a str or os.PathLike (a file ending in .npz, or a directory), "
                        f"got {type(path).__name__}")
    text = os.fsdecode(os.fspath(path))
    if not text.strip():
        raise ValueError("path: empty; give a file ending in .npz, or a directory (it receives rank{r}.npz)")
    p = Path(text).expanduser()
    suffix = p.suffix.lower()
    if suffix != ".npz" and p.is_dir():              # an existing directory is a directory, dots or not
        suffix = ""
    if suffix not in ("", ".npz"):
        raise ValueError(f"path: {text!r} ends in {p.suffix!r}; give a file ending in .npz, or a directory "
                         f"(an existing one, or a new name without a dot; it receives rank{{r}}.npz)")
    if suffix == ".npz" and p.is_dir():
        raise ValueError(f"path: {text!r} is a directory, but a name ending in .npz is taken for a run file; "
                         f"give a file name, or a directory without the .npz ending")
    if suffix == "" and p.resolve() == Path(p.resolve().anchor):
        raise ValueError(f"path: {text!r} is the file-system root; give a file ending in .npz, or a directory of "
                         f"its own (it receives rank{{r}}.npz)")
    if suffix == "" and p.exists() and not p.is_dir():
        raise ValueError(f"path: {text!r} is an existing file, not a directory; give a file ending in .npz, "
                         f"or a directory (it receives rank{{r}}.npz)")
    _check_writable(p.parent if suffix == ".npz" else p, text)
    return p


def _check_writable(directory: Path, text: str) -> None:
    ancestor = directory
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"path: cannot write under {text!r}: {str(ancestor)!r} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=ancestor):    # a real write: permissions, read-only file systems
            pass
    except OSError as e:
        raise ValueError(f"path: cannot write under {text!r}: directory {str(ancestor)!r} is not writable "
                         f"({e.strerror or e})") from None


def rank_file(path: Path, world: int, rank: int) -> Path:
    """The file this rank writes: ``path`` itself (one rank, ``.npz``), ``<stem>.rank{r}.npz`` beside it (several
    ranks), or ``path / rank{r}.npz`` (a directory)."""
    if path.suffix.lower() == ".npz" and not path.is_dir():
        return path if world == 1 else path.with_name(f"{path.stem}.rank{rank}.npz")
    return path / f"rank{rank}.npz"
