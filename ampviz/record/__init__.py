"""Recording a training loop: the :class:`Recorder` and its :class:`RecordOptions`.

    from ampviz.record import Recorder, RecordOptions
    rec = Recorder(model, optimizer, scaler=scaler, options=RecordOptions(every=4))

``recorder.py`` holds the public class (its options, what it watches, its methods); ``options.py`` the options;
the private modules the rest: ``_recording`` the one owner of a recording's state (made at ``with recorder:``:
counter, store, hooks, step index, the current ``every``, checks, saves), the hooks (``_hooks``), the bounded
store (``_store``), saving (``_save``, ``_paths``, ``_signals``), what is watched (``_unwrap``, ``_select``) and
the misuse checks (``_checks``).
"""

from .options import RecordOptions
from .recorder import Recorder

__all__ = ["Recorder", "RecordOptions"]
