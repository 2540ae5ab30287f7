"""Run files from strangers: every crafted file gets one line naming the file and the field, through
``Run.load`` and through the real command (``python -m ampviz info`` in a subprocess, all files at once),
without reading a non-regular file, inflating past what the metadata declares, or printing a traceback."""

import io
import json
import os
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from ampviz import histogram as H
from ampviz._warnings import AmpvizWarning
from ampviz.blocks.counts import N_COUNTS
from ampviz.run import MAGIC, Run, RunFileError

STEPS, TENSORS = 4, 2
SCALER = {"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5}


def good_run(rank=0, steps=None, hist_steps=None, world=1) -> Run:
    steps = np.arange(STEPS) if steps is None else np.asarray(steps)
    hist_steps = steps if hist_steps is None else np.asarray(hist_steps)
    counts = np.zeros((1, hist_steps.size, TENSORS, H.NBINS), dtype=np.int64)
    counts[..., H.column(-12)] = 10 + rank
    counts[0, :, 0, H.column(-3)] = hist_steps + 1           # a per-step signature to check alignment
    n = steps.size
    return Run(steps, np.full((1, n), 0.5), np.full((1, n), 2.0 ** 16), np.full((1, n), 2.0 ** 16),
               np.zeros((1, n), bool), hist_steps, counts, ["fc.weight", "fc"], ["weight", "activation"],
               ["torch.float32", "torch.float16"],
               {"world_size": world, "ranks": [rank], "every": 1, "device": "cpu",
                "domains": {"weight": "unscaled", "activation": "scaled"},
                "scaler": dict(SCALER)})


def npy(arr) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asanyarray(arr), allow_pickle=False)
    return buf.getvalue()


def npy_header(shape, descr="<i8") -> bytes:
    """A .npy header alone: it declares ``shape`` but no data follows."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def members_of(run: Run) -> dict:
    """{member name: bytes} of ``run`` saved as one rank file, with its metadata as a dict under "meta"."""
    arrays, meta = run._rank_payload(0)
    out = {f"{k}.npy": npy(v) for k, v in arrays.items()}
    out["meta"] = dict(meta, magic=MAGIC, schema=1)
    return out


def write_zip(path: Path, members: dict) -> Path:
    """Write zip entries directly (no numpy.savez): "meta" may be a dict, JSON text, or bytes of a .npy."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            if name == "meta":
                text = data if isinstance(data, (str, bytes)) else json.dumps(data)
                name, data = "meta.npy", npy(np.array(text)) if isinstance(text, str) else text
            z.writestr(name, data)
    return path


def craft(path: Path, meta=None, raw_meta=None, drop=(), **arrays) -> Path:
    """A good rank file with metadata fields and arrays replaced (arrays given as arrays or raw bytes)."""
    members = members_of(good_run())
    if meta:
        members["meta"] = dict(members["meta"], **meta)
    if raw_meta is not None:
        members["meta"] = raw_meta
    for name, value in arrays.items():
        members[f"{name}.npy"] = value if isinstance(value, bytes) else npy(value)
    for name in drop:
        members.pop(name, None)
    return write_zip(path, members)


def declare_size(path: Path, member: str, size: int) -> Path:
    """Patch the zip's local and central headers so that ``member`` declares ``size`` uncompressed bytes."""
    data = bytearray(path.read_bytes())
    name = member.encode()
    for signature, size_at, name_at in ((b"PK\x03\x04", 22, 30), (b"PK\x01\x02", 24, 46)):
        start = 0
        while (i := data.find(signature, start)) >= 0:
            if data[i + name_at:i + name_at + len(name)] == name:
                struct.pack_into("<I", data, i + size_at, size)
            start = i + 4
    path.write_bytes(bytes(data))
    return path


def patch_member(path: Path, member: str, central_at: int, fmt: str, value) -> Path:
    """Overwrite a field of ``member``'s central directory entry (at offset ``central_at`` in the entry) and,
    for the flag bits (offset 8 there, 6 in the local header), its local header too."""
    data = bytearray(path.read_bytes())
    name = member.encode()
    for signature, name_at, at in ((b"PK\x01\x02", 46, central_at), (b"PK\x03\x04", 30, central_at - 2)):
        if signature == b"PK\x03\x04" and central_at != 8:
            continue
        start = 0
        while (i := data.find(signature, start)) >= 0:
            if data[i + name_at:i + name_at + len(name)] == name:
                struct.pack_into(fmt, data, i + at, value)
            start = i + 4
    path.write_bytes(bytes(data))
    return path


