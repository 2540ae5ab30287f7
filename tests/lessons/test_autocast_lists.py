"""Autocast's op lists three ways: PyTorch's documentation (ampviz's copy), the installed torch's dispatcher, and
what ops do. The oracle is the installed torch: real casts on the CPU, CUDA's own autocast kernels on fake
CUDA tensors without a GPU (and on real ones with a GPU)."""

import pytest
import torch
import torch.nn.functional as F

from ampviz.lessons.autocast_lists import (
    DOCUMENTED_OPS,
    PROBES,
    FakeCudaLimit,
    autocast_kernels,
    autocast_policy,
    documented_list,
    documented_policy,
    expected_dtype,
    run_under_autocast,
    trace_under_autocast,
)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_documented_cpu_lists_predict_the_installed_torch(low):
    """Oracle: the dtype each op's output really has under CPU autocast."""
    x, w, target = torch.randn(4, 6), torch.randn(6, 6), torch.randint(0, 6, (4,))
    probes = {"linear": lambda h: F.linear(h, w), "matmul": lambda h: h @ w,
              "softmax": lambda h: h.softmax(-1),
              "log_softmax": lambda h: h.log_softmax(-1), "layer_norm": lambda h: F.layer_norm(h, (6,)),
              "exp": torch.exp, "sum": torch.sum, "gelu": F.gelu, "mse_loss": lambda h: F.mse_loss(h, x),
              "cross_entropy": lambda h: F.cross_entropy(h, target), "prod": torch.prod,
              "cat": lambda h: torch.cat([h, x])}
    with torch.autocast("cpu", dtype=low):
        h = F.linear(x, w)
        for op, probe in probes.items():
            inputs = [h.dtype, x.dtype] if op in ("cat",) else [h.dtype]
            assert probe(h).dtype == expected_dtype("cpu", op, inputs, low), op


def test_documented_lists():
    assert documented_list("cuda", "softmax") == "fp32" and documented_list("cpu", "softmax") is None
    assert documented_list("cuda", "linear") == documented_list("cpu", "linear") == "low"
    assert documented_list("cpu", "cross_entropy") == documented_list("cuda", "cross_entropy") == "fp32"
    assert documented_list("cpu", "cat") == "promote" and documented_policy("cpu", "cat") == "input dtype"
    assert all(len(set(ops)) == len(ops) for lists in DOCUMENTED_OPS.values() for ops in lists.values())
    with pytest.raises(ValueError, match="device_type: expected one of"):
        documented_list("tpu", "mm")
    with pytest.raises(ValueError, match="input_dtypes"):
        expected_dtype("cpu", "relu", [torch.int64], torch.bfloat16)


def test_the_dispatcher_knows_cuda_ops_the_documentation_leaves_out():
    """The review's point: "today's list" in the docs is not the installed torch. chain_matmul left the docs
    but kept its CUDA autocast kernel; einsum, SDPA and linalg_vecdot have one and are not in the CUDA docs."""
    cuda, cpu = autocast_kernels("cuda"), autocast_kernels("cpu")
    for op in ("chain_matmul", "einsum", "scaled_dot_product_attention", "linalg_vecdot", "logsumexp"):
        assert op in cuda and documented_list("cuda", op) is None, op
    assert {"mm", "addmm", "softmax", "sum", "log_softmax", "nll_loss"} <= cuda
    assert "cross_entropy_loss" in cpu and "cross_entropy_loss" not in cuda   # CUDA: through its composite
    assert "softmax" not in cpu and "relu" not in cpu | cuda
    with pytest.raises(ValueError, match="device_type"):
        autocast_kernels("xla")


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_policies_read_from_behaviour_match_the_kernels(device_type):
    x = torch.randn(8, 8)
    policies = {op: autocast_policy(device_type, fn, x) for op, fn in PROBES.items() if op != "chain_matmul"}
    assert set(policies.values()) <= {"16-bit", "float32", "input dtype"}, policies
    kernels = autocast_kernels(device_type)
    for op in ("linear", "matmul", "mse_loss", "linalg_vecdot", "scaled_dot_product_attention"):
        assert op in kernels and policies[op] != "input dtype", op
    assert "relu" not in kernels and "einsum" in kernels | autocast_kernels("cuda")
    assert policies["linear"] == policies["matmul"] == "16-bit" and policies["relu"] == "input dtype"
    expected = "float32" if device_type == "cuda" else "input dtype"
    assert policies["softmax"] == policies["sum"] == policies["layer_norm"] == expected


