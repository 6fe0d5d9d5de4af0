"""What the W4A16 tests share: the float64 reference, the GPU checks both fragment kernels get, and their
offline sm_90 compiles (no GPU needed)."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F
from conftest import SM90, assert_rel_close, compile_offline

from tilegemm import w4a16
from tilegemm.ops.w4a16.format import fits_fragments


def reference(x, w, bias=None, activation="none"):
    """``activation(x @ dequantize(w).T + bias)`` in float64."""
    y = x.double() @ w4a16.dequantize(w).double().T
    if bias is not None:
        y = y + bias.double()
    return {"none": lambda t: t, "silu": F.silu, "relu": F.relu, "gelu": F.gelu}[activation](y)


def check_fragment_kernel(kernel: str, dtype, N: int, K: int, group: int, M: int) -> None:
    """``kernel`` (one that reads the fragment layout) against the reference, plain and with bias + SiLU; a
    weight whose group length is no multiple of 64 is refused with a ValueError naming it."""
    w = w4a16.quantize(torch.randn(N, K, dtype=dtype, device="cuda"), group)
    x = torch.randn(M, K, dtype=dtype, device="cuda")
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    if not fits_fragments(w.group_k):
        with pytest.raises(ValueError, match="multiple"):
            w4a16.matmul(x, w, kernel=kernel)
        return
    bias = torch.randn(N, dtype=dtype, device="cuda")
    assert_rel_close(w4a16.matmul(x, w, kernel=kernel), reference(x, w), tol)
    assert_rel_close(w4a16.matmul(x, w, bias=bias, activation="silu", kernel=kernel),
                     reference(x, w, bias, "silu"), tol)


def check_launch_twice(module, cfg: dict, M: int) -> None:
    """``module.launch_args`` with ``cfg`` on a 520 x 2048 g128 weight, launched twice into a NaN-filled
    output: right both times (the split-K counters were reset by the last arrival)."""
    w = w4a16.quantize(torch.randn(520, 2048, dtype=torch.float16, device="cuda"), 128)
    x = torch.randn(M, 2048, dtype=torch.float16, device="cuda")
    out = torch.full((M, 520), float("nan"), dtype=torch.float16, device="cuda")
    fw, fzs = w.fragments()
    kernel, grid, args, kwargs = module.launch_args(x, fw, fzs, None, out, 520, 2048, 128, "none", cfg)
    kernel[grid](*args, **kwargs)
    assert_rel_close(out, reference(x, w), 2e-3)
    kernel[grid](*args, **kwargs)
    assert_rel_close(out, reference(x, w), 2e-3)

_SCRIPT = SM90 + textwrap.dedent(
    """
    import importlib, json, re, sys
    import torch

    report = {}
    for name, v in json.loads(sys.argv[1]).items():
        module = importlib.import_module("tilegemm.ops.w4a16." + v["module"])
        dt = getattr(torch, v["dtype"])
        M, N, K = v["mnk"]
        x = torch.empty(M, K, dtype=dt)
        fw = torch.empty(-(-N // 256) * 16, -(-K // 128) * 2, 32, 4, dtype=torch.int32)
        fzs = torch.empty(8, fw.shape[0], 8, 4, dtype=dt)
        out = torch.empty(M, N, dtype=dt)
        bias = torch.empty(N, dtype=dt) if v["bias"] else None
        kernel, grid, args, kwargs = module.launch_args(x, fw, fzs, bias, out, N, K, 128, v["act"], v["cfg"])
        sig, constexprs, attrs = launch_signature(kernel, args, kwargs)
        compiled, ptx, info = compile_sm90(kernel, sig, constexprs, attrs, kwargs["num_warps"])
        report[name] = dict(
            mma_sync=len(re.findall(r"mma\\.sync\\.aligned\\.m16n8k16", ptx)),
            wgmma=len(re.findall(r"wgmma\\.mma_async", ptx)),
            lop3=len(re.findall(r"lop3\\.b32", ptx)),
            wide_loads=len(re.findall(r"ld\\.global(?:\\.[a-z0-9]+)*\\.v4\\.b32", ptx)),
            cp_async=len(re.findall(r"cp\\.async\\.c[ag]\\.shared\\.global \\[[^]]+\\], \\[[^]]+\\], 0x10", ptx)),
            shared=compiled.metadata.shared,
            serialized="serialized" in info,
            spills=[int(n) for n in re.findall(r"(\\d+) bytes spill stores", info)],
        )
    print(json.dumps(report))
    """
)


def compile_report(tmp_path, module: str, variants: dict) -> dict:
    """Per variant (dtype, mnk, bias, act, cfg), what the sm_90 compile of ``module``'s kernel holds: MMA and
    LOP3 counts, 16-byte loads and cp.async copies, shared memory, serialized wgmma, spills."""
    return compile_offline(tmp_path, _SCRIPT, {k: dict(v, module=module) for k, v in variants.items()}, timeout=600)
