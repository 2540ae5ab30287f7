"""The run file format: one compressed ``.npz`` per rank, JSON metadata, no pickle.

Entries: ``meta`` (a 0-d unicode array holding JSON: magic "ampviz-run", schema version, rank,
tensor names/kinds/dtypes, recorder settings), the arrays in ``ARRAYS`` and, when recorded, those in
``OPTIONAL_ARRAYS``. Writes are atomic
(``ampviz._files.atomic_write``: a temp file in the same directory, then a rename), so a process that dies mid-write
leaves the previous file intact. Reads use ``allow_pickle=False`` and turn every failure into
a :class:`RunFileError` naming the file and the problem.
"""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path

import numpy as np

from ._files import atomic_write

SCHEMA_VERSION = 1
MAGIC = "ampviz-run"
ARRAYS = ("steps", "loss", "loss_scale", "next_scale", "skipped", "hist_steps", "counts")
OPTIONAL_ARRAYS = ("grad_order", "scheduler_steps")    # written when recorded; files without them still load


class RunFileError(ValueError):
    """A run file is missing, corrupt, truncated, foreign or from a newer ampviz."""


def write(target: Path, arrays: dict, meta: dict) -> None:
    """Write one rank's arrays and JSON metadata to ``target`` atomically (temp file + rename)."""
    meta = dict(meta, magic=MAGIC, schema=SCHEMA_VERSION)
    atomic_write(target, lambda f: np.savez_compressed(
        f, meta=np.array(json.dumps(meta, default=_json_default)), **arrays))


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def read(path: Path) -> tuple[dict, dict]:
    """(arrays, metadata) of one run file, checked; raises RunFileError saying which file and what."""
    if path.exists() and not path.is_dir() and not zipfile.is_zipfile(path):
        raise RunFileError(f"{path}: not a readable ampviz run file (not a complete .npz archive: "
                           f"truncated, corrupt, or another kind of file)")
    try:
        with np.load(path, allow_pickle=False) as z:
            if "meta" not in z.files:
                raise RunFileError(f"{path}: not an ampviz run (an .npz without ampviz metadata)")
            raw = z["meta"]
            if not isinstance(raw, np.ndarray) or raw.dtype.kind != "U" or raw.ndim != 0:
                raise RunFileError(f"{path}: not an ampviz run (its 'meta' entry is not a JSON string)")
            meta = json.loads(str(raw[()]))
            if not isinstance(meta, dict) or meta.get("magic") != MAGIC:
                raise RunFileError(f"{path}: not an ampviz run (metadata lacks the ampviz marker)")
            if int(meta.get("schema", math.inf)) > SCHEMA_VERSION:
                raise RunFileError(f"{path}: written by a newer ampviz (schema {meta.get('schema')} > "
                                   f"{SCHEMA_VERSION}); upgrade ampviz to read it")
            missing = [a for a in ARRAYS if a not in z.files]
            if missing:
                raise RunFileError(f"{path}: corrupt ampviz run: missing arrays {missing}")
            a = {name: z[name] for name in ARRAYS + OPTIONAL_ARRAYS if name in z.files}
    except RunFileError:
        raise
    except FileNotFoundError:
        raise RunFileError(f"{path}: no such file") from None
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError, TypeError) as e:
        raise RunFileError(f"{path}: not a readable ampviz run file (corrupt or truncated: {e})") from None
    for k in ("magic", "schema"):
        meta.pop(k)
    return a, meta
