"""The run file format: one compressed ``.npz`` per rank, JSON metadata, no pickle.

Entries: ``meta`` (a 0-d unicode array holding JSON: magic "ampviz-run", schema version, rank,
tensor names/kinds/dtypes, recorder settings), the arrays in ``ARRAYS`` and, when recorded, those in
``OPTIONAL_ARRAYS``, ``UPDATE_ARRAYS`` and ``BLOCK_ARRAYS`` (with ``meta["blocks"]``; an older ampviz leaves
members it does not know out, so it still reads the rest). An array may be stored in parts, ``<name>.npy`` then
``<name>.1.npy``, ``<name>.2.npy`` ... joined along the first axis: what a recorder's periodic saves append
(``ampviz._runappend``; such a file says schema 2, so an older ampviz refuses it instead of reading
its first part only). A file in one piece says schema 1. Whole writes are atomic
(``ampviz._files.atomic_write``: a temp file in the same directory, then a rename), so a process that
dies mid-write leaves the previous file intact; a process that dies mid-append leaves the file as it
stood before that append, plus a tail the reader leaves out (``_zipread``).

Reads treat the file as untrusted (run files travel with bug reports): see ``_zipread`` (the
archive) and ``ampviz._runload`` (the arrays, budgeted by :class:`Budget`). Every failure is a
:class:`RunFileError` naming the file and the field::

    write(Path("run.npz"), arrays, meta)        # atomically, in one piece
    meta = parse_meta(path, text)               # checked JSON: magic, schema, text without lone surrogates
"""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np

from .._files import atomic_write
from .._text import lone_surrogate

SCHEMA_VERSION = 2               # the newest this ampviz reads and writes: 1 in one piece, 2 in parts
SCHEMA_ONE_PIECE = 1
MAGIC = "ampviz-run"
ARRAYS = ("steps", "loss", "loss_scale", "next_scale", "skipped", "hist_steps", "counts")
OPTIONAL_ARRAYS = ("grad_order", "scheduler_steps")    # written when recorded; files without them still load
PER_STEP = ("steps", "loss", "loss_scale", "next_scale", "skipped", "scheduler_steps")   # one row per step
PER_HIST = ("hist_steps", "counts", "grad_order")                                      # one row per histogram
# what each entry may hold (numpy dtype kinds), the dtype it is loaded as, and the words for an error
DTYPES = {"steps": ("iu", np.int64, "integer step numbers"), "hist_steps": ("iu", np.int64, "integer step numbers"),
         "loss": ("fiu", np.float64, "real numbers"), "loss_scale": ("fiu", np.float64, "real numbers"),
         "next_scale": ("fiu", np.float64, "real numbers"), "skipped": ("b", np.bool_, "booleans"),
         "counts": ("iu", np.int64, "integer counts"), "grad_order": ("iu", np.int32, "integer positions"),
         "scheduler_steps": ("iu", np.int64, "integer step counts"),
         "update_steps": ("iu", np.int64, "integer step numbers"), "update_counts": ("iu", np.int64, "integer counts"),
         "update_rel_counts": ("iu", np.int64, "integer counts"), "update_stalled": ("iu", np.int64, "integer counts"),
         "block_steps": ("iu", np.int64, "integer step numbers"), "block_counts": ("iu", np.int64, "integer counts"),
         "block_sumsq": ("f", np.float64, "real numbers"),
         "state_counts": ("iu", np.int64, "integer counts"), "state_stalled": ("iu", np.int64, "integer counts")}
# the weights' updates (Recorder(..., updates=N)): their own step axis, all four or none; absent in older files
UPDATE_ARRAYS = ("update_steps", "update_counts", "update_rel_counts", "update_stalled")
# block statistics (Recorder(..., blocks=...)): their own step axis, all three with meta["blocks"] or none
BLOCK_ARRAYS = ("block_steps", "block_counts", "block_sumsq")
# with them, the optimizer state's changes (axis S: meta "state_names"), both or none
STATE_ARRAYS = ("state_counts", "state_stalled")

META_BYTES = 64 << 20            # the JSON metadata: names of a few hundred thousand tensors
_DEFAULT_RUN_BYTES = 2 << 30     # 8x a Recorder's default max_bytes of histograms
_PART = re.compile(r"(?P<name>[a-z_]+)(?:\.(?P<k>[1-9][0-9]{0,5}))?\.npy\Z")


class RunFileError(ValueError):
    """A run file is missing, corrupt, truncated, foreign, hostile or from a newer ampviz."""


def max_run_bytes() -> int:
    """Bytes of arrays one load may hold (``AMPVIZ_MAX_RUN_BYTES``, default 2 GiB): every rank file of a
    directory and, for ``ampviz report``, every run it is given, together."""
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