def lzma_member(path: Path) -> Path:
    """A good run whose counts member is LZMA-compressed, with bytes in the middle of its stream flipped."""
    members = members_of(good_run())
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            if name == "meta":
                z.writestr("meta.npy", npy(np.array(json.dumps(data))))
            else:
                z.writestr(name, data, compress_type=zipfile.ZIP_LZMA if name == "counts.npy" else None)
        start = z.getinfo("counts.npy").header_offset + 30 + len("counts.npy") + 40
    data = bytearray(path.read_bytes())
    data[start:start + 16] = bytes(255 - b for b in data[start:start + 16])
    path.write_bytes(bytes(data))
    return path


def beyond_unicode(path: Path) -> Path:
    """metadata whose unicode array holds the code point 0x110000, beyond the last one (U+10FFFF)."""
    header = npy_header((), "<U1")
    return craft(path, raw_meta=header + struct.pack("<I", 0x110000))


def zip64_locator(path: Path, offset: int) -> Path:
    """A good run whose end record says "see the zip64 record", with a zip64 locator pointing at ``offset``."""
    data = bytearray(craft(path).read_bytes())
    end = data.rfind(b"PK\x05\x06")
    struct.pack_into("<HH", data, end + 8, 0xFFFF, 0xFFFF)
    locator = b"PK\x06\x07" + struct.pack("<IQI", 0, offset, 1)
    path.write_bytes(bytes(data[:end]) + locator + bytes(data[end:]))
    return path


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def counts_like(dtype, value=1):
    return np.full((STEPS, TENSORS, H.NBINS), value, dtype=dtype)


BLOCKS_META = {"every": 1, "modules": ["fc"] * 3, "kinds": ["input", "weight", "grad_output"],
               "layouts": [["mx32", 1, 32]]}


def with_blocks(path: Path, meta=None, **arrays) -> Path:
    """A good rank file with block statistics (Recorder(blocks=...)): one Linear, one layout, every step; fields
    of ``meta["blocks"]`` and the arrays replaced."""
    good = {"block_steps": np.arange(STEPS), "block_counts": np.ones((STEPS, 3, 1, N_COUNTS), np.int64),
            "block_sumsq": np.ones((STEPS, 3, 1, N_COUNTS))}
    return craft(path, meta={"blocks": dict(BLOCKS_META, **(meta or {}))}, **dict(good, **arrays))


def with_state(path: Path, names=("exp_avg", "exp_avg_sq"), stalled=0, state_shape=None) -> Path:
    """A good rank file with update arrays at steps 0 and 2 (one weight row) and optimizer state arrays."""
    U, S = 2, len(names) if state_shape is None else state_shape
    state = np.zeros((U, 1, S, H.NBINS), np.int64)
    state[..., H.column(-12)] = 3                              # 3 changed elements per state and step
    arrays = {"update_steps": np.array([0, 2]), "update_counts": np.full((U, 1, H.NBINS), 1, np.int64),
              "update_rel_counts": np.full((U, 1, H.NBINS), 1, np.int64), "update_stalled": np.zeros((U, 1), np.int64),
              "state_counts": state, "state_stalled": np.full((U, 1, S), stalled, np.int64)}
    return craft(path, meta={"state_names": list(names)} if names is not None else None, **arrays)


