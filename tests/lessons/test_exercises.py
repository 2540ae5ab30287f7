"""The exercise check: never shows an unanswered exercise's answer in the open, judges predictions."""

import math

import pytest

from ampviz.lessons.exercises import check, matches


def test_an_unanswered_exercise_keeps_its_answer_folded():
    c = check(..., 2049, explain="ten mantissa bits")
    assert not c.answered and c.right is None
    assert "2049" not in repr(c)                              # a headless Run All prints no answer
    html = c._repr_html_()
    head, folded = html.split("<details>")
    assert "2049" not in head and "2049" in folded            # only inside the closed <details>
    assert "<details open" not in html


def test_a_right_and_a_wrong_prediction():
    right = check(2049.0, 2049, explain="ten mantissa bits")
    assert right.right and "Right" in repr(right) and "ten mantissa bits" in repr(right)
    wrong = check(2048, 2049)
    assert wrong.answered and wrong.right is False
    assert "you said 2048" in repr(wrong) and "2049" in repr(wrong)
    assert "<details" not in wrong._repr_html_()


@pytest.mark.parametrize("answer, expected, same", [
    (2 ** -24, 5.960464477539063e-08, True), (1.0001, 1.0, False), ("  BF16 ", "bf16", True),
    ([1, 2.0], (1, 2), True), ([1, 2], [2, 1], False), ({"b", "a"}, {"a", "b"}, True), (["a", "a"], {"a"}, True),
    (True, 1, False), (False, False, True), (math.nan, math.nan, True), ("1", 1, False), (None, 0, False),
])
def test_matches(answer, expected, same):
    assert matches(answer, expected) is same


def test_tolerance_and_bad_arguments():
    assert check(1.05, 1.0, rel=0.1).right
    with pytest.raises(ValueError, match="rel: .*got 2"):
        check(1, 1, rel=2)
    with pytest.raises(TypeError, match="explain: expected a str"):
        check(1, 1, explain=3)