def test_a_composite_op_without_a_cpu_kernel_is_cast_through_the_ops_it_is_built_from():
    assert "einsum" not in autocast_kernels("cpu") and "bmm" in autocast_kernels("cpu")
    assert autocast_policy("cpu", PROBES["einsum"], torch.randn(8, 8)) == "16-bit"


def test_cuda_autocast_runs_without_a_gpu_and_disagrees_with_the_docs_where_the_docs_are_silent():
    x = torch.randn(8, 8)
    disagree = {op for op, fn in PROBES.items() if op != "chain_matmul"
                and autocast_policy("cuda", fn, x) != documented_policy("cuda", op)}
    assert disagree == {"einsum", "linalg_vecdot", "scaled_dot_product_attention", "logsumexp"}
    assert autocast_policy("cuda", PROBES["chain_matmul"], x) == "16-bit"
    assert autocast_policy("cpu", PROBES["chain_matmul"], x) == "16-bit"      # no CPU kernel: via mm
    assert not torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.float16


def test_binary_cross_entropy_is_refused_by_cuda_autocast_and_float32_on_cpu():
    p, target = torch.rand(4, 3), torch.rand(4, 3)
    with pytest.raises(RuntimeError, match="unsafe to autocast"):
        run_under_autocast("cuda", F.binary_cross_entropy, p, target)
    assert run_under_autocast("cpu", F.binary_cross_entropy, p, target).dtype == torch.float32
    for device_type in ("cpu", "cuda"):
        out = run_under_autocast(device_type, F.binary_cross_entropy_with_logits, p, target)
        assert out.dtype == torch.float32
    assert autocast_policy("cuda", lambda t: F.binary_cross_entropy(t.sigmoid(), t.sigmoid()), p).startswith(
        "raises: torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast")


def test_run_under_autocast_leaves_no_state_behind_even_when_the_op_raises():
    before = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"), torch.is_autocast_enabled("cpu"))
    with pytest.raises(RuntimeError):
        run_under_autocast("cuda", F.binary_cross_entropy, torch.rand(2), torch.rand(2))
    run_under_autocast("cuda", torch.exp, torch.randn(2), dtype=torch.bfloat16)
    assert (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
            torch.is_autocast_enabled("cpu")) == before
    with pytest.raises(TypeError, match="fn: expected a callable"):
        run_under_autocast("cpu", 3, torch.randn(2))
    with pytest.raises(ValueError, match="device_type"):
        run_under_autocast("mps", torch.exp, torch.randn(2))


@pytest.mark.gpu
def test_fake_and_real_cuda_agree():
    """With a GPU, run_under_autocast uses real CUDA tensors; the policies must be those found without one."""
    x = torch.randn(8, 8)
    for op, fn in PROBES.items():
        assert autocast_policy("cuda", fn, x) == (documented_policy("cuda", op)
                                                  if op not in {"einsum", "linalg_vecdot", "chain_matmul",
                                                                "scaled_dot_product_attention", "logsumexp"}
                                                  else ("float32" if op == "logsumexp" else "16-bit")), op


