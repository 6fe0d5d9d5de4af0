"""CPU tensors while kernels compile for the GPU: every entry point of the grouped family and of the MoE blocks
refuses them with a ValueError naming the tensor, before any launch (a launch passed them to Triton, whose error
names no tensor: "Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)"). Under the interpreter the
test makes tilegemm believe a GPU is in use, as tests/matmul/test_matmul_errors.py does."""

from __future__ import annotations

import pytest
import torch

import tilegemm
import tilegemm.nn.moe as moe
from tilegemm.core import runtime
from tilegemm.ops.grouped.api import batched_matmul, grouped_matmul, moe_gate_up, moe_gate_up_int4
from tilegemm.ops.grouped.routing import group_columns, moe_combine, moe_route
from tilegemm.ops.w4a16 import Int4Weight, quantize

O = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
GPU_IN_USE = "is on cpu, but a CUDA GPU is in use: move the tensors to the GPU"


@pytest.fixture
def gpu_in_use(monkeypatch):
    """Kernels compile for a GPU (as far as tilegemm knows), and a launch fails the test."""
    runtime.interpreting()  # settled first: a first call with _interpret False would check triton's mode
    monkeypatch.setattr(runtime, "_interpret", False)
    monkeypatch.setattr(runtime, "missing_gpu", lambda: None)  # (a GPU is in use: no forced backend without one)
    from triton.runtime.interpreter import InterpretedFunction

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched with CPU tensors")

    monkeypatch.setattr(InterpretedFunction, "run", launched)  # (on a GPU no kernel is interpreted: a no-op)


def _experts(E=3, N=16, K=32, gated=False):
    return quantize(torch.randn(E, 2 * N if gated else N, K, dtype=torch.float16), 32)


def _act_order(E=3, N=16, K=32):
    w = _experts(E, N, K)
    return Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape,
                      torch.stack([torch.randperm(K) for _ in range(E)]))


x16 = lambda M=6, K=32: torch.randn(M, K, dtype=torch.float16)  # noqa: E731

# (what, call, the tensor the error names)
PUBLIC = [
    ("grouped_mm 2d3d", lambda: tilegemm.grouped_mm(torch.randn(6, 8), torch.randn(2, 8, 5), offs=O(2, 6)), "a"),
    ("grouped_mm 3d3d", lambda: tilegemm.grouped_mm(torch.randn(2, 3, 8), torch.randn(2, 8, 5)), "a"),
    ("grouped_mm 2d2d", lambda: tilegemm.grouped_mm(torch.randn(3, 8), torch.randn(8, 5), offs=O(4, 8)), "a"),
    ("grouped_mm 3d2d", lambda: tilegemm.grouped_mm(torch.randn(2, 3, 8), torch.randn(8, 6), offs=O(2, 6)), "a"),
    ("grouped_mm bias", lambda: tilegemm.grouped_mm(torch.randn(6, 8), torch.randn(2, 8, 5), offs=O(2, 6),
                                                    bias=torch.randn(2, 5)), "a"),
    ("batched_matmul fp32", lambda: batched_matmul(torch.randn(2, 3, 8), torch.randn(2, 8, 5)),
     r"batched_matmul \(a \[B, M, K\] and b \[B, K, N\], on grouped_mm's checks\): a"),
    ("batched_matmul fp16", lambda: batched_matmul(torch.randn(2, 3, 8).half(), torch.randn(2, 8, 5).half()),
     r"batched_matmul \(a \[B, M, K\] and b \[B, K, N\], on grouped_mm's checks\): a"),
    ("moe_gate_up", lambda: moe_gate_up(torch.randn(6, 8), torch.randn(2, 8, 10), O(2, 6)),
     r"moe_gate_up \(x \[M, K\] and w \[E, K, 2I\] as a and b\): a"),
    ("w4a16.grouped_matmul", lambda: tilegemm.w4a16.grouped_matmul(x16(), _experts(), O(2, 4, 6)), "x"),
    ("grouped_matmul kernel", lambda: grouped_matmul(x16(), _experts(), O(2, 4, 6), kernel="dequant_dot"), "x"),
    ("grouped_matmul act-order", lambda: grouped_matmul(x16(), _act_order(), O(2, 4, 6)), "x"),
    ("moe_gate_up_int4", lambda: moe_gate_up_int4(x16(), _experts(gated=True), O(2, 4, 6)), "x"),
    ("moe_route", lambda: moe_route(torch.randn(4, 8), torch.randint(0, 3, (4, 2)), 3), "x"),
    ("moe_combine", lambda: moe_combine(torch.randn(8, 5), torch.arange(8, dtype=torch.int32), torch.rand(4, 2)),
     "y"),
    ("group_columns", lambda: group_columns(torch.randn(6, 8), O(2, 6), torch.arange(8).repeat(2, 1)), "x"),
]


@pytest.mark.parametrize("call, name", [c[1:] for c in PUBLIC], ids=[c[0] for c in PUBLIC])
def test_public_functions_refuse_cpu_tensors(gpu_in_use, call, name):
    with pytest.raises(ValueError, match=f"^{name} {GPU_IN_USE}"):
        call()


