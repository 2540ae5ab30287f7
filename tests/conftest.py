import os

import numpy as np
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # AMPVIZ_TEST_DEVICE=cpu: benchmarks/gpu_check.sh --device cpu runs the gpu tests on the CPU (a dry run)
    if torch.cuda.is_available() or os.environ.get("AMPVIZ_TEST_DEVICE") == "cpu":
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def frexp_columns(values: np.ndarray) -> np.ndarray:
    """Oracle: ampviz's column of each value, computed independently with numpy.frexp.

    Columns: 0 zero; 1 for 0 < |x| <= 2**-126; k + 128 for 2**k < |x| <= 2**(k+1);
    255 for |x| > 2**127 (inf included); 256 nan.
    """
    a = np.abs(values.astype(np.float64))
    m, e = np.frexp(a)                      # a = m * 2**e, m in [0.5, 1)
    k = np.where(m == 0.5, e - 2, e - 1)    # closed-top binades: powers of two go one down
    col = k + 128
    col = np.where(a <= 2.0 ** -126, 1, col)
    col = np.where(a > 2.0 ** 127, 255, col)
    col = np.where(a == 0, 0, col)
    col = np.where(np.isnan(a), 256, col)
    return col.astype(np.int64)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
