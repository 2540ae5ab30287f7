"""The run's vocabulary, stated once: what a counts row can hold (``KINDS``), the two domains counts are read
in (``DOMAINS``), and the domain each kind is stored in (``KIND_DOMAIN``). The Recorder writes ``KIND_DOMAIN``
into a run's ``meta["domains"]``; ``Run.stored_domain`` and the shifts between domains read it back, and the
checks hold a file's ``domains`` to ``KINDS`` and ``DOMAINS``::

    KIND_DOMAIN["activation"]        # "scaled": as the backward computed it, times the loss scale
"""

from __future__ import annotations

__all__ = ["KINDS", "DOMAINS", "KIND_DOMAIN", "SCALE_FREE"]

DOMAINS = ("unscaled", "scaled")      # as the optimizer sees a gradient, or multiplied by the loss scale

# the domain each kind of counts row is stored in:
KIND_DOMAIN = {
    "weight": "unscaled",             # a parameter's gradient as the optimizer sees it (after all-reduce, unscaling)
    "activation": "scaled",           # the gradient w.r.t. a module's output, as the backward computed it
    "weight_local": "scaled",         # a parameter's local gradient before DDP's all-reduce, as computed
    "output": "unscaled",             # a module's forward output: the loss scale never reaches the forward
}
KINDS = tuple(KIND_DOMAIN)            # ("weight", "activation", "weight_local", "output")

# kinds the loss scale never reaches: the same counts in both domains, never shifted
SCALE_FREE = frozenset({"output"})
