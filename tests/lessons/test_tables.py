"""Lesson tables keep every cell whole (the browser pass found plotly tables clipping the new spellings)."""

import pytest

from ampviz.lessons.tables import Table


def test_long_cells_stay_whole_in_html_and_text():
    long = 'torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)'
    error = "expected m1 and m2 to have the same dtype, but got: c10::BFloat16 != float" * 2
    t = Table(["new", "error"], [(long, error)], title="t", note="n", tints=["16-bit"], code=(0,))
    html = t._repr_html_()
    assert long.replace('"', "&quot;") in html and error in html and "overflow-wrap:break-word" in html
    assert "background:#FBE8CF" in html and "<code>" in html
    assert long in repr(t) and error in repr(t) and t.column("error") == [error]


def test_bad_tables_are_named():
    with pytest.raises(ValueError, match="rows: row 0 has 1 cells, expected 2"):
        Table(["a", "b"], [("x",)])
    with pytest.raises(ValueError, match="tints: expected one per row"):
        Table(["a"], [("x",)], tints=[])
    with pytest.raises(ValueError, match="name: expected one of"):
        Table(["a"], [("x",)]).column("b")