def _loss_route(device_type, low):
    logits, labels = torch.randn(6, 4).to(low), torch.randint(0, 4, (6,))
    tracer = trace_under_autocast(device_type, F.cross_entropy, logits, labels, dtype=low)
    return tracer, [(r.op, r.input_dtypes, r.output_dtypes) for r in tracer.records
                    if r.op in ("_to_copy", "_log_softmax", "nll_loss_forward")]


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_cross_entropy_takes_a_different_route_to_float32_on_each_device(low):
    """CPU autocast casts the logits up for cross_entropy_loss; CUDA has no kernel for it, and its composite calls
    log_softmax with the logits' own dtype, which autocast respects: log_softmax runs in 16 bits and nll_loss casts
    the log-probabilities up (the lesson used to say the logits were cast up on both devices)."""
    name = str(low).removeprefix("torch.")
    cpu, cpu_route = _loss_route("cpu", low)
    cuda, cuda_route = _loss_route("cuda", low)
    assert cpu_route == [("_to_copy", (name,), ("float32",)), ("_log_softmax", ("float32",), ("float32",)),
                         ("nll_loss_forward", ("float32",), ("float32", "float32"))]
    assert cuda_route == [("_log_softmax", (name,), (name,)), ("_to_copy", (name,), ("float32",)),
                          ("nll_loss_forward", ("float32",), ("float32", "float32"))]
    assert cpu.result.dtype == cuda.result.dtype == torch.float32
    assert all(r.op != "device" for r in cuda.records)           # fake tensors' is_cuda() checks left out
    assert not torch.is_autocast_enabled("cuda") and not torch.is_autocast_enabled("cpu")


def test_trace_under_autocast_names_bad_arguments():
    with pytest.raises(ValueError, match="device_type"):
        trace_under_autocast("xpu", torch.exp, torch.randn(2))
    with pytest.raises(TypeError, match="fn: expected a callable"):
        trace_under_autocast("cuda", None, torch.randn(2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fake-CUDA path is used only without a GPU")
def test_a_call_the_fake_path_cannot_run_is_not_reported_as_autocast_refusing_it():
    """t[None] on a fake CUDA tensor fails on a CPU-only torch ("not linked with support for cuda"); a GPU runs it.
    That must not come back as an autocast policy ("raises: ...")."""
    x = torch.randn(4, 4)
    with pytest.raises(FakeCudaLimit, match="t.unsqueeze"):
        run_under_autocast("cuda", lambda t: t[None], x)
    with pytest.raises(FakeCudaLimit):
        autocast_policy("cuda", lambda t: torch.bmm(t[None], t[None]), x)
    assert autocast_policy("cuda", lambda t: torch.bmm(t.unsqueeze(0), t.unsqueeze(0)), x) == "16-bit"
    assert not torch.is_autocast_enabled("cuda")


@pytest.mark.gpu
def test_real_cuda_takes_the_route_the_fake_tensors_show():
    assert _loss_route("cuda", torch.float16)[1][0] == ("_log_softmax", ("float16",), ("float16",))


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_cuda_autocast_sums_with_dtype_float32_without_copying(low):
    """Lesson 04 said the bias sum ran "on float32 copies"; sum is an fp32_set_opt_dtype op: autocast passes
    dtype=float32 and the kernel reads the 16-bit tensor itself."""
    records = trace_under_autocast("cuda", lambda g: g.sum(0), torch.randn(8, 3).to(low), dtype=low).records
    assert [(r.op, r.output_dtypes) for r in records] == [("sum", ("float32",))]


def test_muons_norm_is_float32_under_cuda_bf16_autocast_and_bf16_under_cpu():
    g = torch.randn(8, 8).bfloat16()
    assert {d: trace_under_autocast(d, torch.linalg.vector_norm, g, dtype=torch.bfloat16).result.dtype
            for d in ("cpu", "cuda")} == {"cpu": torch.bfloat16, "cuda": torch.float32}
    # autocast never casts float64: the scaler's reciprocal stays float64 on CUDA's float32 list
    assert trace_under_autocast("cuda", lambda s: s.double().reciprocal(), torch.ones(1)).result.dtype == torch.float64
