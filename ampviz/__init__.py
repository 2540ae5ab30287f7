"""ampviz: see what automatic mixed precision does to your gradients.

    import ampviz
    rec = ampviz.Recorder(model, optimizer, scaler=scaler)
    with rec:
        ...            # your unchanged training loop, plus rec.step(loss) after scaler.update()
    rec.run.save("run.npz")
"""

__version__ = "0.1.0"

from . import formats, histogram, replay, scaler  # noqa: E402
from ._warnings import AmpvizWarning  # noqa: E402
from .formats import BF16, FORMATS, FP8_E4M3FN, FP8_E5M2, FP16, FP32, TF32, Format, get_format  # noqa: E402
from .record import Recorder, RecordOptions  # noqa: E402
from .run import Run, RunFileError  # noqa: E402

__all__ = [
    "__version__", "formats", "histogram", "replay", "scaler", "AmpvizWarning", "Format", "get_format", "FORMATS",
    "FP32", "TF32", "FP16", "BF16", "FP8_E4M3FN", "FP8_E5M2", "Recorder", "RecordOptions", "Run", "RunFileError",
]
