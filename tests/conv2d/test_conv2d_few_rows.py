"""1x1 layers over few pixels with channel counts that are no multiple of 16 bytes (squeeze-and-excitation blocks
on a one-pixel image): one launch of split_k's kernel (gemm_1x1.few_rows_product), bias and activation fused,
in either memory format; on a GPU the call is kept and replays as that one launch."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_rel_close

import tilegemm
from tilegemm.ops.conv2d import gemm_1x1

CL = torch.channels_last


def launches(monkeypatch) -> list:
    """The kernels launched from here on (their names and constexpr arguments), counted at
    :func:`tilegemm.core.launch.launch` in every tilegemm module that calls it (all are imported first, so that
    none imported later escapes the count)."""
    from tilegemm.core import launch as core_launch

    for package in ("tilegemm.ops.matmul", "tilegemm.ops.conv2d"):
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
            try:
                importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - a Gluon module Triton's interpreter cannot import: it never launches here
                pass
    real = core_launch.launch
    seen = []

    def counted(kernel, grid, args, kwargs, keep=(), stream=None):
        seen.append((kernel.__name__, kwargs))
        return real(kernel, grid, args, kwargs, keep, stream)

    for name, module in list(sys.modules.items()):
        if name.startswith("tilegemm") and getattr(module, "launch", None) is real:
            monkeypatch.setattr(module, "launch", counted)
    return seen


def _layer(N, C, H, K, dtype, channels_last, device, bias=True):
    x = torch.randn(N, C, H, H, device=device).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=CL)
    w = (torch.randn(K, C, 1, 1, device=device) / C ** 0.5).to(dtype)
    b = torch.randn(K, device=device).to(dtype) if bias else None
    return x, w, b


def _reference(x, w, b, activation):
    """F.conv2d in fp32, then the activation."""
    ref = F.conv2d(x.float(), w.float(), None if b is None else b.float())
    return {"none": ref, "relu": ref.relu(), "silu": F.silu(ref)}[activation]


def test_the_rule_takes_few_rows_of_unaligned_channels():
    assert gemm_1x1.takes_few_rows(32, 348, 3712, 2)  # the SE block's 1x1 on a one-pixel image, batch 32
    assert gemm_1x1.takes_few_rows(32, 888, 84, 2)  # output channels unaligned
    assert gemm_1x1.takes_few_rows(98, 57, 113, 4)
    assert not gemm_1x1.takes_few_rows(32, 64, 1536, 2)  # aligned: matmul's choice
    assert not gemm_1x1.takes_few_rows(16, 348, 3712, 2)  # 16 rows: matmul's own misaligned rules, no padding
    assert not gemm_1x1.takes_few_rows(25088, 58, 58, 2)  # many rows: matmul (its aligned twin where that pays)
    assert not gemm_1x1.takes_few_rows(32, 12, 288, 4)  # fp32 rows of 12 are 16-byte aligned


def test_the_config_fills_a_wave_in_one_launch():
    se = gemm_1x1.few_rows_config(32, 3712, 348, 2, 132)  # 58 tiles of 32x64, 6 K steps of 64
    assert (se["BLOCK_M"], se["BLOCK_N"], se["BLOCK_K"], se["SPLIT_K"]) == (32, 64, 64, 2)
    small = gemm_1x1.few_rows_config(32, 84, 888, 2, 132)  # 2 tiles over 14 K steps: slices of 2 steps or more
    assert small["SPLIT_K"] == 4 and not small["APART"]
    fp32 = gemm_1x1.few_rows_config(100, 113, 57, 4, 132)
    assert (fp32["BLOCK_M"], fp32["BLOCK_K"], fp32["SPLIT_K"]) == (128, 32, 1)
    for M, N, K in ((128, 7392, 726), (32, 16, 7392), (64, 4000, 100)):
        cfg = gemm_1x1.few_rows_config(M, N, K, 2, 132)
        tiles = -(-M // cfg["BLOCK_M"]) * -(-N // cfg["BLOCK_N"])
        assert cfg["SPLIT_K"] == 1 or tiles * cfg["SPLIT_K"] <= 132
        assert cfg["SPLIT_K"] * cfg["BLOCK_M"] * cfg["BLOCK_N"] * 4 <= gemm_1x1.FEW_ROWS_MAX_PLANE_BYTES


# (N, C, H, K, dtype, activation): the SE block's layer as measured, and odd counts on a 7x7 image
LAYERS = [
    pytest.param(32, 348, 1, 3712, torch.float16, "none", id="se-348-3712-fp16"),
    pytest.param(2, 57, 7, 113, torch.float32, "silu", id="57-113-7x7-fp32"),
    pytest.param(2, 57, 7, 113, torch.float16, "relu", id="57-113-7x7-fp16"),
    pytest.param(24, 888, 1, 84, torch.float16, "relu", id="888-84-fp16"),
]


@pytest.mark.parametrize("N, C, H, K, dtype, activation, channels_last", [
    pytest.param(*layer.values, cl, id=f"{layer.id}-{'cl' if cl else 'nchw'}") for layer in LAYERS
    # a one-pixel image is both layouts (the same memory, the same launch): the SE layer's (the interpreter's
    # slowest) once; the 888-84 layer checks both
    for cl in (True, False) if cl or layer.id != "se-348-3712-fp16"])
def test_one_launch_matches_f_conv2d(N, C, H, K, dtype, activation, channels_last, device, monkeypatch):
    x, w, b = _layer(N, C, H, K, dtype, channels_last, device)
    seen = launches(monkeypatch)
    out = tilegemm.conv2d(x, w, b, activation=activation)
    assert len(seen) == 1, f"{len(seen)} launches: {[name for name, _ in seen]}"
    name, flags = seen[0]
    rows = N * H * H
    if channels_last or H == 1:  # [N*H*W, C] x [C, K]: the few-rows product, its config by the rule
        assert name == "matmul_split_k_kernel" and flags["HAS_BIAS"] and flags["ACTIVATION"] == activation
        want = gemm_1x1.few_rows_config(rows, K, C, x.element_size(), 4)  # (4 SMs under the interpreter)
        assert {k: flags[k] for k in want} == want
    else:  # NCHW over 49 pixels: the batched product out[n] = w @ x[n], the bias as c (no padding either way)
        assert flags["HAS_C"]
    assert out.is_contiguous(memory_format=CL if channels_last and H > 1 else torch.contiguous_format)
    assert_rel_close(out, _reference(x, w, b, activation), 4e-3 if dtype == torch.float16 else 1e-5)


def test_no_bias_and_a_wider_output_dtype(device, monkeypatch):
    """Without a bias, and through the op with an fp32 output of fp16 operands (the dtype the kernel stores)."""
    from tilegemm.ops.conv2d import dispatch
    from tilegemm.ops.conv2d.problem import ConvCall

    x, w, _ = _layer(20, 44, 1, 90, torch.float16, True, device, bias=False)
    seen = launches(monkeypatch)
    out = tilegemm.conv2d(x, w)
    assert len(seen) == 1 and not seen[0][1]["HAS_BIAS"]
    assert_rel_close(out, _reference(x, w, None, "none"), 4e-3)
    wide = dispatch.forward(ConvCall(x, w, None, [1, 1], [0, 0, 0, 0], [1, 1], 1, "none", "default", "auto",
                                     torch.float32))
    assert wide.dtype == torch.float32 and len(seen) == 2
    assert_rel_close(wide, _reference(x, w, None, "none"), 4e-3)


def test_a_given_output_is_written_in_place(device):
    """``ConvProblem.out`` (a route's channels-last workspace): the product lands there, no copy after it."""
    from tilegemm.ops.conv2d.problem import ConvProblem, Geometry

    x, w, b = _layer(3, 30, 5, 50, torch.float32, True, device)
    g = Geometry(3, 30, 5, 5, 50, 1, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1))
    into = torch.full((3, 50, 5, 5), float("nan"), device=device).contiguous(memory_format=CL)
    out = gemm_1x1.run(ConvProblem(x, w, b, g, torch.float32, CL, "relu", "ieee", False, into))
    assert out.data_ptr() == into.data_ptr()
    assert_rel_close(into, _reference(x, w, b, "relu"), 1e-5)


