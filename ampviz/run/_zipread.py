"""Reading the zip archive of a run file as untrusted bytes: every failure is one RunFileError line.

A run file is an ``.npz`` (a zip of ``.npy`` members). A recorder that saves periodically appends
to it (``ampviz._runappend``): new members, then a new central directory, then a new end record,
leaving the earlier ones intact. A process killed mid-append leaves an incomplete tail after the
last complete end record; ``open_archive`` then reads the archive as it stood before that append
and says how many bytes it left out. Only regular files are opened (a FIFO or a device is refused
without reading a byte), and a directory listing more entries than a run file could have is
refused before zipfile parses it::

    with open_archive(Path("rank0.npz")) as (archive, torn):
        members = archive.infolist()
        with npy_member(path, archive, info, "counts", "iu", "integer counts") as member:
            member.shape, member.dtype          # checked before a byte of data is inflated
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import stat
import struct
import warnings
import zipfile

import numpy as np

from ._file import RunFileError, size_text

__all__ = ["open_archive", "npy_member", "corrupt_file", "holds_run", "MAX_ENTRIES"]

MAX_ENTRIES = 1000              # zip entries a run file may list (about ten, or ten per appended part)
_SCAN_BYTES = 256 << 20         # how far back an interrupted append is searched for (one save's worth)
_BLOCK = 1 << 20
_READ = 256 << 10               # inflated per read: zipfile holds about three copies of it for an instant
_EOCD, _LOCATOR, _EOCD64 = b"PK\x05\x06", b"PK\x06\x07", b"PK\x06\x06"
_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


@contextlib.contextmanager
def corrupt_file(path, what: str):
    """Any exception from parsing inside the block (other than RunFileError) becomes one RunFileError line:
    the reader's only input is the file, so whatever it raises is about the file."""
    try:
        yield
    except RunFileError:
        raise
    except MemoryError:
        raise RunFileError(f"{path}: {what}: not enough free memory to read it") from None
    except Exception as e:                       # zipfile, zlib, bz2, lzma, numpy header parsing, unicode
        detail = " ".join(str(e).split())[:200] or type(e).__name__
        raise RunFileError(f"{path}: not a readable ampviz run file ({what} is corrupt or truncated: "
                           f"{type(e).__name__}: {detail})") from None


@contextlib.contextmanager
def open_archive(path):
    """(zipfile.ZipFile, bytes left out after the last complete end record) of the run file ``path``."""
    f = _open_regular(path)
    try:
        with corrupt_file(path, "its zip directory"):
            size = os.fstat(f.fileno()).st_size
            end, record = _find_end(f, size)
            _check_directory(path, f, end, record)
            source = f if end == size else _Window(f, end)
        try:
            archive = zipfile.ZipFile(source)
        except Exception as e:
            raise RunFileError(f"{path}: not a readable ampviz run file (not a complete .npz archive: truncated, "
                               f"corrupt, or another kind of file: {' '.join(str(e).split())[:200]})") from None
        with archive:
            yield archive, size - end
    finally:
        f.close()