class Budget:
    """What is left of ``max_run_bytes()`` for one load; ``take`` refuses, in one line, what would not fit."""

    def __init__(self, total: int | None = None):
        self.total = max_run_bytes() if total is None else total
        self.left = self.total

    def check(self, nbytes: int, where: str, what: str) -> None:
        if nbytes > self.left:
            used = f" ({size_text(self.total - self.left)} already read)" if self.left < self.total else ""
            raise RunFileError(f"{where}: corrupt or oversized run: {what} would inflate to {size_text(nbytes)}, "
                               f"beyond the {size_text(self.total)} ampviz reads at once{used} (set "
                               "AMPVIZ_MAX_RUN_BYTES to allow more)")

    def take(self, nbytes: int, where: str, what: str) -> None:
        self.check(nbytes, where, what)
        self.left -= nbytes

    def give(self, nbytes: int) -> None:
        self.left = min(self.total, self.left + nbytes)


# ------------------------------------------------------------------------------------------ writing
def write(target, arrays: dict, meta: dict) -> None:
    """Write one rank's arrays and JSON metadata to ``target`` atomically (temp file + rename), in one piece."""
    text = meta_text(meta, SCHEMA_ONE_PIECE)
    atomic_write(target, lambda f: np.savez_compressed(f, meta=np.array(text), **arrays))


def meta_text(meta: dict, schema: int) -> str:
    """The metadata as the strict JSON a run file stores, marked with the magic and ``schema``."""
    return json.dumps(strict_json(dict(meta, magic=MAGIC, schema=schema)), allow_nan=False)


def part_name(name: str, k: int) -> str:
    """The member holding part ``k`` of array ``name``: ``counts.npy``, ``counts.1.npy``, ..."""
    return f"{name}.npy" if k == 0 else f"{name}.{k}.npy"


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


# ------------------------------------------------------------------------------------------ reading
def members(path, archive) -> tuple:
    """(the ``meta.npy`` member, {array name: [its parts' members, in order]}) of an archive; parts must
    run 0, 1, 2 ... without a gap. Members that are neither are left alone."""
    meta = None
    parts: dict[str, dict] = {}                     # array name: {part number: member}
    for info in archive.infolist():
        if info.filename == "meta.npy":
            meta = info
            continue
        m = _PART.match(info.filename)
        if m and m["name"] in DTYPES:
            parts.setdefault(m["name"], {})[int(m["k"] or 0)] = info
    if meta is None:
        raise RunFileError(f"{path}: not an ampviz run (an .npz without ampviz metadata)")
    out = {}
    for name, by_k in parts.items():
        missing = next((k for k in range(len(by_k)) if k not in by_k), None)
        if missing is not None:
            raise RunFileError(f"{path}: corrupt run: {name}: part {missing} is missing (the file holds parts "
                               f"{sorted(by_k)[:5]})")
        out[name] = [by_k[k] for k in range(len(by_k))]
    absent = [a for a in ARRAYS if a not in out]
    if absent:
        raise RunFileError(f"{path}: corrupt ampviz run: missing arrays {absent}")
    return meta, out


def parse_meta(path, text: str) -> dict:
    """The metadata JSON of a run file, checked: JSON without NaN or huge numbers, the ampviz magic, a schema
    this ampviz reads, and text UTF-8 can hold (no lone surrogates). ``magic`` and ``schema`` are removed."""
    try:
        meta = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise RunFileError(f"{path}: corrupt run: meta: JSON nested too deeply") from None
    except ValueError as e:
        raise RunFileError(f"{path}: corrupt run: meta: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("magic") != MAGIC:
        raise RunFileError(f"{path}: not an ampviz run (metadata lacks the ampviz marker)")
    schema = meta.get("schema")
    if isinstance(schema, bool) or not isinstance(schema, int) or schema < 1:
        raise RunFileError(f"{path}: corrupt run: meta: schema: expected a version number >= 1, got {show(schema)}")
    if schema > SCHEMA_VERSION:
        raise RunFileError(f"{path}: written by a newer ampviz (schema {schema} > {SCHEMA_VERSION}); "
                           "upgrade ampviz to read it")
    bad = _surrogate_field(meta)
    if bad:
        raise RunFileError(f"{path}: corrupt run: {bad[0]}: holds {bad[1]}, a lone surrogate (not text: no "
                           "UTF-8 file or terminal can show it)")
    for k in ("magic", "schema"):
        meta.pop(k)
    return meta


def _surrogate_field(value, where: str = "meta"):
    """(field, escaped character) of the first string (key or value) holding a lone surrogate, or None."""
    stack = [(value, where)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            found = lone_surrogate(value)
            if found:
                return where, found
        elif isinstance(value, dict):
            for k, v in value.items():
                found = lone_surrogate(k)
                if found:
                    return f"{where}: key {show(k)}", found
                stack.append((v, k if where == "meta" else f"{where}.{k}"))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(value))))
    return None


def _refuse_constant(token: str):
    raise ValueError(f"{token} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:20]} is out of range")
    return value


def size_text(nbytes: int) -> str:
    """A byte count in words: ``4.9 MB``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def show(value, limit: int = 60) -> str:
    """repr of an untrusted value, shortened to one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