# --- on a GPU: the call is kept, and replays as one launch -----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("channels_last", [True, False], ids=["cl", "nchw"])
@pytest.mark.parametrize("N, C, H, K", [(32, 348, 1, 3712), (32, 888, 1, 84), (2, 57, 7, 113)],
                         ids=["se-348-3712", "888-84", "57-113-7x7"])
def test_gpu_replays_are_one_launch(N, C, H, K, channels_last, monkeypatch):
    from tilegemm.core.launch import Replay
    from tilegemm.core.replay import cache
    from tilegemm.ops.conv2d import checks, dispatch

    replays = cache("conv2d")
    replays.clear()
    full = []
    real = dispatch.forward
    monkeypatch.setattr(dispatch, "forward", lambda c: full.append(c) or real(c))
    _, w, b = _layer(N, C, H, K, torch.float16, channels_last, "cuda")
    outs = []
    with torch.no_grad():
        for _ in range(3):  # the first call records, the later ones replay with new inputs
            x = _layer(N, C, H, K, torch.float16, channels_last, "cuda")[0]
            out = tilegemm.conv2d(x, w, b, activation="relu")
            assert_rel_close(out, _reference(x, w, b, "relu"), 4e-3)
            outs.append(out)
    assert len(full) == 1, "the later calls replayed"
    assert outs[1].data_ptr() != outs[2].data_ptr()
    key = checks.forward_key(x, w, b, 1, 0, 1, 1, "relu", None, "auto")
    assert isinstance(replays.get(key), Replay), "kept as one launch"
