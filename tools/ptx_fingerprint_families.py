"""Fingerprints of the sm_90 code of the shipped w4a16, conv2d and grouped kernels, compiled without a GPU.

The companion of ``tools/ptx_fingerprint.py`` (matmul and the guide), on the same machinery: launches are built
by the families' own host code over CPU tensors (``kernel[grid](...)`` captured instead of run; the SM count
taken as an H200's), specialized as Triton's launcher does on a GPU, compiled for sm_90 and their PTX stripped of
line info and comments, then hashed:

    {"<kernel>/<problem>/<constexprs>": "<12 hex digits>", ...}

Keys name kernels and problems by logical names, never modules, so they match across a refactor that moves
modules. Equal hashes at two commits mean the GPU runs the same instructions.

    PYTHONPATH=src python tools/ptx_fingerprint_families.py --out after.json [--jobs 2] [--filter grouped]
    python tools/ptx_fingerprint.py --compare before.json after.json     # exit 1 on any difference

``--filter`` with a family's name (``w4a16``, ``conv2d``, ``grouped``) keeps that family's launches and builds only
the families named; any other string keeps the keys that contain it. The grouped family's host code asks for an
sm_90 GPU before its TMA and Gluon kernels: while its launches are built, ``compute_capability`` answers (9, 0).
Kernel ``frag`` (whose ``run`` refuses CPU tensors) and ``gluon`` are built from their own ``frag_config`` /
``config`` and ``launch_args``; ``dequant_grouped`` by its dequantizing pass, its product being the 16-bit forward's
on a transposed ``[E, N, K]`` weight (the ``-nk`` cases).

After modules move, only the two tables below (:data:`KERNELS`, :data:`HOST`) need editing; an entry may list
alternatives separated by ``|`` (the first that resolves wins), so one copy of this tool runs at both commits.
"""

from __future__ import annotations

# ======================================================================================================
# THE ONLY PLACE THAT NAMES TILEGEMM MODULES.
# ======================================================================================================

KERNELS = {
    "w4a16_gemv": "tilegemm.ops.w4a16.gemv:w4a16_gemv_kernel",
    "w4a16_mma": "tilegemm.ops.w4a16.mma:w4a16_mma_kernel",
    "w4a16_frag_wgmma": "tilegemm.ops.w4a16.frag_wgmma:frag_wgmma_kernel",
    "w4a16_dequant": "tilegemm.ops.w4a16.dequant_cublas:w4a16_dequant_kernel",
    "conv2d_fwd": "tilegemm.ops.conv2d.implicit_gemm:conv2d_fwd_kernel",
    "conv2d_stem": "tilegemm.ops.conv2d.implicit_gemm:conv2d_stem_kernel",
    "conv2d_dgrad": "tilegemm.ops.conv2d.implicit_gemm:conv2d_dgrad_kernel",
    "conv2d_wgrad": "tilegemm.ops.conv2d.implicit_gemm:conv2d_wgrad_kernel",
    "depthwise_fwd": "tilegemm.ops.conv2d.depthwise:depthwise_fwd_kernel",
    "depthwise_weight": "tilegemm.ops.conv2d.depthwise:depthwise_weight_kernel",
    "depthwise_rows": "tilegemm.ops.conv2d.depthwise:depthwise_rows_kernel",
    "depthwise_dgrad": "tilegemm.ops.conv2d.depthwise:depthwise_dgrad_kernel",
    "depthwise_wgrad": "tilegemm.ops.conv2d.depthwise:depthwise_wgrad_kernel",
    "conv2d_fwd_tma": "tilegemm.ops.conv2d.tma_fwd:conv2d_fwd_tma_kernel",
    "stem_input": "tilegemm.ops.conv2d.tma_fwd:stem_input_kernel",
    "stem_weight": "tilegemm.ops.conv2d.tma_fwd:stem_weight_kernel",
    "phase_weight": "tilegemm.ops.conv2d.tma_fwd:phase_weight_kernel",
    "conv2d_wgrad_tma": "tilegemm.ops.conv2d.tma_wgrad:conv2d_wgrad_tma_kernel",
    "subsample": "tilegemm.ops.conv2d.gemm_1x1:subsample_kernel",
    "spread": "tilegemm.ops.conv2d.gemm_1x1:spread_kernel",
    "transpose": "tilegemm.ops.conv2d.layout:transpose_kernel",
    "depthwise_strided_rows": "tilegemm.ops.conv2d.depthwise:depthwise_strided_rows_kernel",
    "depthwise_strided_tile": "tilegemm.ops.conv2d.depthwise:depthwise_strided_tile_kernel",
    "depthwise_window": "tilegemm.ops.conv2d.depthwise:depthwise_window_kernel",
    "depthwise_wgrad_taps": "tilegemm.ops.conv2d.depthwise:depthwise_wgrad_taps_kernel",
    "depthwise_wgrad_walk": "tilegemm.ops.conv2d.depthwise:depthwise_wgrad_walk_kernel",
    "grouped_direct_fwd": "tilegemm.ops.conv2d.grouped_direct:grouped_direct_fwd_kernel",
    "grouped_direct_dgrad": "tilegemm.ops.conv2d.grouped_direct:grouped_direct_dgrad_kernel",
    "grouped_direct_wgrad": "tilegemm.ops.conv2d.grouped_direct:grouped_direct_wgrad_kernel",
    # the grouped (MoE) family; the routing kernels are made by a function (``name()[i]``: its result's item i)
    "grouped_tiled": "tilegemm.ops.grouped.tiled:grouped_tiled_kernel",
    "grouped_tma": "tilegemm.ops.grouped.tma:grouped_tma_kernel",
    "grouped_tma_k": "tilegemm.ops.grouped.tma_k:grouped_tma_k_kernel",
    "grouped_plan": "tilegemm.ops.grouped.gluon:plan_kernel",
    "grouped_gluon": "tilegemm.ops.grouped.gluon:grouped_gluon_kernel",
    "grouped_w4a16": "tilegemm.ops.grouped.int4:grouped_w4a16_kernel",
    "grouped_frag": "tilegemm.ops.grouped.frag:grouped_frag_kernel",
    "grouped_dequant": "tilegemm.ops.grouped.dequant:dequant_experts_kernel",
    "grouped_route": "tilegemm.ops.grouped.routing:kernels()[0]",
    "grouped_combine": "tilegemm.ops.grouped.routing:kernels()[1]",
    "grouped_columns": "tilegemm.ops.grouped.routing:kernels()[2]",
}

