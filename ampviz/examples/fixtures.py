"""The classroom's data and models that the practitioner side runs: the one place it takes them from.

``ampviz demo`` (:mod:`ampviz.demo`), the Trainer (:mod:`ampviz.examples.trainer`) and the torchrun example
(:mod:`ampviz.examples.ddp_amp`) train on the classroom's small data sets and models, which live in
:mod:`ampviz.lessons.data` and :mod:`ampviz.lessons.models` with the lessons that use them. Outside the
classroom nothing else imports ``ampviz.lessons`` (``tests/test_layout.py`` checks it), and this module imports
only those two, which need torch (and scikit-learn, when a data set is loaded)::

    from ampviz.examples.fixtures import digits, sigmoid_mlp
    data, model = digits(seed=0), sigmoid_mlp(seed=0)    # what `ampviz demo` trains
"""

from __future__ import annotations

from ..lessons.data import Split, digit_rows, digits
from ..lessons.models import TransformerClassifier, sigmoid_mlp

__all__ = ["Split", "digits", "digit_rows", "sigmoid_mlp", "TransformerClassifier"]
