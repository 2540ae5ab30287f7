"""The doctor's planted-fault matrix (issue 17): every loop shape of ``_doctor_matrix.SHAPES`` x every fault of
``FAULTS``, each cell a real recorded run (real GradScaler, Lightning and HF Trainers, DDP on 2 gloo ranks) that must
get exactly the findings of its fault, with the right layer, steps and counts, and no other; each clean run is clean.
Cells that cannot exist say why (``NOT_APPLICABLE``). ``python tests/_doctor_matrix.py`` prints the matrix.

The three raw-loop rows run in a few seconds; the framework rows (Lightning, HF, DDP) are marked slow."""

import _doctor_matrix as M
import numpy as np
import pytest

from ampviz.doctor import as_text

FAST = ("plain", "clip", "accumulate 4")


def bare(name: str) -> str:
    return name.removeprefix("net.")                  # the LightningModule holds the network as .net


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return str(tmp_path_factory.mktemp("matrix"))


def cells():
    for shape, fault in M.cells():
        yield pytest.param(shape, fault, marks=[] if shape in FAST else [pytest.mark.slow], id=f"{shape}|{fault}")


def test_every_cell_exists_or_says_why_not():
    made = set(M.cells())
    for shape in M.SHAPES:
        for fault in M.FAULTS:
            assert ((shape, fault) in made) != ((shape, fault) in M.NOT_APPLICABLE), (shape, fault)
    assert all(len(why) > 30 for why in M.NOT_APPLICABLE.values())


@pytest.mark.parametrize("shape, fault", list(cells()))
def test_each_cell_gets_exactly_the_finding_of_its_fault(shape, fault, work):
    run = M.record(shape, fault, work)
    d = run.diagnose()
    checks = [f["check"] for f in d["findings"]]
    assert sorted(checks) == sorted(M.EXPECTED[fault]), as_text(d, f"{shape} x {fault}", width=0)
    skipped = np.flatnonzero(run.skipped[0])
    if fault == "none":
        assert d["clean"] and not skipped.size
        return
    f = d["findings"][0]
    if fault in ("fp16 underflow, no scaler", "scale held too low"):
        assert f["severity"] == "error" and bare(f["tensors"][0]) == "fc0"          # the layer farthest from the loss
        assert f["steps"] == run.steps.tolist() and f["evidence"]["recorded_scale"] == [1.0, 1.0]
        fc0 = next(x for x in f["evidence"]["tensors"] if bare(x["tensor"]) == "fc0")
        assert fc0["zero_share"] > 0.5 and fc0["subnormal_share"] > 0.9
        for replayed in f["evidence"]["replays"].values():                         # a scale keeps them normal
            assert replayed["log2_scale"][0] >= 16 and replayed["subnormal_share"][fc0["tensor"]] < 0.01
    elif fault in M.CELL_ORIGIN:
        key, name = M.CELL_ORIGIN[fault]
        assert bare(f["evidence"][key]) == name and f["steps"] == [M.FAULT_STEP] and f["severity"] == "error"
        assert f["ranks"] == run.ranks
    elif fault == "init_scale too high":
        assert f["severity"] == "info" and f["evidence"]["init_scale"] == 2.0 ** 24
        n = f["evidence"]["skipped_at_start"]          # the skips while the scale came down (ordinary ones may follow)
        assert n >= 4 and f["steps"] == run.steps[skipped[:n]].tolist() and f["steps"][0] == 0
    else:                                                                          # the scheduler on skips
        assert f["evidence"]["advanced_on_skipped"] == f["evidence"]["skipped"] == skipped.size > 3
    if skipped.size:                                # every skip explained: none left without a cause
        assert {e["cause"] for e in d["nonfinite_steps"] if e["skipped"]} <= {"loss scale", "forward",
                                                                            "not the loss scale"}