HOST = {
    "sm_count": "tilegemm.core.hardware:sm_count",
    "W4A16Problem": "tilegemm.ops.w4a16.problem:W4A16Problem|tilegemm.ops.w4a16.common:W4A16Problem",
    "gemv.run": "tilegemm.ops.w4a16.gemv:run",
    "mma.run": "tilegemm.ops.w4a16.mma:run",
    "frag_wgmma.run": "tilegemm.ops.w4a16.frag_wgmma:run",
    "dequantize_w": "tilegemm.ops.w4a16.dequant_cublas:dequantize_w",
    "ConvProblem": "tilegemm.ops.conv2d.problem:ConvProblem",
    "Geometry": "tilegemm.ops.conv2d.problem:Geometry",
    "implicit_gemm": "tilegemm.ops.conv2d.implicit_gemm",
    "depthwise": "tilegemm.ops.conv2d.depthwise",
    "tma_fwd": "tilegemm.ops.conv2d.tma_fwd",
    "tma_wgrad": "tilegemm.ops.conv2d.tma_wgrad",
    "grouped_direct": "tilegemm.ops.conv2d.grouped_direct",
    "conv_configs": "tilegemm.ops.conv2d.configs",
    "gemm_1x1": "tilegemm.ops.conv2d.gemm_1x1",
    "layout": "tilegemm.ops.conv2d.layout",
    "compute_capability": "tilegemm.core.hardware:compute_capability",
    "make_problem": "tilegemm.ops.grouped.problem:make_problem",
    "GroupedInt4Problem": "tilegemm.ops.grouped.problem:GroupedInt4Problem",
    "grouped_tiled": "tilegemm.ops.grouped.tiled",  # run(p)
    "grouped_tma": "tilegemm.ops.grouped.tma",  # run(p)
    "grouped_tma_k": "tilegemm.ops.grouped.tma_k",  # run(p)
    "grouped_gluon": "tilegemm.ops.grouped.gluon",  # why_not(p), config(p), plan(p, block_m), launch_args(...)
    "grouped_int4": "tilegemm.ops.grouped.int4",  # run(p)
    "grouped_frag": "tilegemm.ops.grouped.frag",  # frag_config(p, rows), launch_args(...)
    "grouped_dequant": "tilegemm.ops.grouped.dequant",  # dequantize_experts(p, w, n_lo, columns)
    "grouped_routing": "tilegemm.ops.grouped.routing",  # route, combine, columns (the ops' forwards)
}

# ======================================================================================================

import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ptx_fingerprint as pf  # noqa: E402  (sets TRITON_INTERPRET=0 before triton is imported)

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

NUM_SMS = pf.NUM_SMS
ACTS = ("none",) + pf.ACTIVATIONS


_plain_resolve = pf.resolve


def _resolve_one(target: str):
    """ptx_fingerprint's resolver, and ``module:fn()[i]``: item i of what ``fn()`` returns (kernels a function
    makes, as the routing module's)."""
    m = re.fullmatch(r"(.+)\(\)\[(\d+)\]", target)
    if m is None:
        return _plain_resolve(target)
    return _plain_resolve(m.group(1))()[int(m.group(2))]


def resolve(target: str):
    errors = []
    for alt in target.split("|"):
        try:
            return _resolve_one(alt)
        except (ImportError, AttributeError) as e:
            errors.append(f"{alt}: {e}")
    raise ImportError("; ".join(errors))


def host(name: str):
    return resolve(HOST[name])


_sm_count = None  # tilegemm's own sm_count, before _setup swaps it


def _setup() -> None:
    """The tables into ptx_fingerprint's resolver; the SM count of an H200 wherever tilegemm bound it."""
    global _sm_count
    _init()
    pf._install_capture()
    sm_count = _sm_count = host("sm_count")

    def h200(device=None) -> int:
        return NUM_SMS

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("tilegemm") and getattr(module, "sm_count", None) is sm_count:
            module.sm_count = h200
    sys.modules["tilegemm.core.hardware"].sm_count = h200


def _kw_text(kw: dict) -> str:
    return ",".join(f"{k}={kw[k]}" for k in sorted(kw))


