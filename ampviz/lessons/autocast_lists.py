"""Which ops autocast casts: PyTorch's documented lists, the installed torch's dispatcher, and what ops do.

Three sources that can disagree, kept apart:

* ``DOCUMENTED_OPS``: the op lists of PyTorch's AMP documentation, copied into ampviz by hand (a copy of
  the docs, not a fact about the installed torch);
* :func:`autocast_kernels`: the aten ops that have an autocast kernel for a device type in the *installed*
  torch, read from its dispatcher;
* :func:`autocast_policy`: which list an op is on, read from what it does (its output dtype for a
  float32 and for a 16-bit input); :func:`trace_under_autocast`: every aten op a call runs, with its dtypes.

On a machine without a GPU, CUDA autocast still runs: the installed torch carries CUDA's autocast kernels
(they are device-independent C++), and :func:`run_under_autocast` feeds them *fake* CUDA tensors (torch's
``FakeTensorMode``: shape, dtype and device, no data), with no autograd. What that shows is real for a forward
call: the autocast kernels and the C++ code above the CUDA kernels run as on a GPU, so casts, the dtype each op
runs in and errors raised by autocast are those of a GPU. It cannot show the CUDA kernels' own numerics or errors,
``torch.amp.autocast("cuda")``'s checks on entry (bypassed), or a backward::

    >>> import torch
    >>> from ampviz.lessons.autocast_lists import autocast_kernels, autocast_policy, trace_under_autocast
    >>> "chain_matmul" in autocast_kernels("cuda")        # still cast under CUDA autocast...
    True
    >>> autocast_policy("cuda", lambda t: torch.einsum("ij,jk->ik", t, t), torch.randn(4, 4))
    '16-bit'
    >>> autocast_policy("cpu", lambda t: t.softmax(-1), torch.randn(4, 4))
    'input dtype'
    >>> logits, labels = torch.randn(4, 3, dtype=torch.float16), torch.zeros(4, dtype=torch.long)
    >>> [(r.op, r.dtype) for r in trace_under_autocast("cuda", torch.nn.functional.cross_entropy, logits, labels)
    ...  .records if r.op in ("_log_softmax", "nll_loss_forward")]
    [('_log_softmax', 'float16'), ('nll_loss_forward', 'float32')]

Used by lessons 03 (autocast) and 04 (autocast in practice).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F

from .autocast_ops import OpLog

__all__ = ["DOCS_URL", "DOCUMENTED_OPS", "POLICY_NAMES", "documented_list", "documented_policy", "expected_dtype",
           "autocast_kernels", "run_under_autocast", "trace_under_autocast", "autocast_policy", "PROBES",
           "FakeCudaLimit"]

# --- PyTorch's documented autocast op lists --------------------------------------------------
# Copied by hand from the "Autocast Op Reference" of PyTorch's AMP docs (docs/source/amp.md in
# pytorch/pytorch, 2.x). "low": ops autocast runs in the low-precision dtype; "fp32": ops it runs
# in float32; "promote": ops it runs in the widest input dtype. Unlisted ops run in the dtype
# their inputs already have (ordinary type promotion). CPU float16 uses the bfloat16 lists.
DOCS_URL = "https://docs.pytorch.org/docs/stable/amp.html#autocast-op-reference"
_CUDA_LOW = """__matmul__ addbmm addmm addmv addr baddbmm bmm multi_dot conv1d conv2d conv3d
conv_transpose1d conv_transpose2d conv_transpose3d GRUCell linear LSTMCell matmul mm mv prelu RNNCell"""
_CUDA_FP32 = """__pow__ __rdiv__ __rpow__ __rtruediv__ acos asin binary_cross_entropy_with_logits cosh
cosine_embedding_loss cdist cosine_similarity cross_entropy cumprod cumsum dist erfinv exp expm1
group_norm hinge_embedding_loss kl_div l1_loss layer_norm log log_softmax log10 log1p log2
margin_ranking_loss mse_loss multilabel_margin_loss multi_margin_loss nll_loss norm normalize pdist
poisson_nll_loss pow prod reciprocal rsqrt sinh smooth_l1_loss soft_margin_loss softmax softmin
softplus sum renorm tan triplet_margin_loss"""
_CUDA_PROMOTE = "addcdiv addcmul atan2 bilinear cross dot grid_sample index_put scatter_add tensordot"
_CPU_LOW = """conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm addbmm linear matmul _convolution
conv_tbc mkldnn_rnn_layer conv_transpose1d conv_transpose2d conv_transpose3d prelu
scaled_dot_product_attention _native_multi_head_attention"""
_CPU_FP32 = """avg_pool3d binary_cross_entropy grid_sampler grid_sampler_2d _grid_sampler_2d_cpu_fallback
grid_sampler_3d polar prod quantile nanquantile stft cdist trace view_as_complex cholesky_inverse
cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d max_unpool2d max_unpool3d
adaptive_avg_pool3d reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d
replication_pad3d mse_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss
poisson_nll_loss cross_entropy_loss l1_loss huber_loss margin_ranking_loss soft_margin_loss
triplet_margin_loss multi_margin_loss ctc_loss kl_div multilabel_margin_loss
binary_cross_entropy_with_logits fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft
fft_irfft fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn fft_hfft fft_ihfft linalg_cond linalg_matrix_rank
linalg_solve linalg_cholesky linalg_svdvals linalg_eigvals linalg_eigvalsh linalg_inv
linalg_householder_product linalg_tensorinv linalg_tensorsolve fake_quantize_per_tensor_affine geqrf
_lu_with_info qr svd triangular_solve fractional_max_pool2d fractional_max_pool3d adaptive_max_pool3d
multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex linalg_svd linalg_eig linalg_eigh
linalg_lstsq linalg_inv_ex"""
_CPU_PROMOTE = "cat stack index_copy"
DOCUMENTED_OPS: dict[str, dict[str, tuple[str, ...]]] = {
    "cuda": {"low": tuple(_CUDA_LOW.split()), "fp32": tuple(_CUDA_FP32.split()),
             "promote": tuple(_CUDA_PROMOTE.split())},
    "cpu": {"low": tuple(_CPU_LOW.split()), "fp32": tuple(_CPU_FP32.split()),
            "promote": tuple(_CPU_PROMOTE.split())},
}
# The same function under the name each device's list uses (cross_entropy is a Python wrapper
# of aten's cross_entropy_loss).
_ALIASES = {"cross_entropy": ("cross_entropy", "cross_entropy_loss")}
# What each list does to an op, in the words the lessons use; unlisted and "promote" ops follow their inputs.
POLICY_NAMES = {"low": "16-bit", "fp32": "float32", "promote": "input dtype", None: "input dtype"}


def documented_list(device_type: str, op: str) -> str | None:
    """Which documented list of ``device_type`` names ``op``: "low", "fp32", "promote" or None."""
    if device_type not in DOCUMENTED_OPS:
        raise ValueError(f"device_type: expected one of {sorted(DOCUMENTED_OPS)}, got {device_type!r}")
    names = _ALIASES.get(op, (op,))
    for category, ops in DOCUMENTED_OPS[device_type].items():
        if any(name in ops for name in names):
            return category
    return None


def documented_policy(device_type: str, op: str) -> str:
    """What the documented lists say autocast does to ``op``: "16-bit", "float32" or "input dtype"."""
    return POLICY_NAMES[documented_list(device_type, op)]


def expected_dtype(device_type: str, op: str, input_dtypes, low_dtype: torch.dtype) -> torch.dtype:
    """The dtype the documented lists predict for ``op`` under autocast to ``low_dtype``.

    "low" ops run in ``low_dtype``, "fp32" ops in float32; listed "promote" ops and unlisted ops
    run in the promotion of their floating-point ``input_dtypes`` (torch dtypes).
    """
    category = documented_list(device_type, op)
    if category == "low":
        return low_dtype
    if category == "fp32":
        return torch.float32
    dtypes = [d for d in input_dtypes if d.is_floating_point]
    if not dtypes:
        raise ValueError(f"input_dtypes: expected at least one floating dtype, got {input_dtypes!r}")
    result = dtypes[0]
    for d in dtypes[1:]:
        result = torch.promote_types(result, d)
    return result


# --- the installed torch ------------------------------------------------------------------------
_DISPATCH_KEYS = {"cuda": "AutocastCUDA", "cpu": "AutocastCPU"}


def autocast_kernels(device_type: str) -> frozenset[str]:
    """The aten ops (overload names dropped: ``"sum"`` for ``aten::sum.dim_IntList``) that have an autocast
    kernel for ``device_type`` ("cuda" or "cpu") in the installed torch, read from its dispatcher.

    An op with a kernel is on one of autocast's lists (or, like ``binary_cross_entropy`` on CUDA, refused);
    which list is :func:`autocast_policy`'s question.
    """
    if device_type not in _DISPATCH_KEYS:
        raise ValueError(f"device_type: expected one of {sorted(_DISPATCH_KEYS)}, got {device_type!r}")
    registrations = torch._C._dispatch_get_registrations_for_dispatch_key(_DISPATCH_KEYS[device_type])
    return frozenset(name.removeprefix("aten::").split(".")[0] for name in registrations if name.startswith("aten::"))


class FakeCudaLimit(Exception):
    """A call the fake-CUDA path cannot run on a CPU-only torch (not an error of autocast, nor of a GPU)."""


@contextlib.contextmanager
def _cuda_autocast_without_gpu(dtype: torch.dtype):
    """CUDA autocast's thread-local state, set as ``torch.amp.autocast("cuda").__enter__`` sets it, without its
    check for a GPU (which would switch autocast off); restored on exit."""
    enabled, previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", previous)


def run_under_autocast(device_type: str, fn, *inputs: torch.Tensor, dtype: torch.dtype | None = None):
    """``fn(*inputs)`` under ``device_type`` autocast to ``dtype`` (default: the device's), without autograd.

    ``device_type="cuda"`` on a machine without a GPU runs the installed torch's CUDA autocast kernels on
    fake CUDA tensors of the inputs' shapes and dtypes (no data: only dtypes, shapes and the errors autocast
    raises are real; see the module docstring). Errors (such as autocast refusing an op) propagate; a call that
    the fake path itself cannot run raises :class:`FakeCudaLimit`.

    Returns
    -------
    fn's result (a fake tensor in the no-GPU CUDA case).
    """
    with _under_autocast(device_type, fn, inputs, dtype) as run:
        return run()


def trace_under_autocast(device_type: str, fn, *inputs: torch.Tensor, dtype: torch.dtype | None = None) -> OpLog:
    """:func:`run_under_autocast`, traced: an :class:`~ampviz.lessons.autocast_ops.OpLog` of every aten op
    ``fn(*inputs)`` ran (phase "forward"), with the dtypes it ran in; ``.result`` is fn's result.

    On fake CUDA tensors each ``is_cuda()`` check of torch's C++ code reaches the tracer as an op ``device``
    (no arithmetic); those records are left out.
    """
    with _under_autocast(device_type, fn, inputs, dtype) as run:
        with OpLog() as tracer:
            tracer.result = run()
    tracer.records = [r for r in tracer.records if r.op != "device"]
    return tracer


@contextlib.contextmanager
def _under_autocast(device_type, fn, inputs, dtype):
    """Enter autocast (and, for CUDA without a GPU, fake tensors) and yield a function that calls ``fn`` on the
    inputs moved to ``device_type`` (or faked there)."""
    if device_type not in _DISPATCH_KEYS:
        raise ValueError(f"device_type: expected one of {sorted(_DISPATCH_KEYS)}, got {device_type!r}")
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    dtype = dtype or torch.get_autocast_dtype(device_type)
    if device_type == "cpu" or torch.cuda.is_available():
        moved = [t.detach().to(device_type) for t in inputs]
        with torch.no_grad(), torch.amp.autocast(device_type, dtype=dtype):
            yield lambda: fn(*moved)
        return
    # torch's fake tensors (imported here: the first call loads torch._dynamo, seconds). Autograd on fake CUDA
    # tensors aborts a CPU-only build of torch, so this path never records a graph (no_grad).
    from torch._subclasses.fake_tensor import FakeTensorMode
    with torch.no_grad(), FakeTensorMode():
        fakes = [torch.empty(t.shape, dtype=t.dtype, device="cuda") for t in inputs]
        with _cuda_autocast_without_gpu(dtype):
            yield lambda: _call_on_fakes(fn, fakes)


def _call_on_fakes(fn, fakes):
    try:
        return fn(*fakes)
    except RuntimeError as err:        # some calls (e.g. t[None]) need real CUDA support even on fake tensors
        if "not linked with support for cuda" not in str(err):
            raise
        raise FakeCudaLimit(f"fn: this call needs a CUDA build of torch even on fake tensors ({err}); it says "
                            "nothing about autocast: rewrite it (t.unsqueeze(0) for t[None]) or use a GPU") from err


def autocast_policy(device_type: str, fn, example: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    """Which autocast list ``fn`` is on for ``device_type``, read from what it does.

    Runs ``fn`` on a float32 and on a 16-bit copy of ``example`` under autocast (:func:`run_under_autocast`).

    Returns
    -------
    "16-bit" (both outputs 16-bit), "float32" (both float32), "input dtype" (each output in its input's
    dtype), "raises: <the error's first line>" when the op raises under autocast (a :class:`FakeCudaLimit`
    propagates instead: it is no answer), else
    "float32 in → …, 16-bit in → …".
    """
    dtype = dtype or torch.get_autocast_dtype(device_type)
    try:
        outs = [run_under_autocast(device_type, fn, example.to(d), dtype=dtype).dtype for d in (torch.float32, dtype)]
    except RuntimeError as err:
        return "raises: " + str(err).strip().splitlines()[0]
    if outs == [dtype, dtype]:
        return "16-bit"
    if outs == [torch.float32, torch.float32]:
        return "float32"
    if outs == [torch.float32, dtype]:
        return "input dtype"
    return f"float32 in → {outs[0]}, 16-bit in → {outs[1]}".replace("torch.", "")


def _class_zero(t):
    return torch.zeros(t.shape[0], dtype=torch.long, device=t.device)


def _chain_matmul(t):
    # deprecated in favour of torch.linalg.multi_dot (its UserWarning is silenced here); the
    # probe is about its autocast kernel, which CUDA still has
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.chain_matmul is deprecated", category=UserWarning)
        return torch.chain_matmul(t, t, t)


# Common ops, each a function of one square matrix, named as the documented lists name them.
PROBES = {
    "linear": lambda t: F.linear(t, t),
    "matmul": lambda t: t @ t,
    "einsum": lambda t: torch.einsum("ij,jk->ik", t, t),
    "chain_matmul": _chain_matmul,
    "linalg_vecdot": lambda t: torch.linalg.vecdot(t, t),
    "scaled_dot_product_attention": lambda t: F.scaled_dot_product_attention(*[t.unsqueeze(0)] * 3),
    "relu": F.relu,
    "softmax": lambda t: t.softmax(-1),
    "log_softmax": lambda t: t.log_softmax(-1),
    "logsumexp": lambda t: t.logsumexp(-1),
    "layer_norm": lambda t: F.layer_norm(t, t.shape[-1:]),
    "exp": torch.exp,
    "sum": torch.sum,
    "cumsum": lambda t: t.cumsum(-1),
    "mse_loss": lambda t: F.mse_loss(t, t),
    "cross_entropy": lambda t: F.cross_entropy(t, _class_zero(t)),
}
