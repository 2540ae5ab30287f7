"""The run file format: one compressed ``.npz`` per rank, JSON metadata, no pickle.

Entries: ``meta`` (a 0-d unicode array holding JSON: magic "ampviz-run", schema version, rank,
tensor names/kinds/dtypes, recorder settings), the arrays in ``ARRAYS`` and, when recorded, those in
``OPTIONAL_ARRAYS``. Writes are atomic
(``ampviz._files.atomic_write``: a temp file in the same directory, then a rename), so a process that dies mid-write
leaves the previous file intact.

Reads treat the file as untrusted (run files travel with bug reports): only regular files are opened
(a FIFO, ``/dev/zero`` or a socket is refused without reading a byte); every entry's declared size
(the zip directory's, then the ``.npy`` header's shape) is checked against the shape the metadata
implies and against a budget (``max_run_bytes()``, 2 GiB by default, ``AMPVIZ_MAX_RUN_BYTES`` to
change it) before anything is inflated; arrays are inflated in chunks into their final buffer;
``allow_pickle`` is never on. Every failure is a :class:`RunFileError` naming the file and the field::

    arrays, meta = read(Path("run.npz"))        # canonical dtypes: int64 steps/counts, float64 scales
"""

from __future__ import annotations

import json
import math
import os
import stat
import warnings
import zipfile
import zlib
from pathlib import Path

import numpy as np

from ._counting import NBINS
from ._files import atomic_write

SCHEMA_VERSION = 1
MAGIC = "ampviz-run"
ARRAYS = ("steps", "loss", "loss_scale", "next_scale", "skipped", "hist_steps", "counts")
OPTIONAL_ARRAYS = ("grad_order", "scheduler_steps")    # written when recorded; files without them still load

_META_BYTES = 64 << 20           # the JSON metadata: names of a few hundred thousand tensors
_CHUNK = 4 << 20                 # inflate at most this much at a time into the array's own buffer
_DEFAULT_RUN_BYTES = 2 << 30     # 8x a Recorder's default max_bytes of histograms
_MAX_ENTRIES = 1000              # zip entries a run file may list (it has about ten)
# what each entry may hold (numpy dtype kinds) and the dtype it is loaded as
_KINDS = {"steps": ("iu", np.int64, "integer step numbers"), "hist_steps": ("iu", np.int64, "integer step numbers"),
          "loss": ("fiu", np.float64, "real numbers"), "loss_scale": ("fiu", np.float64, "real numbers"),
          "next_scale": ("fiu", np.float64, "real numbers"), "skipped": ("b", np.bool_, "booleans"),
          "counts": ("iu", np.int64, "integer counts"), "grad_order": ("iu", np.int32, "integer positions"),
          "scheduler_steps": ("iu", np.int64, "integer step counts")}
_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class RunFileError(ValueError):
    """A run file is missing, corrupt, truncated, foreign, hostile or from a newer ampviz."""


def max_run_bytes() -> int:
    """Bytes of arrays one run file may inflate to (``AMPVIZ_MAX_RUN_BYTES``, default 2 GiB)."""
    text = os.environ.get("AMPVIZ_MAX_RUN_BYTES")
    if not text:
        return _DEFAULT_RUN_BYTES
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise RunFileError(f"AMPVIZ_MAX_RUN_BYTES: expected a positive number of bytes, got {text!r}")
    return value


def write(target: Path, arrays: dict, meta: dict) -> None:
    """Write one rank's arrays and JSON metadata to ``target`` atomically (temp file + rename)."""
    meta = dict(meta, magic=MAGIC, schema=SCHEMA_VERSION)
    text = json.dumps(strict_json(meta), allow_nan=False)
    atomic_write(target, lambda f: np.savez_compressed(f, meta=np.array(text), **arrays))


def strict_json(value):
    """``value`` as plain JSON data: numpy scalars and arrays as Python numbers and lists, non-finite
    floats as None (strict JSON has no NaN or Infinity), anything else unknown as its ``str``."""
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    if isinstance(value, np.ndarray):
        return strict_json(value.tolist())
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if value is None or isinstance(value, str):
        return value
    return str(value)


def read(path: Path) -> tuple[dict, dict]:
    """(arrays, metadata) of one run file, checked; raises RunFileError saying which file and what."""
    path = Path(path)
    with _open_regular(path) as f:
        _check_directory(path, f)
        try:
            archive = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError) as e:
            raise RunFileError(f"{path}: not a readable ampviz run file (not a complete .npz archive: truncated, "
                               f"corrupt, or another kind of file: {e})") from None
        with archive:
            return _read_archive(path, archive)


