"""What the W4A16 tests share: the GPU checks the fragment kernel gets, its offline sm_90 compiles (no GPU needed),
and the fuzz's drawn calls and check. The oracle is :func:`tilegemm.ops.w4a16.reference.reference`."""

from __future__ import annotations

import math
import textwrap
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st
from conftest import SM90, assert_rel_close, compile_offline

from tilegemm import w4a16
from tilegemm.ops.w4a16.format import fits_fragments
from tilegemm.ops.w4a16.reference import reference


def check_fragment_kernel(kernel: str, dtype, N: int, K: int, group: int, M: int) -> None:
    """``kernel`` (one that reads the fragment layout) against the reference, plain and with bias + SiLU; a
    weight whose group length it does not take is refused with a ValueError naming it."""
    w = w4a16.quantize(torch.randn(N, K, dtype=dtype, device="cuda"), group)
    x = torch.randn(M, K, dtype=dtype, device="cuda")
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    if not fits_fragments(w.group_k, K):
        with pytest.raises(ValueError, match="multiple"):
            w4a16.matmul(x, w, kernel=kernel)
        return
    bias = torch.randn(N, dtype=dtype, device="cuda")
    assert_rel_close(w4a16.matmul(x, w, kernel=kernel), reference(x, w), tol)
    assert_rel_close(w4a16.matmul(x, w, bias=bias, activation="silu", kernel=kernel),
                     reference(x, w, bias, "silu"), tol)


def act_order_weight(N: int, K: int, group: int, dtype=torch.float16, device="cpu", seed: int = 0):
    """A weight whose stored inputs are x's in a random order (``perm``, as from_gptq makes of an act-order
    checkpoint); any group length, all of K (-1) included."""
    g = torch.Generator().manual_seed(seed)
    w = w4a16.quantize(torch.randn(N, K, generator=g).to(dtype).to(device), group)
    return w4a16.Int4Weight(w.qweight, w.scales, w.zeros, group, w.shape, torch.randperm(K, generator=g).to(device))


def check_launch_twice(module, cfg: dict, M: int, K: int = 2048, group: int = 128) -> None:
    """``module.launch_args`` with ``cfg`` on a 520 x ``K`` weight in groups of ``group``, launched twice into a
    NaN-filled output: right both times (the split-K counters were reset by the last arrival); bf16 too."""
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1e-2)):
        w = w4a16.quantize(torch.randn(520, K, dtype=dtype, device="cuda"), group)
        x = torch.randn(M, K, dtype=dtype, device="cuda")
        out = torch.full((M, 520), float("nan"), dtype=dtype, device="cuda")
        fw, fzs = w.fragments()
        kernel, grid, args, kwargs = module.launch_args(x, fw, fzs, None, out, 520, K, w.group_k, "none", cfg)
        kernel[grid](*args, **kwargs)
        assert_rel_close(out, reference(x, w), tol)
        kernel[grid](*args, **kwargs)
        assert_rel_close(out, reference(x, w), tol)