# name -> (builder(directory) -> path, fragment the one-line error must hold)
CASES = {
    "script_in_kind": (lambda d: craft(d / "kind.npz", meta={"tensor_kinds": [
        'weight"><img src=x onerror=alert(document.title)>', "activation"]}), "tensor_kinds[0]: 'weight\"><img"),
    "rank_escapes": (lambda d: craft(d / "escape.npz", meta={"rank": "/../../../escaped0"}),
                     "rank: expected a non-negative integer, got '/../../../escaped0'"),
    "rank_bool": (lambda d: craft(d / "rankbool.npz", meta={"rank": True}), "rank: expected a non-negative integer"),
    "zero_link": (lambda d: _link(d / "zero.npz", "/dev/zero"), "is a character device"),
    "urandom_link": (lambda d: _link(d / "urandom.npz", "/dev/urandom"), "is a character device"),
    "fifo": (lambda d: _fifo(d / "pipe.npz"), "is a FIFO"),
    "directory": (lambda d: _mkdir(d / "dir.npz"), "directory holds no .npz"),
    "declared_3GB": (lambda d: declare_size(craft(d / "bomb.npz"), "counts.npy", 3_000_000_000),
                     "counts would inflate to 3.0 GB"),
    "header_2TB": (lambda d: craft(d / "huge.npz", steps=npy_header((2 ** 38,))),
                   "steps: its header declares shape (274877906944,) (2.2 TB)"),
    "counts_shape_huge": (lambda d: craft(d / "hugecounts.npz", counts=npy_header((2 ** 32, 2, H.NBINS))),
                          "counts has shape (4294967296, 2, 257), expected (4, 2, 257)"),
    "meta_declared_huge": (lambda d: declare_size(craft(d / "bigmeta.npz"), "meta.npy", 100_000_000),
                           "meta declares 100.0 MB of metadata"),
    "no_schema": (lambda d: craft(d / "noschema.npz", raw_meta=json.dumps({"magic": MAGIC})), "schema"),
    "schema_1e999": (lambda d: craft(d / "overflow.npz", raw_meta=f'{{"magic": "{MAGIC}", "schema": 1e999}}'),
                     "meta: not valid JSON (the number 1e999 is out of range"),
    "nan_token": (lambda d: craft(d / "nan.npz", raw_meta=f'{{"magic": "{MAGIC}", "schema": 1, "every": NaN}}'),
                  "NaN is not a JSON number"),
    "nested_deep": (lambda d: craft(d / "deep.npz", raw_meta=f'{{"magic": "{MAGIC}", "schema": 1, '
                                                             f'"x": {nested(100_000)}}}'), "JSON nested too deeply"),
    "meta_list": (lambda d: craft(d / "metalist.npz", raw_meta="[1, 2]"), "not an ampviz run"),
    "names_str": (lambda d: craft(d / "namestr.npz", meta={"tensor_names": "ab"}), "tensor_names: expected a list"),
    "names_int": (lambda d: craft(d / "nameint.npz", meta={"tensor_names": [1, 2]}),
                  "tensor_names[0]: expected a string, got 1"),
    "kinds_int": (lambda d: craft(d / "kindint.npz", meta={"tensor_kinds": [1, 2]}), "tensor_kinds[0]: 1 is not"),
    "kinds_str": (lambda d: craft(d / "kindstr.npz", meta={"tensor_kinds": "weight"}),
                  "tensor_kinds: expected a list"),
    "domains_list": (lambda d: craft(d / "domlist.npz", meta={"domains": ["weight"]}), "domains: expected a dict"),
    "domains_value": (lambda d: craft(d / "domval.npz", meta={"domains": {"weight": "sideways"}}),
                      "domains: 'weight': 'sideways' is not one of unscaled, scaled"),
    "scaler_str": (lambda d: craft(d / "scalerstr.npz", meta={"scaler": "yes"}), "scaler: expected a dict"),
    "scaler_field": (lambda d: craft(d / "scalerfield.npz", meta={"scaler": {"init_scale": "big"}}),
                     "scaler.init_scale: expected a positive finite number, got 'big'"),
    "scaler_interval": (lambda d: craft(d / "interval.npz", meta={"scaler": {"growth_interval": 0.5}}),
                        "scaler.growth_interval: expected an integer >= 1"),
    "every_str": (lambda d: craft(d / "every.npz", meta={"every": "often"}), "every: expected an integer >= 1"),
    "world_negative": (lambda d: craft(d / "world.npz", meta={"world_size": -1}), "world_size: expected an integer"),
    "device_int": (lambda d: craft(d / "device.npz", meta={"device": 5}), "device: expected a string, got 5"),
    "demo_accuracy": (lambda d: craft(d / "demo.npz", meta={"demo": {"test_accuracy": "high"}}),
                      "demo: expected a dict with a numeric test_accuracy"),
    "steps_unsorted": (lambda d: craft(d / "unsorted.npz", steps=np.array([0, 2, 1, 3])),
                       "steps: not strictly increasing (1 after 2 at position 2)"),
    "steps_negative": (lambda d: craft(d / "negstep.npz", steps=np.array([-1, 0, 1, 2]), hist_steps=np.array(
        [-1, 0, 1, 2])), "steps: negative step -1"),
    "hist_not_in_steps": (lambda d: craft(d / "histsteps.npz", hist_steps=np.array([0, 1, 2, 9])),
                          "hist_steps: step 9 has a histogram but is not in steps"),
    "steps_2d": (lambda d: craft(d / "steps2d.npz", steps=np.zeros((2, 2), np.int64)),
                 "steps has shape (2, 2), expected (n,)"),
    "steps_float": (lambda d: craft(d / "stepsfloat.npz", steps=np.arange(STEPS, dtype=float)),
                    "steps: expected integer step numbers, got dtype float64"),
    "loss_short": (lambda d: craft(d / "lossshort.npz", loss=np.zeros(2)), "loss has shape (2,), expected (4,)"),
    "counts_float": (lambda d: craft(d / "cfloat.npz", counts=counts_like(np.float64)),
                     "counts: expected integer counts, got dtype float64"),
    "counts_bool": (lambda d: craft(d / "cbool.npz", counts=counts_like(bool)), "got dtype bool"),
    "counts_str": (lambda d: craft(d / "cstr.npz", counts=counts_like("<U3", "7")), "got dtype <U3"),
    "counts_complex": (lambda d: craft(d / "ccomplex.npz", counts=counts_like(np.complex128)),
                       "got dtype complex128"),
    "counts_object": (lambda d: craft(d / "cobject.npz", counts=npy_header((STEPS, TENSORS, H.NBINS), "|O")),
                      "counts: expected integer counts, got dtype object"),
    "counts_negative": (lambda d: craft(d / "cneg.npz", counts=counts_like(np.int64, -5)),
                        "counts: negative count -5"),
    "counts_uint64": (lambda d: craft(d / "cuint.npz", counts=counts_like(np.uint64, 2 ** 64 - 1)),
                      "counts: value 18446744073709551615 does not fit in int64"),
    "counts_sum_overflow": (lambda d: craft(d / "csum.npz", counts=counts_like(np.int64, 2 ** 60)),
                            "counts: the counts add up beyond 2**62"),
    "skipped_float": (lambda d: craft(d / "skipfloat.npz", skipped=np.zeros(STEPS)),
                      "skipped: expected booleans, got dtype float64"),
    "scale_nan": (lambda d: craft(d / "scalenan.npz", loss_scale=np.array([1.0, np.nan, 1.0, 1.0])),
                  "loss_scale: expected scales >= 0, found nan"),
    "grad_order_range": (lambda d: craft(d / "order.npz", grad_order=np.full((STEPS, TENSORS), 7, np.int32)),
                         "grad_order: positions must lie in -1..1"),
    "npy_version_3": (lambda d: craft(d / "v3.npz", counts=b"\x93NUMPY\x03\x00" + b"\x00" * 60),
                      "counts is corrupt or truncated"),
    "npy_truncated": (lambda d: craft(d / "cut.npz", counts=npy(counts_like(np.int64))[:-100]),
                      "counts: its header declares shape (4, 2, 257)"),
    "many_entries": (lambda d: write_zip(d / "entries.npz", {**members_of(good_run()),
                                                             **{f"x{i}": b"" for i in range(2000)}}),
                     "its zip directory lists 2008 entries"),
    "missing_counts": (lambda d: craft(d / "nocounts.npz", drop=("counts.npy",)), "missing arrays ['counts']"),
    "empty_zip": (lambda d: write_zip(d / "empty.npz", {}), "an .npz without ampviz metadata"),
    "encrypted": (lambda d: patch_member(craft(d / "encrypted.npz"), "counts.npy", 8, "<H", 1),
                  "counts: its zip member is encrypted"),
    "zip_version_12": (lambda d: patch_member(craft(d / "version.npz"), "counts.npy", 6, "<H", 122),
                       "zip file version 12.2"),
    "lzma_corrupt": (lambda d: lzma_member(d / "lzma.npz"), "counts is corrupt or truncated: LZMAError"),
    "beyond_unicode": (lambda d: beyond_unicode(d / "unicode.npz"), "meta: holds a code point beyond U+10FFFF"),
    "zip64_locator_2_63": (lambda d: zip64_locator(d / "zip64.npz", 2 ** 63), "not a readable ampviz run file"),
    "scaler_backoff_huge": (lambda d: craft(d / "backoff.npz", meta={"scaler": dict(SCALER, backoff_factor=1e308)}),
                            "scaler.backoff_factor: expected a number in (0, 1), got 1e+308"),
    "scaler_growth_tiny": (lambda d: craft(d / "growth.npz", meta={"scaler": dict(SCALER, growth_factor=5e-324)}),
                           "scaler.growth_factor: expected a number > 1, got 5e-324"),
    "scaler_steps_negative": (lambda d: craft(d / "steps.npz", meta={"scaler": dict(SCALER, steps_called=-1)}),
                              "scaler.steps_called: expected an integer >= 0, got -1"),
    "name_surrogate": (lambda d: craft(d / "surrogate.npz", meta={"tensor_names": ["fc.\ud800", "fc"]}),
                       "tensor_names[0]: holds \\ud800, a lone surrogate"),
    "block_counts_negative": (lambda d: with_blocks(d / "blockneg.npz", block_counts=np.full(
        (STEPS, 3, 1, N_COUNTS), -1, np.int64)), "block_counts: negative count -1"),
    "block_counts_header_huge": (lambda d: with_blocks(d / "blockhuge.npz", block_counts=npy_header(
        (2 ** 32, 3, 1, N_COUNTS))), "block_counts has shape (4294967296, 3, 1, 166), expected (4, 3, 1, 166)"),
    "block_sumsq_nan": (lambda d: with_blocks(d / "blocknan.npz", block_sumsq=np.full((STEPS, 3, 1, N_COUNTS),
                                                                                      np.nan)),
                        "block_sumsq: expected finite sums of squares >= 0"),
    "block_meta_missing": (lambda d: craft(d / "blocknometa.npz", block_steps=np.arange(STEPS)),
                           "meta.blocks: missing while other block statistics are present"),
    "block_layout_rows": (lambda d: with_blocks(d / "blocklayout.npz", meta={"layouts": [["mx32", -1, 32]]}),
                          "blocks.layouts: ['mx32', -1, 32]"),
    "state_names_missing": (lambda d: with_state(d / "statenames.npz", names=None, state_shape=2),
                            "state arrays present but meta state_names is not a non-empty list of names"),
    "state_axis_short": (lambda d: with_state(d / "stateaxis.npz", state_shape=1),
                         "state_counts has shape (2, 1, 1, 257), expected (2, 1, 2, 257)"),
    "state_stalled_excess": (lambda d: with_state(d / "stateexcess.npz", stalled=4),
                             "state_stalled: more stalled elements than changed ones"),
    "ranks_mixed": (lambda d: _ranks(d / "mixed", [0, "1"]), "rank: expected a non-negative integer, got '1'"),
    "ranks_offset": (lambda d: _ranks(d / "offset", [0, 1], offsets=[0, 100]),
                     "merge: the ranks share no recorded steps (rank 0: 4 steps 0..3; rank 1: 4 steps 100..103)"),
}


