"""ampviz.lessons.block_doctor: the facts lesson 08b §7 asserts, over several model and batch seeds."""

import pytest
import torch
import torch.nn.functional as F

from ampviz import AmpvizWarning
from ampviz.blocks import block_counts, what_if
from ampviz.examples.trainer import train_classifier
from ampviz.lessons.block_doctor import flushed_frame, recipe_frame, record_blocks, verdict_frame, verdict_table
from ampviz.lessons.block_scaling import mx_fates, quantize_blocks
from ampviz.lessons.data import digits
from ampviz.lessons.fp8_scaling import capture_linear_operands
from ampviz.lessons.models import relu_mlp

HEAD_G = "head [grad_output]"


@pytest.fixture(scope="module")
def data():
    return digits(seed=0)


def trained(data, seed):
    return train_classifier(relu_mlp(seed=seed), data, steps=400, lr=3e-3, record=False, seed=seed + 1).model


@pytest.mark.parametrize("seed", [0, 1, 9, 15])          # 9, 15: OCP floor's real error highest of seeds 0-16
def test_the_lessons_block_verdicts_hold_over_seeds(data, seed):
    torch.set_num_threads(1)
    model = trained(data, seed)
    before = [p.detach().clone() for p in model.parameters()]
    blocks = record_blocks(model, data, steps=20, every=5, layouts=("mx32", "nv16"), seed=seed + 2).diagnose()["blocks"]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))      # a copy was trained
    judged = {(t["tensor"], r): c for t in blocks["tensors"] for r, c in t["cells"].items()}
    assert len(blocks["tensors"]) == 12 and {r for _, r in judged} == {"mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4"}
    assert all(c["ok"] is not False for c in judged.values())
    u = {r["recipe"]: r["rounding_bound"] for r in blocks["recipes"]}
    mx4 = flushed_frame(blocks, "mxfp4")
    counted = mx4["values flushed"]
    assert counted.idxmax() == HEAD_G and counted[HEAD_G] > 0.5
    assert counted[HEAD_G] > 5 * counted.drop(HEAD_G).max()
    assert mx4.loc[HEAD_G, "squared norm flushed"] < u["mxfp4"] ** 2 / 4 / 20
    assert mx4["squared norm flushed"].idxmax() != HEAD_G
    rms = verdict_frame(blocks).xs("RMS error", axis=1, level=1)
    assert rms[["MXFP4", "NVFP4"]].stack().between(0.75 * u["mxfp4"], 1.25 * u["mxfp4"]).all()
    unsure = {key for key, c in judged.items() if c["ok"] is None}
    assert unsure <= {(HEAD_G, "mxfp8_e4m3")}
    # the lesson's batch of §4 / §6, from the same model: its real casts
    ops = capture_linear_operands(model, F.cross_entropy, data.x_train[:256], data.y_train[:256])
    g, labels = ops["head"].grad, data.y_train[:256]
    with torch.no_grad():
        p = torch.softmax(model(data.x_train[:256]), dim=1)
    rows = torch.arange(len(labels))
    confident = p[rows, labels] == 1                          # p_y rounds to 1 in fp32, so g_y = (p_y - 1) / N is 0
    assert confident.any() and (g[rows, labels][confident] == 0).all()
    not_true = g.abs().argmax(dim=1) != labels                # the largest |g| is mostly the true class's
    assert confident.sum() <= not_true.sum() < len(rows) / 2
    real = mx_fates(g, "e2m1", 32)
    assert real["flushed"] / real["nonzero"] > 0.5
    floor_error, rceil_error = (float((quantize_blocks(g, element="e4m3", block=32, rule=rule) - g).norm() / g.norm())
                                for rule in ("ocp", "rceil"))
    batch = what_if(block_counts(g, "mx32", dim=-1, pad=True), "mxfp8_e4m3")   # like with like: this batch's bounds
    assert batch.rms_error[0] <= floor_error <= batch.rms_error[1] and rceil_error < u["mxfp8_e4m3"]


def test_a_power_of_two_loss_scale_changes_no_number_and_the_table_shades_what_is_not_ok(data):
    model = trained(data, 0)
    plain = record_blocks(model, data, seed=2).diagnose()["blocks"]
    scaled = record_blocks(model, data, seed=2, loss_scale=2.0**10).diagnose()["blocks"]
    assert verdict_frame(scaled).equals(verdict_frame(plain))
    odd = record_blocks(model, data, seed=2, loss_scale=3.0)        # not a power of two: the counts move
    with pytest.warns(AmpvizWarning, match="powers of two"):
        assert not verdict_frame(odd.diagnose()["blocks"]).equals(verdict_frame(plain))
    html = verdict_table(plain).to_html()
    shaded = any(c["ok"] is None for t in plain["tensors"] for c in t["cells"].values())
    assert ("#fde8b0" in html) == shaded and "#f4c2c2" not in html
    calls = recipe_frame(plain)
    probably = {name for name, call in calls["call"].items() if call == "probably"}
    assert set(calls["call"]) <= {"yes", "probably"} and probably == ({"MXFP8 E4M3"} if shaded else set())
    assert (calls.loc[list(probably), "not ok"] == HEAD_G).all() and (calls["not ok"] == "").sum() == 4 - len(probably)
    assert verdict_frame(plain)["verdict"].eq("").sum() == 12 - shaded          # blank where every recipe is ok
    with pytest.raises(ValueError, match="exact"):
        flushed_frame(plain, "nvfp4")