def holds_run(path) -> bool:
    """Whether ``path`` (links followed) is a regular file holding an ampviz run: a zip with ampviz metadata,
    or a zip too damaged to tell (a run cut off mid-save is still a run)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                return False
            f.seek(0)
            try:
                with zipfile.ZipFile(f) as archive:
                    return "meta.npy" in archive.namelist()
            except Exception:                  # noqa: BLE001 - unreadable as a zip: treated as a run
                return True
    except OSError:
        return False


def _open_regular(path):
    """The file opened for reading, refused unless it is a regular file (checked on the open descriptor:
    opening with O_NONBLOCK never waits on a FIFO, and fstat sees what was really opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise RunFileError(f"{path}: no such file") from None
    except PermissionError:
        raise RunFileError(f"{path}: permission denied") from None
    except (OSError, ValueError) as e:
        raise RunFileError(f"{path}: cannot be opened ({getattr(e, 'strerror', None) or e})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = next((text for test, text in _FILE_KINDS if test(mode)), "not a regular file")
        raise RunFileError(f"{path}: is {what}, not a run file; ampviz reads runs from regular files only")
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


# ---------------------------------------------------------------------------------------- the end
def _find_end(f, size: int):
    """(where the archive ends, its end record's fields or None). The end record closing the file, if
    there is one; else the last complete one before an interrupted append; else (size, None): zipfile says
    what is wrong."""
    tail_start = max(size - (1 << 16) - 22, 0)
    f.seek(tail_start)
    tail = f.read()
    at = tail.rfind(_EOCD)
    while at >= 0:
        record = _end_record(tail, at)
        if record is not None and tail_start + at + 22 + record[2] == size:
            return size, _resolve64(f, tail_start + at, record)
        at = tail.rfind(_EOCD, 0, at)
    return _last_complete_end(f, size)


def _end_record(data: bytes, at: int):
    """(entries, directory size, comment length, directory offset) of an end record at ``data[at:]``."""
    if len(data) < at + 22:
        return None
    entries, directory, offset, comment = struct.unpack_from("<HIIH", data, at + 10)
    return entries, directory, comment, offset


def _resolve64(f, at: int, record):
    """The end record's counts, from the zip64 record when the classic fields overflowed."""
    entries, directory, comment, offset = record
    if entries != 0xFFFF and directory != 0xFFFFFFFF and offset != 0xFFFFFFFF:
        return entries, directory, offset, at
    if at < 20 + 56:
        return None
    f.seek(at - 20)
    locator = f.read(20)
    if locator[:4] != _LOCATOR:
        return None
    f.seek(at - 20 - 56)                      # zipfile reads the zip64 record right before the locator
    zip64 = f.read(56)
    if zip64[:4] != _EOCD64:
        return None
    entries, directory, offset = struct.unpack_from("<QQQ", zip64, 32)
    return entries, directory, offset, at - 20 - 56


def _last_complete_end(f, size: int):
    """The last end record whose central directory ends right where the record (or its zip64 record)
    starts: where the archive stood before an append that did not finish."""
    stop, scanned = size, 0
    while stop > 0 and scanned < _SCAN_BYTES:
        start = max(stop - _BLOCK, 0)
        f.seek(start)
        block = f.read(stop - start + 21)       # overlap: a record cut by the block boundary is still seen
        at = block.rfind(_EOCD, 0, stop - start)
        while at >= 0:
            record = _end_record(block, at)
            if record is not None:
                resolved = _resolve64(f, start + at, record)
                if resolved is not None and resolved[2] + resolved[1] == resolved[3]:
                    return start + at + 22 + record[2], resolved
            at = block.rfind(_EOCD, 0, at)
        scanned += stop - start
        stop = start
    return size, None


def _check_directory(path, f, end: int, record) -> None:
    """Refuse a zip whose central directory is larger than a run file's could be, before zipfile parses
    it into one Python object per entry (a few MB of directory can list millions of entries)."""
    if record is None:
        return                                    # no end record found: zipfile says what is wrong
    entries, directory, offset, at = record
    if entries > MAX_ENTRIES or directory > MAX_ENTRIES * 1024:
        raise RunFileError(f"{path}: not an ampviz run (its zip directory lists {entries} entries in "
                           f"{size_text(directory)}; a run file has at most {MAX_ENTRIES})")
    if offset + directory > end:
        raise RunFileError(f"{path}: not a readable ampviz run file (its zip directory claims bytes "
                           f"{offset}..{offset + directory} of a {end}-byte archive)")


class _Window(io.RawIOBase):
    """The first ``size`` bytes of a file, read-only: the archive before an interrupted append."""

    def __init__(self, f, size: int):
        super().__init__()
        self._f, self._size, self._pos = f, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        if base + offset < 0:
            raise OSError("seek before the start of the file")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self._size - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got


# ------------------------------------------------------------------------------------ .npy members
class NpyMember:
    """One ``.npy`` member, header read and checked; its data is read with ``rows`` or ``read``."""

    def __init__(self, stream, shape, fortran: bool, dtype):
        self.stream, self.shape, self.fortran, self.dtype = stream, shape, fortran, dtype
        self.nbytes = math.prod(shape) * dtype.itemsize

    def read(self) -> np.ndarray:
        """The whole array, in native byte order."""
        data = np.empty(self.nbytes, dtype=np.uint8)
        self._fill(data)
        self._check_end()
        arr = data.view(self.dtype).reshape(self.shape, order="F" if self.fortran else "C")
        return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))

    def read_into(self, out: np.ndarray) -> None:
        """The whole array straight into ``out`` (C-contiguous, of this member's shape and native dtype)."""
        self._fill(out.reshape(-1).view(np.uint8))
        self._check_end()

    def rows(self, max_bytes: int):
        """(first row, rows) pieces of at most ``max_bytes`` (at least one row) of a C-order array."""
        per_row = math.prod(self.shape[1:]) * self.dtype.itemsize
        n = min(max(1, max_bytes // max(per_row, 1)), max(self.shape[0], 1))
        buffer = np.empty(n * per_row, dtype=np.uint8)
        for first in range(0, self.shape[0], n):
            k = min(n, self.shape[0] - first)
            self._fill(buffer[:k * per_row])
            yield first, buffer[:k * per_row].view(self.dtype).reshape((k,) + tuple(self.shape[1:]))
        self._check_end()

    def _fill(self, out: np.ndarray) -> None:
        pos = 0
        while pos < out.size:                    # read1: pieces of the inflated stream, no joined copies
            chunk = self.stream.read1(min(_READ, out.size - pos))
            if not chunk:
                raise EOFError(f"the data ends after {pos} of {out.size} bytes")
            out[pos:pos + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            pos += len(chunk)

    def _check_end(self) -> None:
        if self.stream.read(1):                  # reading to the end also checks the CRC
            raise ValueError("it holds more data than its header declares")


@contextlib.contextmanager
def npy_member(path, archive, info, name: str, kinds: str, what: str, shape=None):
    """The member ``info`` opened as an NpyMember, its header checked against the dtype kinds allowed, the
    ``shape`` expected (None: any; a leading None: any number of rows) and the bytes the archive holds;
    every failure inside the block is a RunFileError naming ``name``."""
    fmt = np.lib.format
    if info.flag_bits & 0x1:
        raise RunFileError(f"{path}: corrupt run: {name}: its zip member is encrypted (ampviz never encrypts a "
                           "run file)")
    with corrupt_file(path, name), archive.open(info) as stream, warnings.catch_warnings():
        warnings.simplefilter("error")                   # numpy's "Python 2 header" fallback: refused
        version = fmt.read_magic(stream)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"unsupported .npy version {version}")
        read_header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        declared, fortran, dtype = read_header(stream)
        if dtype.hasobject or dtype.kind not in kinds or dtype.fields is not None or dtype.subdtype is not None:
            raise RunFileError(f"{path}: corrupt run: {name}: expected {what}, got dtype {dtype}")
        if any(d < 0 for d in declared):
            raise RunFileError(f"{path}: corrupt run: {name}: negative dimension in shape {declared}")
        if shape is not None and (len(declared) != len(shape) or any(
                want is not None and d != want for d, want in zip(declared, shape))):
            expected = tuple("?" if d is None else d for d in shape)
            raise RunFileError(f"{path}: corrupt run: {name} has shape {declared}, expected "
                               f"{expected if len(expected) != 1 else f'({expected[0]},)'}")
        member = NpyMember(stream, declared, fortran, dtype)
        held = info.file_size - stream.tell()
        if member.nbytes != held:
            raise RunFileError(f"{path}: corrupt run: {name}: its header declares shape {declared} "
                               f"({size_text(member.nbytes)}) but the archive holds {size_text(max(held, 0))}")
        yield member