def _link(path: Path, target: str) -> Path:
    path.symlink_to(target)
    return path


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _ranks(directory: Path, ranks, offsets=(0, 0)) -> Path:
    directory.mkdir()
    for i, (rank, offset) in enumerate(zip(ranks, offsets)):
        members = members_of(good_run(rank=i, steps=np.arange(STEPS) + offset, world=len(ranks)))
        members["meta"]["rank"] = rank
        write_zip(directory / f"rank{i}.npz", members)
    return directory


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict:
    """{case: (path, fragment)}, every file built once for the module."""
    d = tmp_path_factory.mktemp("hostile")
    return {name: (build(d), fragment) for name, (build, fragment) in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_run_load_refuses_with_one_line_naming_the_file_and_the_field(hostile, case):
    path, fragment = hostile[case]
    with pytest.raises(RunFileError) as info:
        Run.load(path)
    message = str(info.value)
    assert message.startswith(str(path)) and "\n" not in message, message
    assert fragment in message, message


def test_the_command_gives_one_line_per_hostile_file_and_no_traceback(hostile, tmp_path):
    """One ``python -m ampviz info`` over every crafted file and a good one: the good one is summarised,
    each bad one gets its line, nothing hangs on the FIFO and nothing reads /dev/zero."""
    good = good_run().save(tmp_path / "good.npz")[0]
    paths = [str(p) for p, _ in hostile.values()] + [str(good), "/dev/zero"]
    done = subprocess.run([sys.executable, "-m", "ampviz", "info", *paths], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == len(hostile) + 1, done.stderr
    for (path, fragment), line in zip(hostile.values(), lines):
        assert line.startswith(f"ampviz: error: {path}") and fragment in line, line    # a directory: its file
    assert lines[-1] == "ampviz: error: /dev/zero: is a character device, not a run file; ampviz reads runs from " \
                        "regular files only"
    assert done.stdout.splitlines()[0] == str(good) and "loss scale" in done.stdout


NEW_CLASSES = ["encrypted", "zip_version_12", "lzma_corrupt", "beyond_unicode", "zip64_locator_2_63",
               "scaler_backoff_huge", "scaler_growth_tiny", "name_surrogate"]


def test_info_summarises_the_good_runs_around_each_bad_one(hostile, tmp_path):
    """``ampviz info good bad good`` for each class of issue 23 (item 7 and 8): both good runs are summarised."""
    good = str(good_run().save(tmp_path / "good.npz")[0])
    args = [a for case in NEW_CLASSES for a in (good, str(hostile[case][0]))] + [good]
    done = subprocess.run([sys.executable, "-m", "ampviz", "info", *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and "internal error" not in done.stderr and "Traceback" not in done.stderr
    errors = done.stderr.splitlines()
    assert len(errors) == len(NEW_CLASSES), done.stderr
    for case, line in zip(NEW_CLASSES, errors):
        path, fragment = hostile[case]
        assert line.startswith(f"ampviz: error: {path}: ") and fragment in line, line
    assert done.stdout.count(f"{good}\n") == len(NEW_CLASSES) + 1


@pytest.mark.parametrize("case", ["script_in_kind", "fifo", "declared_3GB", "nested_deep", "ranks_offset"])
def test_report_refuses_before_writing_anything(hostile, case, tmp_path, capsys):
    from ampviz.cli import main
    path, fragment = hostile[case]
    assert main(["report", str(path), "-o", str(tmp_path / "r.html")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and not (tmp_path / "r.html").exists()


def test_a_real_zip_bomb_is_refused_before_it_is_inflated(tmp_path, monkeypatch):
    """A 5 MB counts entry that compresses 1000:1, against a 1 MB budget: refused from its declared size."""
    big = good_run(steps=np.arange(1200))                          # 1200 x 2 x 257 int64 = 4.9 MB of counts
    big.counts[:] = 0
    path = write_zip(tmp_path / "bomb.npz", members_of(big))
    info = zipfile.ZipFile(path).getinfo("counts.npy")
    assert info.file_size > 1000 * info.compress_size / 2 and path.stat().st_size < 100_000
    monkeypatch.setenv("AMPVIZ_MAX_RUN_BYTES", str(1 << 20))
    with pytest.raises(RunFileError, match=r"bomb.npz: corrupt or oversized run: counts would inflate to 4.9 MB, "
                                           r"beyond the 1.0 MB ampviz reads at once"):
        Run.load(path)
    monkeypatch.delenv("AMPVIZ_MAX_RUN_BYTES")
    assert Run.load(path).counts.shape == (1, 1200, 2, H.NBINS)


def test_saving_a_loaded_run_never_writes_outside_the_target(tmp_path):
    """Ranks are integers on load and on construction: no rank can name a path."""
    with pytest.raises(RunFileError, match="rank: expected a non-negative integer, got '/../../../escaped0'"):
        Run.load(craft(tmp_path / "escape.npz", meta={"rank": "/../../../escaped0"}))
    run = Run.merge([good_run(rank=0, world=2), good_run(rank=1, world=2)])
    with pytest.raises(RunFileError, match="rank: expected a non-negative integer"):
        Run(**{f: getattr(run, f) for f in ("steps", "loss", "loss_scale", "next_scale", "skipped", "hist_steps",
                                            "counts", "tensor_names", "tensor_kinds", "tensor_dtypes")},
            meta=dict(run.meta, ranks=[0, "../../escaped1"]))
    out = tmp_path / "deep" / "out"
    written = run.save(out)
    assert [p.parent for p in written] == [out, out] and sorted(p.name for p in written) == ["rank0.npz", "rank1.npz"]
    assert sorted(p.name for p in tmp_path.rglob("*.npz")) == ["escape.npz", "rank0.npz", "rank1.npz"]


def test_legitimate_variants_load_fortran_order_big_endian_and_narrow_dtypes(tmp_path):
    run = good_run()
    counts = run.counts[0]
    path = craft(tmp_path / "variants.npz", counts=np.asfortranarray(counts.astype(">u4")),
                 steps=run.steps.astype(np.int16), loss=run.loss[0].astype(np.float16))
    back = Run.load(path)
    np.testing.assert_array_equal(back.counts, run.counts)
    assert back.counts.dtype == np.int64 and back.steps.dtype == np.int64 and back.loss.dtype == np.float64


def test_ranks_recorded_with_another_every_are_aligned_on_their_shared_steps(tmp_path):
    steps = np.arange(8)
    good_run(rank=0, steps=steps, world=2).save(tmp_path / "rank0.npz")
    good_run(rank=1, steps=steps, hist_steps=steps[::2], world=2).save(tmp_path / "rank1.npz")
    with pytest.warns(AmpvizWarning, match=r"ranks recorded different histogram steps \(rank 0: 8 histogram steps "
                                           r"0\.\.7; rank 1: 4 histogram steps 0\.\.6 every 2\); keeping the 4"):
        run = Run.load(tmp_path)
    assert run.hist_steps.tolist() == [0, 2, 4, 6] and run.n_steps == 8
    # each rank's row of a shared step is that rank's own histogram of that step
    np.testing.assert_array_equal(run.counts[:, :, 0, H.column(-3)], [[1, 3, 5, 7], [1, 3, 5, 7]])
    np.testing.assert_array_equal(run.counts[:, 0, 1, H.column(-12)], [10, 11])


def test_a_rank_that_started_later_keeps_only_the_shared_steps(tmp_path):
    good_run(rank=0, steps=np.arange(6), world=2).save(tmp_path / "rank0.npz")
    good_run(rank=1, steps=np.arange(2, 8), world=2).save(tmp_path / "rank1.npz")
    with pytest.warns(AmpvizWarning) as record:
        run = Run.load(tmp_path)
    assert any("keeping the 4 steps every rank recorded" in str(w.message) for w in record)
    assert run.steps.tolist() == [2, 3, 4, 5] and run.hist_steps.tolist() == [2, 3, 4, 5]
    np.testing.assert_array_equal(run.counts[1, :, 0, H.column(-3)], [3, 4, 5, 6])


def test_info_json_is_strict_json_even_with_non_finite_numbers(tmp_path, capsys):
    from ampviz.cli import main
    run = good_run()
    run.loss[0, :] = np.nan                           # a loop that never passed a loss to Recorder.step
    run.loss_scale[0, 1] = np.inf
    path = run.save(tmp_path / "nan.npz")[0]
    assert main(["info", str(path), "--json"]) == 0
    text = capsys.readouterr().out

    def refuse(token):
        raise AssertionError(f"{token} in the JSON output")
    summary = json.loads(text, parse_constant=refuse)
    assert summary["scale_max"] is None and summary["steps"] == STEPS


def test_info_piped_into_head_exits_quietly(tmp_path):
    """``ampviz info RUN | head -1`` with the race forced: head has gone before ampviz writes a byte."""
    path = good_run().save(tmp_path / "run.npz")[0]
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "ampviz", "info", str(path)], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert done.stderr == "" and done.returncode == 141


def test_names_with_terminal_escapes_are_printed_escaped(tmp_path, capsys):
    from ampviz.cli import main
    run = good_run()
    run.tensor_names[1] = "fc\x1b]0;owned\x07\x1b[2J"
    run.counts[0, :, 1, H.column(-40)] = 5                 # something fp16 flushes, so the name is printed
    path = run.save(tmp_path / "esc.npz")[0]
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and re.search(r"fc\\x1b\]0;owned\\x07", out)


def test_the_state_arrays_the_hostile_cases_bend_load_when_sound(tmp_path):
    run = Run.load(with_state(tmp_path / "state.npz", stalled=2))
    assert run.state_names == ["exp_avg", "exp_avg_sq"] and run.state_counts.shape == (1, 2, 1, 2, H.NBINS)
    assert run.state_stalled.sum() == 8
