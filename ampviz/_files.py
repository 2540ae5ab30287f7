"""Writing files safely: atomically (a temp file beside the target, then a rename), with the usual permissions.

A target reached through a symbolic link is written where the link points (the link stays a link);
a target that is a character device or a FIFO (``-o /dev/stdout`` piped, ``/dev/null``) is written
through, in place: a device is never replaced by a regular file. A process that dies mid-write
leaves the previous file intact and, at worst, a temp file ``.<target>.<random>.ampviz-tmp`` beside
it. Its writer holds a lock on it (``flock``) while it works, so the next write of that target (or
``clean_stale``, which a Recorder calls when it starts) removes it as soon as its writer is gone;
where locks are not available, once it is ten minutes old::

    atomic_write("runs/report.html", lambda f: f.write(page), text=True)
"""

from __future__ import annotations

import glob
import os
import stat
import tempfile
import time
from pathlib import Path

try:
    import fcntl
except ImportError:                    # pragma: no cover - Windows: the age rule alone
    fcntl = None

__all__ = ["atomic_write", "clean_stale", "write_target", "TMP_SUFFIX"]

TMP_SUFFIX = ".ampviz-tmp"
_STALE_SECONDS = 600                   # without locks: a younger temp file may belong to a writer at work


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_target(target) -> Path | None:
    """Where writing ``target`` lands: the regular file (existing or not) at the end of any symbolic links,
    or None for a character device or a FIFO, which is written through in place. A directory, a block
    device or a socket is refused (IsADirectoryError / OSError)."""
    target = Path(target)
    try:
        mode = os.stat(target).st_mode         # follows links
    except FileNotFoundError:
        return Path(os.path.realpath(target))  # a new file, or where a dangling link points
    if stat.S_ISREG(mode):
        return Path(os.path.realpath(target))
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
        return None
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(f"{target} is a directory")
    kind = "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
    raise OSError(f"{target} is {kind}; ampviz writes regular files, character devices and FIFOs only")


def atomic_write(target, write, *, text: bool = False) -> Path:
    """Call ``write(f)`` on a temp file in ``target``'s directory, fsync it, and rename it over ``target``.

    The file gets the permissions of an ordinary new file (0666 minus the umask; ``mkstemp`` alone
    makes 0600). Parent directories are created. A symbolic link is followed (the file it points to is
    replaced, not the link); a character device or FIFO is written in place. Returns ``target`` as a Path.
    """
    target = Path(target)
    real = write_target(target)
    opened = {"encoding": "utf-8"} if text else {}
    if real is None:                                   # /dev/null, a terminal, a pipe: in place
        with open(target, "w" if text else "wb", **opened) as f:
            write(f)
        return target
    real.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(real)
    fd, tmp = _locked_temp(real)
    lock = os.dup(fd)                      # the lock lasts until the rename, after the file is closed
    try:
        with os.fdopen(fd, "w" if text else "wb", **opened) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, real)              # atomic: readers see the old file or the new one
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        os.close(lock)
    return target


def _locked_temp(real: Path):
    """(fd, path) of a new temp file beside ``real``, locked for as long as the descriptor is open."""
    while True:
        fd, tmp = tempfile.mkstemp(prefix=f".{real.name}.", suffix=TMP_SUFFIX, dir=real.parent)
        if fcntl is None:
            return fd, tmp
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:                    # no locks on this file system: the age rule protects it
            return fd, tmp
        if os.fstat(fd).st_nlink:          # not removed by a cleaner that locked it first
            return fd, tmp
        os.close(fd)


def clean_stale(real: Path) -> None:
    """Remove the temp files of ``real`` that a killed writer left: those no process holds a lock on
    (without locks: those older than ten minutes). Only regular files named as ours are touched."""
    real = Path(real)
    for stale in real.parent.glob(f".{glob.escape(real.name)}.*{TMP_SUFFIX}"):
        try:
            fd = os.open(stale, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                continue
            if not _writer_gone(fd, info):
                continue
            if os.lstat(stale).st_ino == info.st_ino:     # still the file we locked
                os.unlink(stale)
        except OSError:
            pass
        finally:
            os.close(fd)


def _writer_gone(fd: int, info) -> bool:
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True                    # kept until the descriptor closes, after the unlink
        except BlockingIOError:
            return False                   # a writer at work
        except OSError:
            pass                           # no locks here
    return time.time() - info.st_mtime > _STALE_SECONDS