def _launch(kernel, args, kwargs, problem: str, origin: str) -> pf.Launch:
    return pf.Launch(pf.kernel_name(kernel), problem, tuple(args), dict(kwargs), origin)


def captured(fn, problem: str, origin: str) -> list:
    return pf.captured(fn, problem, origin)


# --- w4a16 -------------------------------------------------------------------------------------------------

W4_SHAPES = ((4096, 4096), (28672, 8192), (4096 + 8, 4096 + 64))
W4_MS = (1, 2, 4, 16, 32, 64, 128, 256, 1024)
# group 32 (frag_wgmma's two-groups-a-step form) and K that is no multiple of 64 (group 32 over an odd number of
# groups, one group of all K): (N, K, group lengths)
W4_GROUP32_SHAPES = ((5120, 5120, (32,)), (4096 + 8, 4096 + 32, (32, 4096 + 32)), (1000, 200, (200,)))


def w4a16_problem(M, N, K, dtype, group_k, bias: bool, act: str, frag: bool):
    import torch

    x = torch.empty(M, K, dtype=dtype)
    qweight = torch.empty(K // 8, N, dtype=torch.int32)
    G = -(-K // group_k)
    scales = torch.empty(G, N, dtype=dtype)
    zeros = torch.empty(G, N, dtype=dtype)
    fw = fzs = None
    if frag:  # the shapes pack_fragments makes
        n16, k64 = -(-N // 256) * 16, -(-K // 128) * 2
        fw = torch.empty(n16, k64, 32, 4, dtype=torch.int32)
        fzs = torch.empty(-(-(k64 * 64) // group_k), n16, 8, 4, dtype=dtype)
    out = torch.empty(M, N, dtype=dtype)
    b = torch.empty(N, dtype=dtype) if bias else None
    P = host("W4A16Problem")
    return P(x=x, qweight=qweight, scales=scales, zeros=zeros, bias=b, out=out, group_k=group_k, activation=act,
             upcast=False, fweight=fw, fzs=fzs)


def w4a16_launches() -> list:
    import torch

    out = []
    for dt in (torch.float16, torch.bfloat16):
        dn = pf.SHORT[str(dt).split(".")[1]]
        for N, K in W4_SHAPES:
            for M in W4_MS:
                for gk in (128, K) if N == 4096 else (128,):
                    name = f"{dn}-M{M}-N{N}-K{K}-g{gk}"
                    for kernel in ("gemv", "mma", "frag_wgmma"):
                        p = w4a16_problem(M, N, K, dt, gk, False, "none", kernel == "frag_wgmma")
                        out += captured(lambda: host(f"{kernel}.run")(p), name, kernel)
        for N, K, groups in W4_GROUP32_SHAPES:
            for M in W4_MS:
                for gk in groups:
                    name = f"{dn}-M{M}-N{N}-K{K}-g{gk}"
                    for kernel in ("gemv", "mma", "frag_wgmma"):
                        p = w4a16_problem(M, N, K, dt, gk, False, "none", kernel == "frag_wgmma")
                        out += captured(lambda: host(f"{kernel}.run")(p), name, kernel)
        # epilogues: bias and each activation, on one shape and a few M
        for act in ACTS:
            for M in (1, 16, 256):
                name = f"{dn}-M{M}-N4096-K4096-g128+bias+{act}"
                for kernel in ("gemv", "mma", "frag_wgmma"):
                    p = w4a16_problem(M, 4096, 4096, dt, 128, True, act, kernel == "frag_wgmma")
                    out += captured(lambda: host(f"{kernel}.run")(p), name, kernel)
        for N, K in W4_SHAPES[:2]:
            for gk in (128, K):
                qw = torch.empty(K // 8, N, dtype=torch.int32)
                s = torch.empty(-(-K // gk), N, dtype=dt)
                out += captured(lambda: host("dequantize_w")(qw, s, s, gk), f"{dn}-N{N}-K{K}-g{gk}", "dequantize_w")
    return out


# --- conv2d ------------------------------------------------------------------------------------------------

# (N, C, H, W, K, R, S, stride, pad, dilation, groups): ResNet-50's and MobileNetV2's layer classes, a stem,
# odd sizes.
CONV_CASES = (
    (32, 3, 224, 224, 64, 7, 7, 2, 3, 1, 1),
    (32, 64, 56, 56, 64, 3, 3, 1, 1, 1, 1),
    (32, 128, 56, 56, 128, 3, 3, 2, 1, 1, 1),
    (32, 256, 28, 28, 256, 3, 3, 1, 1, 1, 1),
    (32, 512, 7, 7, 512, 3, 3, 1, 1, 1, 1),
    (32, 64, 56, 56, 256, 1, 1, 1, 0, 1, 1),
    (32, 256, 56, 56, 512, 1, 1, 2, 0, 1, 1),
    (32, 1024, 14, 14, 2048, 1, 1, 2, 0, 1, 1),
    (64, 32, 112, 112, 32, 3, 3, 1, 1, 1, 32),
    (64, 144, 56, 56, 144, 3, 3, 2, 1, 1, 144),
    (64, 960, 7, 7, 960, 3, 3, 1, 1, 1, 960),
    (8, 48, 17, 19, 40, 5, 5, 1, 2, 2, 1),
    (32, 64, 56, 56, 64, 3, 3, 1, 1, 1, 16),  # 4 channels a group: grouped_direct
    (32, 104, 56, 56, 104, 3, 3, 2, 1, 1, 13),  # 8 a group, strided
    (8, 64, 16, 16, 64, 3, 3, 1, 1, 1, 4),
    (4, 20, 15, 13, 24, 3, 3, 1, 1, 1, 1),
)


def _geo(case):
    N, C, H, W, K, R, S, st, pad, dil, groups = case
    G = host("Geometry")
    return G(N, C, H, W, K, R, S, groups, (st, st), (pad, pad, pad, pad), (dil, dil))


def _t(shape, dtype, cl: bool):
    import torch

    t = torch.empty(shape, dtype=dtype)
    return t.contiguous(memory_format=torch.channels_last) if cl and len(shape) == 4 else t


def conv_problem(case, dtype, cl: bool, bias: bool, act: str, precision: str = "ieee"):
    import torch

    g = _geo(case)
    x = _t((g.N, g.C, g.H, g.W), dtype, cl)
    w = _t((g.K, g.Cg, g.R, g.S), dtype, cl)
    b = torch.empty(g.K, dtype=dtype) if bias else None
    fmt = torch.channels_last if cl else torch.contiguous_format
    return host("ConvProblem")(x, w, b, g, dtype, fmt, act, precision, False), g


def conv_launches() -> list:
    import torch

    ig, dw, tf, tw = host("implicit_gemm"), host("depthwise"), host("tma_fwd"), host("tma_wgrad")
    cfgs, g11, lay = host("conv_configs"), host("gemm_1x1"), host("layout")
    out = []
    modes = [(torch.float16, True, "ieee"), (torch.bfloat16, True, "ieee"), (torch.float32, True, "ieee"),
             (torch.float32, True, "tf32"), (torch.float16, False, "ieee")]
    for case in CONV_CASES:
        for dt, cl, prec in modes:
            p, g = conv_problem(case, dt, cl, False, "none", prec)
            name = f"{pf.SHORT[str(dt).split('.')[1]]}{'' if prec == 'ieee' else '+tf32'}-{'cl' if cl else 'nchw'}-" \
                   + "x".join(str(v) for v in case)
            fmt = p.out_format
            dy = _t((g.N, g.K, g.P, g.Q), dt, cl)
            if cfgs.takes_grouped_direct(g):  # few channels a group
                gd = host("grouped_direct")
                out += captured(lambda: gd.run(p), name, "grouped_direct.run")
                out += captured(lambda: gd.dgrad(dy, p.weight, (g.N, g.C, g.H, g.W), fmt, g), name,
                                "grouped_direct.dgrad")
                out += captured(lambda: gd.wgrad(dy, p.x, g, dt, fmt), name, "grouped_direct.wgrad")
                continue
            if g.is_depthwise:
                out += captured(lambda: dw.run(p), name, "depthwise.run")
                out += captured(lambda: dw.dgrad(dy, p.weight, (g.N, g.C, g.H, g.W), fmt, g), name, "depthwise.dgrad")
                out += captured(lambda: dw.wgrad(dy, p.x, g, dt), name, "depthwise.wgrad")
                # the all-taps kernel by its config (auto walks where the walking kernel takes the layer)
                out += captured(lambda: dw.wgrad(dy, p.x, g, dt, cfgs.depthwise_wgrad_taps_config(g, dt)), name,
                                "depthwise.wgrad taps")
            else:
                out += captured(lambda: ig.run(p), name, "implicit_gemm.run")
                out += captured(lambda: ig.dgrad(dy, p.weight, (g.N, g.C, g.H, g.W), fmt, g, prec, False), name,
                                "implicit_gemm.dgrad")
                out += captured(lambda: ig.wgrad(dy, p.x, g, prec, False, dt), name, "implicit_gemm.wgrad")
            if dt == torch.float32 or not cl or g.is_depthwise:
                continue
            # the TMA kernels (host code past their GPU checks)
            if g.C <= 8:
                res = []
                out += captured(lambda: res.append(tf.stem_operands(p.x, p.weight, g)), name, "stem_operands")
                xv, wv, _, _, gv = res[0]
                o = _t((g.N, g.K, g.P, g.Q), dt, True)
                k, _, a, kw = tf.launch_args(xv, wv, o, None, gv, "none", cfgs.tma_stem_config(gv, NUM_SMS))
                out.append(_launch(k, a, kw, name, "tma_stem"))
                continue
            if g.Cg % 16 == 0 and g.H % g.stride[0] == 0 and g.W % g.stride[1] == 0:
                o = _t((g.N, g.K, g.P, g.Q), dt, True)
                wcl = p.weight.contiguous(memory_format=torch.channels_last)
                k, _, a, kw = tf.launch_args(p.x, wcl, o, None, g, "none", cfgs.tma_forward_config(g, NUM_SMS))
                out.append(_launch(k, a, kw, name, "tma_fwd"))
                onchw = _t((g.N, g.K, g.P, g.Q), dt, False)
                k, _, a, kw = tf.launch_args(p.x, wcl, onchw, None, g, "none", cfgs.tma_forward_config(g, NUM_SMS))
                out.append(_launch(k, a, kw, name + "-nchw-out", "tma_fwd"))
            if g.Cg % 8 == 0 and g.Kg % 8 == 0 and g.H % g.stride[0] == 0 and g.W % g.stride[1] == 0:
                out += captured(lambda: tw.run(dy, p.x, g, dt, memory_format=torch.channels_last), name,
                                "tma_wgrad.run")
            if g.stride == (1, 1):
                ((_, _, gt, r0, s0),) = tf.dgrad_phases(g)
                if min(gt.padding) >= 0 and gt.Cg % 16 == 0:
                    out.append(_launch(tf.phase_weight_kernel, (p.weight, torch.empty(1, dtype=dt), g.C, g.Kg, g.Kg,
                                                                 g.Cg, g.S, r0, s0, 1, 1, *p.weight.stride()),
                                       dict(BLOCK_C=64, BLOCK_K=64, num_warps=4), name, "phase_weight"))
                    wt = _t((g.C, g.Kg, g.R, g.S), dt, True)
                    dx = _t((g.N, g.C, g.H, g.W), dt, True)
                    k, _, a, kw = tf.launch_args(dy, wt, dx, None, gt, "none", cfgs.tma_forward_config(gt, NUM_SMS))
                    out.append(_launch(k, a, kw, name, "dgrad_tma"))
            if g.is_strided_pointwise:
                out += captured(lambda: g11.subsampled(p.x, g), name, "subsampled")
    # epilogues: bias and each activation on the main kernels
    for act in ACTS:
        for dt in (torch.float16, torch.bfloat16):
            for case in (CONV_CASES[1], CONV_CASES[8]):
                p, g = conv_problem(case, dt, True, True, act)
                name = f"{pf.SHORT[str(dt).split('.')[1]]}-cl-" + "x".join(str(v) for v in case) + f"+bias+{act}"
                out += captured(lambda: (dw if g.is_depthwise else ig).run(p), name, "run")
                if not g.is_depthwise:
                    o = _t((g.N, g.K, g.P, g.Q), dt, True)
                    wcl = p.weight.contiguous(memory_format=torch.channels_last)
                    k, _, a, kw = tf.launch_args(p.x, wcl, o, p.bias, g, act, cfgs.tma_forward_config(g, NUM_SMS))
                    out.append(_launch(k, a, kw, name, "tma_fwd"))
    # the spread kernel of a strided 1x1 data gradient, the layout transposes
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        dn = pf.SHORT[str(dt).split('.')[1]]
        src, dst = torch.empty(1024, 64, dtype=dt), torch.empty(4096, 64, dtype=dt)
        for sh in (1, 2):
            out.append(_launch(g11.spread_kernel, (src, dst, 4096, 64, 16, 16, 8, 8), dict(SH=sh, SW=sh, BLOCK_R=64,
                               BLOCK_C=64, num_warps=4), f"{dn}-s{sh}", "spread"))
        t = torch.empty(8, 64, 28, 28, dtype=dt)
        out += captured(lambda: lay.to_channels_last(t, "fp"), f"{dn}-nchw", "to_channels_last")
        t2 = torch.empty(8, 64, 28, 28, dtype=dt).contiguous(memory_format=torch.channels_last)
        out += captured(lambda: lay.to_nchw(t2, torch.empty(8, 64, 28, 28, dtype=dt)), f"{dn}-cl", "to_nchw")
    return out

# --- grouped ---------------------------------------------------------------------------------------------------

# The MoE forward (2-D x 3-D): (rows M, experts E, N, K). Only M, E and the sizes reach a compile (offs is read on the
# device: which groups are empty changes no code), so the cases span rows an expert: decode with most experts empty
# (M < E), decode, the half-tile and whole-tile prefill, an odd N and K.
GROUPED_MOE = ((4, 64, 2048, 1024), (16, 8, 4096, 4096), (512, 8, 14336, 4096), (16384, 8, 4096, 14336),
               (300, 128, 768, 2048), (100, 6, 1000, 1032))
GROUPED_GATED = ((4, 64, 768, 2048), (512, 8, 14336, 4096), (16384, 8, 14336, 4096))  # (M, E, N of the output, K)
GROUPED_BATCHED = ((8, 512, 512, 512), (4, 1000, 1032, 520), (64, 16, 4096, 4096))  # 3-D x 3-D: (G, M, N, K)
GROUPED_WGRAD = ((4096, 14336, 16384, 8), (1024, 1000, 4096, 64), (4096, 4096, 512, 8))  # 2-D x 2-D: (M, N, K, G)
# 4-bit experts: (M, E, N, K, group lengths)
GROUPED_INT4 = ((1, 8, 14336, 4096, (128, 4096)), (8, 128, 768, 2048, (128, 32)), (64, 8, 4096, 14336, (128,)),
                (4096, 8, 14336, 4096, (128,)), (16384, 64, 1408, 2048, (128,)))


class _AsH200:
    """The GPU checks of tilegemm's host code answered as on an H200 (sm_90, 132 SMs) while the grouped launches are
    built: the grouped modules bind ``sm_count`` and ask ``why_not_tma``/``why_not_gluon``, which ask
    ``compute_capability``. Restored after, so the other families' launches are built as before."""

    def __enter__(self):
        hw = sys.modules[HOST["compute_capability"].partition(":")[0]]
        sm_count, cc = _sm_count, resolve(HOST["compute_capability"])
        self.saved = []
        for name in ("grouped_tiled", "grouped_tma", "grouped_tma_k", "grouped_gluon", "grouped_int4", "grouped_frag",
                     "grouped_dequant", "grouped_routing"):
            host(name)  # imported before the bindings are swapped
        answers = (("sm_count", sm_count, lambda device=None: NUM_SMS), ("compute_capability", cc, lambda: (9, 0)))
        for module in list(sys.modules.values()):
            if not getattr(module, "__name__", "").startswith("tilegemm"):
                continue
            for attr, old, new in answers:
                if getattr(module, attr, None) is old:
                    self.saved.append((module, attr, old))
                    setattr(module, attr, new)
        if not any(m is hw and a == "compute_capability" for m, a, _ in self.saved):
            raise RuntimeError("tilegemm.core.hardware has no compute_capability to answer as an H200's")
        return self

    def __exit__(self, *exc):
        for module, attr, old in self.saved:
            setattr(module, attr, old)


def _dn(dt) -> str:
    return pf.SHORT[str(dt).split(".")[1]]


def _offs(groups: int):
    import torch

    return torch.empty(groups, dtype=torch.int32)


def moe_problem(M, E, N, K, dt, b_nk: bool, bias: str = "", act: str = "none", gated: bool = False,
                precision: str = "ieee"):
    """A 2-D x 3-D problem over CPU tensors: b ``[E, K, N]`` row-major, or (b_nk) torch's expert layout ``[E, N, K]``
    transposed; bias "" (none), "n" (``[N]``) or "g" (``[E, N]``); gated: b and bias hold 2N columns."""
    import torch

    width = 2 * N if gated else N
    a = torch.empty(M, K, dtype=dt)
    b = torch.empty(E, width, K, dtype=dt).transpose(1, 2) if b_nk else torch.empty(E, K, width, dtype=dt)
    c = None if not bias else torch.empty(width, dtype=dt) if bias == "n" else torch.empty(E, width, dtype=dt)
    out = torch.empty(M, N, dtype=dt)
    return host("make_problem")("2d3d", E, a, b, _offs(E), c, out, precision, act, gated)


def moe_name(M, E, N, K, dt, b_nk, extra="", precision="ieee"):
    return f"{_dn(dt)}{'+tf32' if precision == 'tf32' else ''}-2d3d{'-nk' if b_nk else ''}-M{M}-E{E}-N{N}-K{K}{extra}"


def int4_problem(M, E, N, K, gk, dt, gated: bool, bias: str = "", act: str = "none", frag: bool = False):
    """4-bit experts over CPU tensors, as ``Int4Weight`` stacks them (qweight ``[E, K/8, rows]``, scales and zeros
    ``[E, G_k, rows]``, rows = 2N gated); frag: the stacked fragment layout's shapes (``pack_fragments``'s per
    expert, the gated rows padded to whole 16-row tiles each half)."""
    import torch

    rows = 2 * N if gated else N
    G = -(-K // gk)
    fw = fzs = None
    if frag:
        frows = 2 * (-(-N // 16) * 16) if gated else N
        n16, k64 = -(-frows // 256) * 16, -(-K // 128) * 2
        fgk = gk if gk < K else -(-K // 64) * 64
        fw = torch.empty(E, n16, k64, 32, 4, dtype=torch.int32)
        fzs = torch.empty(E, -(-(k64 * 64) // fgk), n16, 8, 4, dtype=dt)
    c = None if not bias else torch.empty(rows, dtype=dt) if bias == "n" else torch.empty(E, rows, dtype=dt)
    P = host("GroupedInt4Problem")
    return P(x=torch.empty(M, K, dtype=dt), qweight=torch.empty(E, K // 8, rows, dtype=torch.int32),
             scales=torch.empty(E, G, rows, dtype=dt), zeros=torch.empty(E, G, rows, dtype=dt), offs=_offs(E),
             bias=c, out=torch.empty(M, N, dtype=dt), groups=E, M=M, N=N, K=K, group_k=gk, activation=act,
             gated=gated, fweight=fw, fzs=fzs)


def _gluon(p, name: str, cfgs=None) -> list:
    """Kernel gluon's launches for ``p`` (its plan kernel, then the main kernel, from its own host code) with its own
    config, or each of ``cfgs``."""
    gl = host("grouped_gluon")
    if gl.why_not(p) is not None:
        return []
    out = []
    for cfg in cfgs or [gl.config(p)]:
        tables = []
        out += captured(lambda: tables.append(gl.plan(p, cfg["BLOCK_M"])), name, "gluon.plan")
        k, _, a, kw = gl.launch_args(p, dict(cfg), tables[0], NUM_SMS)
        out.append(_launch(k, a, kw, name, "gluon"))
    return out


def _frag(p, name: str) -> list:
    """Kernel frag's launch for ``p``, from its own config rule and launch_args (its run() asks for CUDA tensors)."""
    fr = host("grouped_frag")
    rows = 2 * (-(-p.N // 16) * 16) if p.gated else p.N
    cfg = fr.frag_config(p, rows)
    k, _, a, kw, _ws = fr.launch_args(p.x, p.fweight, p.fzs, p.bias, p.out, p.offs, p.N, p.K, p.group_k, p.activation,
                                      p.gated, cfg)
    return [_launch(k, a, kw, name, "frag")]


def grouped_launches() -> list:
    import torch

    with _AsH200():
        return _grouped_launches(torch)


def _grouped_launches(torch) -> list:
    tiled, tma, tma_k = host("grouped_tiled"), host("grouped_tma"), host("grouped_tma_k")
    int4, dq, rt = host("grouped_int4"), host("grouped_dequant"), host("grouped_routing")
    mk = host("make_problem")
    out = []
    halves = (torch.float16, torch.bfloat16)
    # the MoE forward: tiled, tma and gluon as each configures itself
    for dt in halves:
        for M, E, N, K in GROUPED_MOE:
            for b_nk in (False, True):
                p, name = moe_problem(M, E, N, K, dt, b_nk), moe_name(M, E, N, K, dt, b_nk)
                out += captured(lambda: tiled.run(p), name, "tiled.run")
                out += captured(lambda: tma.run(p), name, "tma.run")
                out += _gluon(p, name)
    # gluon's every candidate tile, on one prefill case
    gl = host("grouped_gluon")
    for dt in halves:
        M, E, N, K = GROUPED_MOE[3]
        p = moe_problem(M, E, N, K, dt, True)
        out += _gluon(p, moe_name(M, E, N, K, dt, True), gl.configs())
    # epilogues: bias ([N] and [E, N]) and each activation, at decode and prefill sizes
    for dt in halves:
        for M, E, N, K in (GROUPED_MOE[1], GROUPED_MOE[3]):
            for bias, act in [("n", "none"), ("g", "none")] + [("g", a) for a in pf.ACTIVATIONS]:
                p = moe_problem(M, E, N, K, dt, True, bias, act)
                name = moe_name(M, E, N, K, dt, True, f"+bias{bias}+{act}")
                out += captured(lambda: tiled.run(p), name, "tiled.run")
                out += captured(lambda: tma.run(p), name, "tma.run")
                out += _gluon(p, name)
    # fp32 operands (tiled only), IEEE and tf32
    for prec in ("ieee", "tf32"):
        for M, E, N, K in GROUPED_MOE[1:4]:
            p = moe_problem(M, E, N, K, torch.float32, True, precision=prec)
            out += captured(lambda: tiled.run(p), moe_name(M, E, N, K, torch.float32, True, precision=prec),
                            "tiled.run")
    # the gated gate/up product: tiled and tma (gluon refuses it)
    for dt in halves:
        for M, E, N, K in GROUPED_GATED:
            for b_nk in (False, True):
                for bias in ("", "g"):
                    p = moe_problem(M, E, N, K, dt, b_nk, bias, "silu", gated=True)
                    name = moe_name(M, E, N, K, dt, b_nk, f"+gated{'+bias' + bias if bias else ''}+silu")
                    out += captured(lambda: tiled.run(p), name, "tiled.run")
                    out += captured(lambda: tma.run(p), name, "tma.run")
    # 3-D x 3-D (batched) and 3-D x 2-D: tiled
    for dt in halves + (torch.float32,):
        for G, M, N, K in GROUPED_BATCHED:
            a, b = torch.empty(G, M, K, dtype=dt), torch.empty(G, K, N, dtype=dt)
            p = mk("3d3d", G, a, b, None, None, torch.empty(G, M, N, dtype=dt))
            out += captured(lambda: tiled.run(p), f"{_dn(dt)}-3d3d-G{G}-M{M}-N{N}-K{K}", "tiled.run")
            bt = torch.empty(G, N, K, dtype=dt).transpose(1, 2)
            p = mk("3d3d", G, a, bt, None, None, torch.empty(G, M, N, dtype=dt))
            out += captured(lambda: tiled.run(p), f"{_dn(dt)}-3d3d-nk-G{G}-M{M}-N{N}-K{K}", "tiled.run")
        G, M, N, K = GROUPED_BATCHED[2]
        a, b = torch.empty(G, M, K, dtype=dt), torch.empty(K, N, dtype=dt)
        p = mk("3d2d", G, a, b, _offs(G), None, torch.empty(M, N, dtype=dt))
        out += captured(lambda: tiled.run(p), f"{_dn(dt)}-3d2d-G{G}-M{M}-N{N}-K{K}", "tiled.run")
    # 2-D x 2-D (groups along K: the MoE weight gradient): tiled and tma_k, a M-contiguous as the backward has it
    for dt in halves:
        for M, N, K, G in GROUPED_WGRAD:
            for bias in (False, True):
                a, b = torch.empty(K, M, dtype=dt).T, torch.empty(K, N, dtype=dt)
                c = torch.empty(G, N, dtype=dt) if bias else None
                p = mk("2d2d", G, a, b, _offs(G), c, torch.empty(G, M, N, dtype=dt))
                name = f"{_dn(dt)}-2d2d-M{M}-N{N}-K{K}-G{G}{'+bias' if bias else ''}"
                out += captured(lambda: tiled.run(p), name, "tiled.run")
                out += captured(lambda: tma_k.run(p), name, "tma_k.run")
    # 4-bit experts: dequant_dot (plain and gated), frag, the dequantizing pass of dequant_grouped (whose product is
    # the 16-bit MoE forward's, on a [E, N, K] weight transposed: the b_nk cases above)
    for dt in halves:
        for M, E, N, K, gks in GROUPED_INT4:
            for gk in gks:
                for gated in (False, True):
                    tag = f"{_dn(dt)}-int4-M{M}-E{E}-N{N}-K{K}-g{gk}{'+gated+silu' if gated else ''}"
                    act = "silu" if gated else "none"
                    p = int4_problem(M, E, N, K, gk, dt, gated, act=act, frag=True)
                    out += captured(lambda: int4.run(p), tag, "int4.run")
                    if M <= 64:
                        out += _frag(p, tag)
                    w = torch.empty(E, (2 if gated else 1) * N, K, dtype=dt)
                    out += captured(lambda: dq.dequantize_experts(p, w, 0, N), tag, "dequantize_experts")
        for act in ("none",) + pf.ACTIVATIONS:  # bias [E, N] and each activation
            M, E, N, K, _ = GROUPED_INT4[0]
            p = int4_problem(M, E, N, K, 128, dt, False, "g", act, frag=True)
            tag = f"{_dn(dt)}-int4-M{M}-E{E}-N{N}-K{K}-g128+biasg+{act}"
            out += captured(lambda: int4.run(p), tag, "int4.run")
            out += _frag(p, tag)
    # routing: moe_route (its kernel up to KERNEL_MAX_PAIRS pairs), moe_combine, and group_columns (act-order experts'
    # input permutation; their product is then the natural order's kernels above)
    for dt in halves + (torch.float32,):
        for T, k, E, H in ((1, 8, 128, 2048), (16, 2, 8, 4096), (512, 8, 128, 2048), (1000, 6, 60, 1000)):
            x, ids = torch.empty(T, H, dtype=dt), torch.empty(T, k, dtype=torch.int64)
            name = f"{_dn(dt)}-T{T}-k{k}-E{E}-H{H}"
            out += captured(lambda: rt.route(x, ids, E), name, "route")
            y, pos, wts = torch.empty(T * k, H, dtype=dt), torch.empty(T * k, dtype=torch.int32), torch.empty(T, k)
            out += captured(lambda: rt.combine(y, pos, wts), name, "combine")
            perm = torch.empty(E, H, dtype=torch.int64)
            out += captured(lambda: rt.columns(y, _offs(E), perm), name, "columns")
    return out


FAMILIES = {"w4a16": w4a16_launches, "conv2d": conv_launches, "grouped": grouped_launches}


def all_launches(families=FAMILIES) -> list:
    return [launch for name in families for launch in FAMILIES[name]()]


def run(args) -> int:
    cache = tempfile.mkdtemp(prefix="ptx_fingerprint_families_")
    os.environ["TRITON_CACHE_DIR"] = cache
    try:
        return _run(args)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _run(args) -> int:
    t0 = time.time()
    _setup()
    # a filter that names a family keeps its launches (and builds only the named families' where every filter
    # names one); any other keeps the keys that contain it
    filters = args.filter or []
    families = [f for f in filters if f in FAMILIES]
    substrings = [f for f in filters if f not in FAMILIES]
    keys, specs = {}, {}
    launches = []
    for family in families if families and not substrings else FAMILIES:
        built = FAMILIES[family]()
        launches += built
        for launch in built:
            key = f"{launch.kernel}/{launch.mode}/{_kw_text(launch.kwargs)}"
            if filters and family not in families and not any(f in key for f in substrings):
                continue
            spec = pf.compile_spec(launch)
            canon = launch.kernel + pf._canonical(spec)
            keys[key] = canon
            specs.setdefault(canon, (key, launch.kernel, spec))
    import collections
    print(dict(collections.Counter(key.split("/")[0] for key, _, _ in specs.values())), file=sys.stderr)
    print(f"{len(launches)} launches, {len(keys)} keys, {len(specs)} distinct compiles planned in "
          f"{time.time() - t0:.0f}s", file=sys.stderr)
    if args.list:
        for key in sorted(keys):
            print(key)
        return 0
    work = [(key, kernel, spec, False) for key, kernel, spec in specs.values()]
    prints, leaks = {}, {}
    if args.jobs <= 1:
        results = map(_compile, work)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_init)
        results = pool.map(_compile, work, chunksize=2)
    canon_of = {key: canon for canon, (key, _, _) in specs.items()}
    for i, (key, h, _code, secs, leaked) in enumerate(results, 1):
        prints[canon_of[key]] = h
        if leaked:
            leaks[key] = leaked
        if i % 10 == 0 or i == len(work):
            print(f"  {i}/{len(work)} compiled, {time.time() - t0:.0f}s", file=sys.stderr)
    text = json.dumps({key: prints[canon] for key, canon in sorted(keys.items())}, indent=1) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    for key, lines in sorted(leaks.items()):
        print(f"WARNING {key}: the PTX names a module or file: {lines[:3]}", file=sys.stderr)
    print(f"{len(keys)} fingerprints ({len(specs)} compiles) in {time.time() - t0:.0f}s", file=sys.stderr)
    return 1 if leaks else 0


def _init() -> None:
    pf.KERNELS.clear()
    pf.KERNELS.update(KERNELS)
    pf.resolve = resolve  # (compile_one resolves kernels through it, in worker processes too)


def _compile(job):
    if set(pf.KERNELS) != set(KERNELS):
        _init()
    return pf.compile_one(job)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--filter", action="append")
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