def _int4_parts(gated=False):
    w = _experts(gated=gated)
    return (x16(), w.qweight, w.scales, w.zeros, O(2, 4, 6), None, w.group_k, "none", gated, "auto")


# torch.ops.tilegemm.* called directly: no public function's checks ran before the op
OPS = [
    ("grouped_mm", lambda: torch.ops.tilegemm.grouped_mm(torch.randn(6, 8), torch.randn(2, 8, 5), O(2, 6), None,
                                                         None, "default", "auto"), "a"),
    ("grouped_mm_gated", lambda: torch.ops.tilegemm.grouped_mm_gated(torch.randn(6, 8), torch.randn(2, 8, 10),
                                                                     O(2, 6), None, "silu", "default"), "a"),
    ("grouped_w4a16", lambda: torch.ops.tilegemm.grouped_w4a16(*_int4_parts()), "x"),
    ("grouped_w4a16 gated", lambda: torch.ops.tilegemm.grouped_w4a16(*_int4_parts(gated=True)), "x"),
    ("moe_route", lambda: torch.ops.tilegemm.moe_route(torch.randn(4, 8), torch.randint(0, 3, (4, 2)), 3), "x"),
    ("moe_combine", lambda: torch.ops.tilegemm.moe_combine(torch.randn(8, 5), torch.arange(8, dtype=torch.int32),
                                                           torch.rand(4, 2)), "y"),
    ("group_columns", lambda: torch.ops.tilegemm.group_columns(torch.randn(6, 8), O(2, 6),
                                                               torch.arange(8).repeat(2, 1)), "x"),
]


@pytest.mark.parametrize("call, name", [c[1:] for c in OPS], ids=[c[0] for c in OPS])
def test_registered_ops_refuse_cpu_tensors(gpu_in_use, call, name):
    with pytest.raises(ValueError, match=f"^{name} {GPU_IN_USE}"):
        call()


def test_forced_compiler_without_a_gpu_is_named(monkeypatch):
    # TILEGEMM_INTERPRET=0 where torch sees no GPU: the error says so rather than "a CUDA GPU is in use"
    runtime.interpreting()
    monkeypatch.setattr(runtime, "_interpret", False)
    monkeypatch.setattr(runtime, "missing_gpu", lambda: "TILEGEMM_INTERPRET=0 asks for Triton's GPU compiler")
    with pytest.raises(ValueError, match="^x is on cpu: TILEGEMM_INTERPRET=0 asks for"):
        moe_route(torch.randn(4, 8), torch.randint(0, 3, (4, 2)), 3)


def _stacked(E=3, H=16, I=8):
    return moe.StackedExperts(torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1, torch.nn.SiLU(),
                              is_transposed=False)


@pytest.mark.parametrize("int4", [False, True], ids=["16-bit", "int4"])
def test_experts_forward_on_a_cpu_model_is_refused(gpu_in_use, int4):
    # the "tilegemm" experts implementation of a model left on the CPU: refused at its first kernel's checks
    holder = torch.nn.Module()
    holder.experts = _stacked()
    if int4:
        holder.half()
        assert moe.quantize_experts_(holder, group_size=-1) == ["experts"]  # (quantizing launches nothing)
    dtype = torch.float16 if int4 else torch.float32
    x = torch.randn(5, 16, dtype=dtype)
    index, weights = torch.randint(0, 3, (5, 2)), torch.rand(5, 2, dtype=dtype)
    with pytest.raises(ValueError, match=f"^x {GPU_IN_USE}"):
        holder.experts(x, index, weights)


def test_experts_on_another_device_than_the_input_are_named(device):
    # hidden states where kernels run, the experts on another device (meta): the first product names both
    experts = _stacked().to("meta")
    x, index, weights = (t.to(device) for t in (torch.randn(5, 16), torch.randint(0, 3, (5, 2)), torch.rand(5, 2)))
    with pytest.raises(ValueError, match=r"different devices: a on \S+, b on meta"):
        experts(x, index, weights)


def test_the_ops_device_check_passes_one_cuda_device_and_names_another():
    # the registered ops' check (checks.check_op_devices) on stand-ins for CUDA tensors: one device passes on its
    # short path, a tensor on a second GPU is named
    from types import SimpleNamespace
    from tilegemm.ops.grouped.checks import check_op_devices

    on = lambda i: SimpleNamespace(device=torch.device("cuda", i))  # noqa: E731
    names = ("a", "b", "offs", "bias")
    check_op_devices(names, (on(0), on(0), on(0), None))
    with pytest.raises(ValueError, match="different devices: a on cuda:0, offs on cuda:1"):
        check_op_devices(names, (on(0), on(0), on(1), None))
    with pytest.raises(ValueError, match="different devices: a on cuda:1, b on cuda:0"):
        check_op_devices(names, (on(1), on(0), on(1), on(1)))
