"""Writing run files: whole (atomically), or by appending the rows recorded since the last save.

A periodic save must cost what is new, not what was recorded before: :class:`RunFileWriter` appends
the new rows of every array as new parts (``counts.3.npy`` ...) and a new ``meta.npy`` after the
end of the file, then a new central directory (listing the parts so far and the new metadata) and
a new end record. Until that end record is complete the file's previous end record is its last
complete one, so a process killed mid-append leaves the file as it was before the append, plus a
tail the reader leaves out (``_zipread``). An append that fails (disk full) is cut back off.
The file is written whole again, atomically, when nothing was written yet, when the rows already
written changed (a recorder's decimation dropped some), when the file on disk is not the one this
writer left, and every ``MAX_PARTS`` parts, so the file's directory stays small::

    writer = RunFileWriter(Path("runs/rank0.npz"))
    writer.save(meta, full=lambda: arrays, tail=lambda: new_rows, rewrite=False)

Members are deflated (zlib level 1: on histograms about as small as numpy's default level, several
times faster) into memory, then written with their sizes: no seek, so a FIFO works too.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from .._files import atomic_write
from ._file import SCHEMA_ONE_PIECE, SCHEMA_VERSION, meta_text, part_name

__all__ = ["write", "RunFileWriter"]

MAX_PARTS = 64                   # parts per array before the file is written whole again
_LEVEL = 1
_PIECE = 16 << 20                # bytes of an array compressed at a time
_U32 = 0xFFFFFFFF
_DOS_DATE = (1 << 5) | 1         # 1980-01-01: the same bytes for the same run


def write(target, arrays: dict, meta: dict) -> Path:
    """Write one rank's arrays and JSON metadata to ``target`` atomically (temp file + rename), in one piece."""
    members = {f"{name}.npy": arr for name, arr in arrays.items()}
    members["meta.npy"] = np.array(meta_text(meta, SCHEMA_ONE_PIECE))
    atomic_write(target, lambda f: _write_archive(f, members))
    return Path(target)


class RunFileWriter:
    """Keeps one rank file up to date by appending parts (see the module docstring)."""

    def __init__(self, target):
        self.target = Path(target)
        self.parts = 0                       # parts of each array in the file (0: nothing written yet)
        self._entries: list = []             # the arrays' central directory entries, in file order
        self._stamp = None                   # (device, inode, size) of the file as this writer left it

    def save(self, meta: dict, full, tail, rewrite: bool) -> None:
        """Bring the file up to date: append ``tail()`` (arrays of the rows since the last save) or, when
        needed (``rewrite``, nothing written yet, the file changed, MAX_PARTS parts), write ``full()`` whole."""
        if not (rewrite or self.parts == 0 or self.parts >= MAX_PARTS):
            try:
                self._append(tail(), meta)
                return
            except _Changed:
                pass
        self._write_whole(full(), meta)

    def _write_whole(self, arrays: dict, meta: dict) -> None:
        members = {f"{name}.npy": arr for name, arr in arrays.items()}
        members["meta.npy"] = np.array(meta_text(meta, SCHEMA_ONE_PIECE))
        written: dict = {}
        atomic_write(self.target, lambda f: written.update(entries=_write_archive(f, members)))
        self._entries = [e for e in written["entries"] if e.name != "meta.npy"]
        self.parts = 1
        self._stamp = _stamp(os.stat(self.target))

    def _append(self, arrays: dict, meta: dict) -> None:
        try:
            f = open(self.target, "r+b")
        except OSError:
            raise _Changed from None
        with f:
            info = os.fstat(f.fileno())
            if _stamp(info) != self._stamp:
                raise _Changed                # replaced, removed or written by someone else: write it whole
            end = f.seek(0, os.SEEK_END)
            try:
                out = _Counted(f, end)
                entries = list(self._entries)
                entries += [_write_member(out, part_name(name, self.parts), arr) for name, arr in arrays.items()]
                meta_entry = _write_member(out, "meta.npy", np.array(meta_text(meta, SCHEMA_VERSION)))
                _write_directory(out, entries + [meta_entry])
                f.flush()
                os.fsync(f.fileno())
            except BaseException:
                try:
                    f.truncate(end)           # the file as it was; if this fails, the reader leaves the tail out
                except OSError:
                    pass
                raise
            self._entries, self.parts = entries, self.parts + 1
            self._stamp = _stamp(os.fstat(f.fileno()))


