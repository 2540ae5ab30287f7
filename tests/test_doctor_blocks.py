"""The doctor's "can I switch to block-scaled formats?" table (issue 20, item 4): from the block statistics a run
recorded with ``Recorder(blocks=...)``, per Linear tensor and recipe, the share of the squared norm a cast
flushes and its RMS error, judged against the element format's own rounding — held against real casts of the
same tensors."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_blocks import cast_for, real

import ampviz
from ampviz.doctor import as_html, as_text
from ampviz.doctor._blocks import NORM_LOST_OK, RMS_OK, rounding_bound


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def spread_inputs(n, seed=1):
    """Inputs whose every block of 32 features holds one value of magnitude 1 and 31 in (2**-6, 2**-5]: MXFP4
    (E2M1 elements, a power-of-two scale from the block's maximum) flushes the 31, which carry ~1.8% of the
    squared norm; E4M3 elements keep them in their normal range."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        mag = torch.where(torch.arange(64) % 32 == 0, torch.tensor(1.0),
                          2.0 ** -5 * (0.55 + 0.45 * torch.rand(32, 64, generator=g)))
        sign = torch.where(torch.rand(32, 64, generator=g) < 0.5, -1.0, 1.0)
        out.append(((mag * sign).float(), torch.randint(0, 10, (32,), generator=g)))
    return out


def record(data, blocks=True, **kw):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampviz.Recorder(model, opt, blocks=blocks, path=None, **kw) as rec:
        for x, y in data:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            rec.step()
    return rec.run


def test_a_tensor_spread_inside_its_blocks_is_judged_by_the_norm_it_loses_as_a_real_cast_measures():
    data = spread_inputs(3)
    run = record(data, blocks={"every": 1})
    d = run.diagnose()
    bt = d["blocks"]
    assert bt is not None and bt["steps"] == [0, 1, 2]
    rows = {t["tensor"]: t for t in bt["tensors"]}
    x_row = rows["fc1 [input]"]
    X = torch.cat([x for x, _ in data])                 # the three steps' inputs: their counts add up
    for recipe, layout in (("mxfp4", "mx32"), ("mxfp8_e4m3", "mx32"), ("mxfp8_e5m2", "mx32"), ("nvfp4", "nv16"),
                           ("rowwise_fp8", "row"), ("tile_fp8", "tile1x128")):
        cell = x_row["cells"][recipe]
        r = real(*cast_for(recipe, X, layout))             # the cast itself, in torch
        assert cell["layout"] == layout
        if cell["exact"]:
            assert cell["norm_lost"] == pytest.approx(r["norm_lost"], rel=1e-9, abs=1e-300)
        assert r["norm_lost"] <= cell["norm_lost"] * (1 + 1e-9) + 1e-300 and r["rms"] <= cell["rms_error"] * (1 + 1e-9)
        # the verdict agrees with the real cast: "ok" ones pass the thresholds, lossy ones fail one
        u = rounding_bound(recipe)
        passes = r["norm_lost"] <= NORM_LOST_OK * u * u and r["rms"] <= RMS_OK * u
        assert cell["ok"] is None or cell["ok"] == passes, (recipe, cell, r)
    # mxfp4 flushes the small values: ~1.8% of the norm, beyond E2M1's own rounding (u = 1/4: u**2/4 = 1.56%)
    mx4 = x_row["cells"]["mxfp4"]
    assert mx4["ok"] is False and 0.0157 < mx4["norm_lost"] < 0.03 and mx4["flushed_share"] > 0.9
    assert x_row["verdict"].split("; ")[-1] == "not in MXFP4"
    # the same tensor loses nothing in E4M3 elements, block or row scaled
    for recipe in ("mxfp8_e4m3", "mxfp8_e5m2", "rowwise_fp8", "tile_fp8"):
        assert x_row["cells"][recipe]["ok"] is True and x_row["cells"][recipe]["norm_lost"] == 0
    verdicts = {r["recipe"]: r for r in bt["recipes"]}
    assert not verdicts["mxfp4"]["ok"] and "fc1 [input]" in verdicts["mxfp4"]["verdict"]
    assert verdicts["mxfp8_e4m3"]["ok"]
    assert x_row["cells"]["mxfp4"]["worst_step"]["step"] in (0, 1, 2)
    text = as_text(d, width=0)
    assert "can I switch to block-scaled formats?" in text and "fc1 [input]" in text
    assert "Can I switch to block-scaled formats?" in as_html(d)


def test_gaussian_tensors_pass_every_recipe_and_the_weight_uses_128x128_tiles():
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(128, 64, generator=g), torch.randint(0, 10, (128,), generator=g)) for _ in range(2)]
    run = record(data, blocks={"every": 1, "layouts": ["mx32", "nv16", "row", "tile1x128", "tile128x128"]})
    bt = run.diagnose()["blocks"]
    rows = {t["tensor"]: t for t in bt["tensors"]}
    for recipe in ("mxfp8_e4m3", "mxfp8_e5m2", "rowwise_fp8", "tile_fp8"):
        assert rows["fc1 [input]"]["cells"][recipe]["ok"], rows["fc1 [input]"]["cells"][recipe]
        assert rows["fc1 [weight]"]["cells"][recipe]["ok"], rows["fc1 [weight]"]["cells"][recipe]
    assert rows["fc1 [weight]"]["cells"]["tile_fp8"]["layout"] == "tile128x128"
    assert rows["fc1 [input]"]["cells"]["tile_fp8"]["layout"] == "tile1x128"
    # a Gaussian block is within E2M1's own rounding too (the cast's damage is rounding, not flushing)
    assert rows["fc1 [input]"]["cells"]["mxfp4"]["ok"] and rows["fc1 [input]"]["cells"]["nvfp4"]["ok"]


def test_a_run_without_block_statistics_has_no_table_and_says_how_to_get_one():
    d = record(spread_inputs(1), blocks=False).diagnose()
    assert d["blocks"] is None
    check = next(c for c in d["checks"] if c["check"].startswith("can I switch to block-scaled"))
    assert not check["ran"] and "blocks=True" in check["why"]
    assert "block-scaled" not in as_text(d, width=0).split("checked:")[0]