_ONE_PTXAS = (Path(__file__).parents[1] / "grouped" / "_sm90_one_ptxas.py").read_text()  # compile_sm90, ptxas once
_SCRIPT = SM90 + _ONE_PTXAS + textwrap.dedent(
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
        group = v.get("group", 128)
        fzs = torch.empty(-(-fw.shape[1] * 64 // group), fw.shape[0], 8, 4, dtype=dt)
        out = torch.empty(M, N, dtype=dt)
        bias = torch.empty(N, dtype=dt) if v["bias"] else None
        perm = v.get("act_order")  # frag_wgmma's GATHER: the index dtype's name
        extra = (torch.empty(K, dtype=getattr(torch, perm)),) if perm else ()
        kernel, grid, args, kwargs = module.launch_args(x, fw, fzs, bias, out, N, K, group, v["act"], v["cfg"],
                                                        *extra)
        sig, constexprs, attrs = launch_signature(kernel, args, kwargs)
        compiled, ptx, info = compile_sm90(kernel, sig, constexprs, attrs, kwargs["num_warps"])
        report[name] = dict(
            mma_sync=len(re.findall(r"mma\\.sync\\.aligned\\.m16n8k16", ptx)),
            wgmma=len(re.findall(r"wgmma\\.mma_async", ptx)),
            waits=re.findall(r"wgmma\\.wait_group\\.sync\\.aligned\\s+(\\d+)", ptx),
            lop3=len(re.findall(r"lop3\\.b32", ptx)),
            wide_loads=len(re.findall(r"ld\\.global(?:\\.[a-z0-9]+)*\\.v4\\.b32", ptx)),
            cp_async=len(re.findall(r"cp\\.async\\.c[ag]\\.shared\\.global \\[[^]]+\\], \\[[^]]+\\], 0x10", ptx)),
            shared=compiled.metadata.shared,
            group32=bool(kwargs.get("GROUP32")),
            gather=bool(kwargs.get("GATHER")),
            scalar_loads=len(re.findall(r"ld\\.global(?:\\.[a-z0-9]+)*\\.b16", ptx)),
            registers=[int(n) for n in re.findall(r"Used (\\d+) registers", info)],
            serialized="serialized" in info,
            spills=[int(n) for n in re.findall(r"(\\d+) bytes spill stores", info)],
        )
    print(json.dumps(report))
    """
)


def compile_report(tmp_path, module: str, variants: dict) -> dict:
    """Per variant (dtype, mnk, bias, act, cfg, group: 128 unless given; act_order: "int32" or "int64", a perm of that
    dtype: frag_wgmma's GATHER), what the sm_90 compile of ``module``'s kernel holds: MMA and LOP3 counts, 16-byte loads and cp.async
    copies, 2-byte loads, shared memory, registers, serialized wgmma, spills."""
    return compile_offline(tmp_path, _SCRIPT, {k: dict(v, module=module) for k, v in variants.items()}, timeout=600)


@st.composite
def fuzz_calls(draw, dtypes=(torch.float16, torch.bfloat16), max_m: int = 2048, max_n: int = 12000,
               max_k: int = 8192):
    """A drawn W4A16 call: M (log-uniform up to ``max_m``), N, K, group size, dtype, symmetry, act-order, epilogue,
    and how x lies (leading dims, rows ``pad`` elements apart, storage ``offset`` elements in on the third call)."""
    group = draw(st.sampled_from([32, 64, 128, 128, 256, -1]))
    unit = 8 if group == -1 else group
    K = unit * draw(st.integers(1, max(1, max_k // unit)))
    N = draw(st.sampled_from([draw(st.integers(1, max_n)), 8 * draw(st.integers(1, max(1, max_n // 8)))]))
    M = max(1, int(math.exp(draw(st.floats(0.0, math.log(max_m))))))
    return dict(M=M, N=N, K=K, group=group, dtype=draw(st.sampled_from(dtypes)),
                symmetric=draw(st.booleans()), bias=draw(st.booleans()),
                activation=draw(st.sampled_from(["none", "none", "silu", "relu"])),
                lead=draw(st.sampled_from([(), (), (2,)])), pad=draw(st.sampled_from([0, 0, 8, 3])),
                offset=draw(st.sampled_from([1, 3])), act_order=draw(st.integers(0, 3)) == 0)


def run_fuzz_call(c: dict, device: str) -> None:
    """Call ``c`` through ``auto`` three times (recorded, replayed, then from x at another offset), each against
    ``x @ dequantize(w).T`` in float64: relative to the output's norm, or where a sum cancels (a handful of
    outputs, N = 1) to half the norm its terms' magnitudes give (``|x| @ |W|.T / sqrt(K)``): the kernels that do
    not round each weight to 16 bits as ``dequantize`` does (``gemv``) differ by that rounding, which
    cancellation magnifies in one output."""
    torch.manual_seed(zlib.crc32(repr(sorted(c.items())).encode()))  # the same values each time it is drawn
    dtype, M, N, K = c["dtype"], c["M"], c["N"], c["K"]
    w = w4a16.quantize(torch.randn(N, K, device=device, dtype=dtype), c["group"], symmetric=c["symmetric"])
    if c.get("act_order"):  # GPTQ act-order: the stored inputs are x's in a random order (x gathered by perm)
        w = w4a16.Int4Weight(w.qweight, w.scales, w.zeros, w.group_size, w.shape, torch.randperm(K, device=device))
    bias = torch.randn(N, device=device, dtype=dtype) if c["bias"] else None
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    rows = math.prod(c["lead"]) * M
    for call, offset in enumerate((0, 0, c["offset"])):
        buf = torch.randn(offset + rows * (K + c["pad"]), device=device, dtype=dtype)
        x = buf[offset:].view(rows, K + c["pad"])[:, :K].reshape(*c["lead"], M, K)
        out = w4a16.matmul(x, w, bias=bias, activation=c["activation"])
        ref = reference(x.reshape(rows, K), w, bias, c["activation"]).reshape(*c["lead"], M, N)
        assert out.dtype == dtype, f"call {call} of {c}: output dtype {out.dtype}"
        assert not torch.isnan(out).any(), f"call {call} of {c}: NaN (an element never written)"
        x2 = x.reshape(rows, K).double()
        terms = (x2.abs() @ w4a16.dequantize(w).double().abs().T).norm().item() / math.sqrt(K)
        err = (out.double() - ref).norm().item() / max(ref.norm().item(), 0.5 * terms, 1e-30)
        assert err <= tol, f"call {call} of {c}: relative error {err:.2e} > {tol:.1e}"
    if device == "cuda":
        torch.cuda.synchronize()