class _Changed(Exception):
    """The file is not the one this writer left: it is written whole instead."""


def _stamp(info) -> tuple:
    return info.st_dev, info.st_ino, info.st_size


class _Entry:
    """What the central directory says about one member."""

    __slots__ = ("name", "offset", "crc", "csize", "usize")

    def __init__(self, name, offset, crc, csize, usize):
        self.name, self.offset, self.crc, self.csize, self.usize = name, offset, crc, csize, usize


class _Counted:
    """A binary file written sequentially from ``position`` on, keeping count of where it is."""

    def __init__(self, f, position: int = 0):
        self.f, self.position = f, position

    def write(self, data) -> None:
        self.f.write(data)
        self.position += len(data)


def _write_archive(f, members: dict) -> list:
    out = _Counted(f)
    entries = [_write_member(out, name, arr) for name, arr in members.items()]
    _write_directory(out, entries)
    return entries


def _npy_header(arr: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    header = np.lib.format.header_data_from_array_1_0(arr)
    try:
        np.lib.format.write_array_header_1_0(buffer, header)
    except ValueError:                         # a header beyond 64 kB (never for a run's arrays)
        buffer = io.BytesIO()
        np.lib.format.write_array_header_2_0(buffer, header)
    return buffer.getvalue()


def _write_member(out: _Counted, name: str, arr) -> _Entry:
    """One ``.npy`` member: compressed into memory (its sizes are then known), then written."""
    arr = np.asarray(arr)
    if not arr.flags.c_contiguous:                 # (np.ascontiguousarray would make a 0-d array 1-d)
        arr = arr.copy(order="C")
    if arr.dtype.hasobject:
        raise TypeError(f"{name}: object arrays are never written (they would need pickle)")
    raw = arr.reshape(-1).view(np.uint8)
    header = _npy_header(arr)
    compressor, crc, pieces = zlib.compressobj(_LEVEL, zlib.DEFLATED, -15), zlib.crc32(header), []
    pieces.append(compressor.compress(header))
    for start in range(0, raw.size, _PIECE):
        piece = raw[start:start + _PIECE]
        crc = zlib.crc32(piece, crc)
        pieces.append(compressor.compress(piece))
    pieces.append(compressor.flush())
    usize, csize = len(header) + raw.size, sum(len(p) for p in pieces)
    entry = _Entry(name, out.position, crc, csize, usize)
    big = usize >= _U32 or csize >= _U32
    encoded = name.encode("ascii")
    extra = struct.pack("<HHQQ", 1, 16, usize, csize) if big else b""
    out.write(struct.pack("<4s5H3I2H", b"PK\x03\x04", 45 if big else 20, 0, zlib.DEFLATED, 0, _DOS_DATE, crc,
                          _U32 if big else csize, _U32 if big else usize, len(encoded), len(extra)))
    out.write(encoded + extra)
    for piece in pieces:
        out.write(piece)
    return entry


def _write_directory(out: _Counted, entries: list) -> None:
    """The central directory of ``entries``, then the end record (zip64 records when a field overflows)."""
    start = out.position
    for e in entries:
        fields = [v for v in (e.usize, e.csize, e.offset) if v >= _U32]
        extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
        encoded = e.name.encode("ascii")
        version = 45 if fields else 20
        out.write(struct.pack("<4s6H3I5H2I", b"PK\x01\x02", (3 << 8) | version, version, 0, zlib.DEFLATED, 0,
                              _DOS_DATE, e.crc, min(e.csize, _U32), min(e.usize, _U32), len(encoded), len(extra),
                              0, 0, 0, 0o644 << 16, min(e.offset, _U32)))
        out.write(encoded + extra)
    size, count = out.position - start, len(entries)
    if count >= 0xFFFF or start >= _U32 or size >= _U32:
        record = out.position
        out.write(struct.pack("<4sQ2H2I4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size, start))
        out.write(struct.pack("<4sIQI", b"PK\x06\x07", 0, record, 1))
    out.write(struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                          min(size, _U32), min(start, _U32), 0))