def _open_regular(path: Path):
    """The file opened for reading, refused unless it is a regular file (checked on the open descriptor:
    opening with O_NONBLOCK never waits on a FIFO, and fstat sees what was really opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise RunFileError(f"{path}: no such file") from None
    except PermissionError:
        raise RunFileError(f"{path}: permission denied") from None
    except OSError as e:
        raise RunFileError(f"{path}: cannot be opened ({e.strerror or e})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = next((text for test, text in _FILE_KINDS if test(mode)), "not a regular file")
        raise RunFileError(f"{path}: is {what}, not a run file; ampviz reads runs from regular files only")
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _check_directory(path: Path, f) -> None:
    """Refuse a zip whose central directory is larger than a run file's could be, before zipfile parses
    it into one Python object per entry (a few MB of directory can list millions of entries)."""
    try:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(size - (1 << 16) - 22, 0))
        tail = f.read()
    except OSError:
        return                                        # zipfile reports the unreadable file
    at = tail.rfind(b"PK\x05\x06")                  # end of central directory record
    if at < 0 or len(tail) < at + 22:
        return                                        # not a zip: zipfile says so
    entries, directory = int.from_bytes(tail[at + 10:at + 12], "little"), int.from_bytes(tail[at + 12:at + 16],
                                                                                         "little")
    locator = tail.rfind(b"PK\x06\x07", 0, at)          # zip64: the real counts are in the zip64 record
    if locator >= 0 and (entries == 0xFFFF or directory == 0xFFFFFFFF):
        f.seek(int.from_bytes(tail[locator + 8:locator + 16], "little"))
        record = f.read(56)
        if record[:4] == b"PK\x06\x06":
            entries, directory = int.from_bytes(record[32:40], "little"), int.from_bytes(record[40:48], "little")
    f.seek(0)
    if entries > _MAX_ENTRIES or directory > _MAX_ENTRIES * 1024:
        raise RunFileError(f"{path}: not an ampviz run (its zip directory lists {entries} entries in "
                           f"{_size(directory)}; a run file has about ten)")


def _read_archive(path: Path, archive: zipfile.ZipFile) -> tuple[dict, dict]:
    members = {info.filename: info for info in archive.infolist()}
    if "meta.npy" not in members:
        raise RunFileError(f"{path}: not an ampviz run (an .npz without ampviz metadata)")
    budget = [max_run_bytes()]                        # what is left to inflate, in bytes
    meta = _read_meta(path, archive, members["meta.npy"], budget)
    missing = [a for a in ARRAYS if f"{a}.npy" not in members]
    if missing:
        raise RunFileError(f"{path}: corrupt ampviz run: missing arrays {missing}")
    names = meta.get("tensor_names", [])
    if not isinstance(names, list):
        raise RunFileError(f"{path}: corrupt run: tensor_names: expected a list of names, got "
                           f"{type(names).__name__}")
    arrays = {}
    for name in ("steps", "hist_steps"):              # 1-D: they fix every other entry's shape
        arrays[name] = _read_array(path, archive, members[f"{name}.npy"], name, budget, None)
        if arrays[name].ndim != 1:
            raise RunFileError(f"{path}: corrupt run: {name} has shape {arrays[name].shape}, expected (n,)")
    n, h, t = arrays["steps"].size, arrays["hist_steps"].size, len(names)
    expected = {"loss": (n,), "loss_scale": (n,), "next_scale": (n,), "skipped": (n,), "counts": (h, t, NBINS),
                "grad_order": (h, t), "scheduler_steps": (n,)}
    for name in ARRAYS[:-2] + ("counts",) + OPTIONAL_ARRAYS:
        if f"{name}.npy" in members and name not in arrays:
            arrays[name] = _read_array(path, archive, members[f"{name}.npy"], name, budget, expected[name])
    return arrays, meta


def _read_meta(path: Path, archive, info, budget) -> dict:
    if info.file_size > _META_BYTES:
        raise RunFileError(f"{path}: corrupt run: meta declares {_size(info.file_size)} of metadata "
                           f"(at most {_size(_META_BYTES)})")
    raw = _read_npy(path, archive, info, "meta", budget, None, "U", "a JSON string")
    if raw.ndim != 0:
        raise RunFileError(f"{path}: not an ampviz run (its 'meta' entry is not a JSON string)")
    try:
        meta = json.loads(str(raw[()]), parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise RunFileError(f"{path}: corrupt run: meta: JSON nested too deeply") from None
    except ValueError as e:
        raise RunFileError(f"{path}: corrupt run: meta: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("magic") != MAGIC:
        raise RunFileError(f"{path}: not an ampviz run (metadata lacks the ampviz marker)")
    schema = meta.get("schema")
    if isinstance(schema, bool) or not isinstance(schema, int) or schema < 1:
        raise RunFileError(f"{path}: corrupt run: meta: schema: expected a version number >= 1, got "
                           f"{_show(schema)}")
    if schema > SCHEMA_VERSION:
        raise RunFileError(f"{path}: written by a newer ampviz (schema {schema} > {SCHEMA_VERSION}); "
                           "upgrade ampviz to read it")
    for k in ("magic", "schema"):
        meta.pop(k)
    return meta


def _refuse_constant(token: str):
    raise ValueError(f"{token} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:20]} is out of range")
    return value


def _read_array(path: Path, archive, info, name: str, budget, shape) -> np.ndarray:
    kinds, dtype, what = _KINDS[name]
    arr = _read_npy(path, archive, info, name, budget, shape, kinds, what)
    if arr.dtype.kind == "u" and arr.size and np.dtype(dtype).kind == "i" and arr.max() > np.iinfo(dtype).max:
        raise RunFileError(f"{path}: corrupt run: {name}: value {arr.max()} does not fit in {np.dtype(dtype).name}")
    if arr.dtype.kind == "i" and np.dtype(dtype).itemsize < arr.dtype.itemsize and arr.size and (
            arr.min() < np.iinfo(dtype).min or arr.max() > np.iinfo(dtype).max):
        raise RunFileError(f"{path}: corrupt run: {name}: values beyond {np.dtype(dtype).name}")
    return arr.astype(dtype, copy=False)


def _read_npy(path: Path, archive, info, name: str, budget, shape, kinds: str, what: str) -> np.ndarray:
    """One ``.npy`` member: header checked (dtype kind, shape, sizes) before any data is inflated."""
    fmt = np.lib.format
    if info.file_size > budget[0]:
        raise RunFileError(f"{path}: corrupt or oversized run: {name} would inflate to {_size(info.file_size)}, "
                           f"beyond the {_size(max_run_bytes())} ampviz reads per run file "
                           "(set AMPVIZ_MAX_RUN_BYTES to allow more)")
    try:
        with archive.open(info) as f, warnings.catch_warnings():
            warnings.simplefilter("error")                   # numpy's "Python 2 header" fallback: refused
            version = fmt.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"unsupported .npy version {version}")
            read_header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            declared, fortran, dtype = read_header(f)
            if dtype.hasobject or dtype.kind not in kinds or dtype.fields is not None or dtype.subdtype is not None:
                raise RunFileError(f"{path}: corrupt run: {name}: expected {what}, got dtype {dtype}")
            if any(d < 0 for d in declared):
                raise RunFileError(f"{path}: corrupt run: {name}: negative dimension in shape {declared}")
            if shape is not None and declared != shape:
                raise RunFileError(f"{path}: corrupt run: {name} has shape {declared}, expected {shape}")
            nbytes = math.prod(declared) * dtype.itemsize
            held = info.file_size - f.tell()
            if nbytes != held:
                raise RunFileError(f"{path}: corrupt run: {name}: its header declares shape {declared} "
                                   f"({_size(nbytes)}) but the archive holds {_size(max(held, 0))}")
            budget[0] -= nbytes
            data = np.empty(nbytes, dtype=np.uint8)
            pos = 0
            while pos < nbytes:                      # pieces: no second copy of a large array (read1: no joins)
                chunk = f.read1(min(_CHUNK, nbytes - pos))
                if not chunk:
                    raise EOFError(f"{name} ends after {pos} of {nbytes} bytes")
                data[pos:pos + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
                pos += len(chunk)
            if f.read(1):                            # reading to the end also checks the CRC
                raise ValueError(f"{name} holds more data than its header declares")
            arr = data.view(dtype).reshape(declared, order="F" if fortran else "C")
    except RunFileError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError, TypeError, zlib.error, UserWarning,
            NotImplementedError, OverflowError, MemoryError) as e:
        raise RunFileError(f"{path}: not a readable ampviz run file ({name} is corrupt or truncated: "
                           f"{' '.join(str(e).split())[:200]})") from None
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


def _size(nbytes: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _show(value, limit: int = 60) -> str:
    """repr of an untrusted value, shortened to one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
