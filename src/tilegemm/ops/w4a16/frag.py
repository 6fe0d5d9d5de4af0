"""Kernel ``frag``: tensor cores fed from weights pre-shuffled into the MMA's register fragments (Gluon, sm_80+).

The ``mma`` kernel spends about nine instructions per weight unpacking nibbles and moving them into the
layout ``mma.sync`` wants. Here the shuffle is done once, offline (:func:`pack_fragments`): every int32 a
thread loads holds exactly the eight weights of its A fragment of one ``m16n8k16`` MMA, in the order that lets
two nibbles become an fp16x2 (bf16x2) pair with one LOP3 (the nibbles under the exponent of 1024 / 128: the
16-bit float ``base + q`` exactly). Per int32, in inline PTX: one shift, four LOP3s, two subtractions and two
FMAs (``(base + q) - (base + z)`` and ``(base + 16q) / 16 - (base / 16 + z)``, both exact) and four
multiplications by the scale: the same bits as :func:`~tilegemm.ops.w4a16.format.dequantize` rounds them,
about 1.6 instructions per weight.

The weights are the MMA's A operand (rows = output features N), the activations ``x.T`` its B operand (8 or
16 columns = rows of x), so small M wastes no weight bandwidth. A program owns ``BN = 64 * RH`` features
and one slice of K; each warp ``RH`` tiles of 16 rows. K steps of ``64 * KH``; the next step's weights are
loaded before this step's arithmetic. K slices meet in a last-arrival reduction (deterministic order).

The fragment layout (int32 ``[N16, K64, 32, 4]``): word ``(t, c, lane, l)`` with ``lane = 4 * rl + km`` holds,
as nibble ``i = 4h + 2j1 + j0``, the weight of row ``16t + 8j0 + rl`` and input ``64c + 16l + 8j1 + 2km + h``.
Scales and zeros (``[G, N16, 8, 4]`` in the weights' dtype): ``(z[r], z[r + 8], s[r], s[r + 8])`` for row
``r = 16t + rl``. N is padded to 16 and K to 64 with zero weights (x is masked there).
"""

from __future__ import annotations

import torch

from tilegemm.core.launch import current_stream, launch
from tilegemm.core.runtime import cdiv
from tilegemm.ops.w4a16.common import W4A16Problem, workspace
from tilegemm.ops.w4a16.configs import frag_config
from tilegemm.jit.helpers import apply_activation

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: E402


def q_layout() -> gl.BlockedLayout:
    """Layout of a step's words ``[4 * RH, KH, 32, 4]`` (any RH, KH) (row tile, 64-chunk, lane, 16-chunk): the four 16-chunks
    of a lane in one thread (a 16-byte load), lanes across the warp, row tiles across the warps then repeated."""
    return gl.BlockedLayout([1, 1, 1, 4], [1, 1, 32, 1], [4, 1, 1, 1], [3, 2, 1, 0])


# --- the kernel ----------------------------------------------------------------------------------------

_PREP16 = gl.constexpr("""{
.reg .b32 t, c;
prmt.b32 t, $4, 0, 0x1010;
mov.b32 c, 0x64006400;
add.rn.f16x2 $0, t, c;
prmt.b32 t, $4, 0, 0x3232;
mov.b32 c, 0xD400D400;
sub.rn.f16x2 $1, c, t;
prmt.b32 $2, $5, 0, 0x1010;
prmt.b32 $3, $5, 0, 0x3232;
}""")

_PREPBF = gl.constexpr("""{
.reg .b32 t, c, one;
mov.b32 one, 0x3F803F80;
mov.b32 c, 0x43004300;
prmt.b32 t, $4, 0, 0x1010;
fma.rn.bf16x2 $0, t, one, c;
prmt.b32 t, $4, 0, 0x3232;
fma.rn.bf16x2 $1, t, one, c;
prmt.b32 $2, $5, 0, 0x1010;
prmt.b32 $3, $5, 0, 0x3232;
}""")


def _deq(typ: str, base: str, sixteenth: str) -> str:
    return """{
.reg .b32 l, q, c;
mov.b32 c, %s;
lop3.b32 l, $8, 0x000f000f, %s, 0xEA;
sub.rn.%s l, l, $9;
mul.rn.%s l, l, $11;
mov.b32 {$0, $4}, l;
lop3.b32 l, $8, 0x00f000f0, %s, 0xEA;
fma.rn.%s l, l, c, $10;
mul.rn.%s l, l, $12;
mov.b32 {$1, $5}, l;
shr.u32 q, $8, 8;
lop3.b32 l, q, 0x000f000f, %s, 0xEA;
sub.rn.%s l, l, $9;
mul.rn.%s l, l, $11;
mov.b32 {$2, $6}, l;
lop3.b32 l, q, 0x00f000f0, %s, 0xEA;
fma.rn.%s l, l, c, $10;
mul.rn.%s l, l, $12;
mov.b32 {$3, $7}, l;
}""" % (sixteenth, base, typ, typ, base, typ, typ, base, typ, typ, base, typ, typ)


_DEQ16 = gl.constexpr(_deq("f16x2", "0x64006400", "0x2C002C00"))


def _deq_bf16() -> str:
    """bf16 has 7 mantissa bits: a nibble at bits 4..7 would reach the exponent, so every pair is shifted down
    first (prep gives 128 + z[r + 8] for the odd pairs here)."""
    lines = []
    for j, (shift, z, sc) in enumerate(((0, 9, 11), (4, 10, 12), (8, 9, 11), (12, 10, 12))):
        if shift:
            lines.append(f"shr.u32 q, $8, {shift};")
        lines += [f"lop3.b32 l, {'q' if shift else '$8'}, 0x000f000f, 0x43004300, 0xEA;",
                  f"sub.rn.bf16x2 l, l, ${z};", f"mul.rn.bf16x2 l, l, ${sc};", f"mov.b32 {{${j}, ${j + 4}}}, l;"]
    return "{\n.reg .b32 l, q;\n" + "\n".join(lines) + "\n}"


_DEQBF = gl.constexpr(_deq_bf16())


@gluon.jit
def _prep(zz, ss, BF16: gl.constexpr):
    """Per row pair (r, r + 8), each value twice (a 16-bit pair): base + z[r]; -(base / 16 + z[r + 8]) (fp16) or
    base + z[r + 8] (bf16); s[r]; s[r + 8]."""
    if BF16:
        return gl.inline_asm_elementwise(_PREPBF, "=r,=r,=r,=r,r,r", [zz, ss],
                                         dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    else:
        return gl.inline_asm_elementwise(_PREP16, "=r,=r,=r,=r,r,r", [zz, ss],
                                         dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _dequant(w, za, zb, sa, sb, BF16: gl.constexpr):
    """Eight 16-bit weights of each word, ``o[4h + 2j1 + j0]``."""
    if BF16:
        return gl.inline_asm_elementwise(_DEQBF, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r", [w, za, zb, sa, sb],
                                         dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        return gl.inline_asm_elementwise(_DEQ16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r", [w, za, zb, sa, sb],
                                         dtype=(gl.float16,) * 8, is_pure=True, pack=1)


@gluon.jit
def _a_tile(w, za, zb, sa, sb, RHT: gl.constexpr, KH: gl.constexpr, A_LAYOUT: gl.constexpr, BF16: gl.constexpr):
    o0, o1, o2, o3, o4, o5, o6, o7 = _dequant(w, za, zb, sa, sb, BF16)
    # dims (.., j1, j0, h): join over j1 first, h last
    v00 = gl.join(o0, o2)
    v10 = gl.join(o1, o3)
    v01 = gl.join(o4, o6)
    v11 = gl.join(o5, o7)
    w0 = gl.join(v00, v10)
    w1 = gl.join(v01, v11)
    t = gl.join(w0, w1)  # [RHT, KH, 32, 4, j1, j0, h]
    t = gl.reshape(t, [RHT, KH, 8, 4, 4, 2, 2, 2])  # lane -> (rl, km)
    t = gl.permute(t, [0, 6, 2, 1, 4, 5, 3, 7])  # (t, j0, rl) x (c, l, j1, km, h)
    t = gl.reshape(t, [RHT * 16, KH * 64])
    return gl.convert_layout(t, A_LAYOUT, assert_trivial=True)


@gluon.jit
def _step(acc, w, xt, za, zb, sa, sb, left, g, k0, group_k, group_steps, zs_ptr, zs_row, N16, RHT: gl.constexpr,
          KH: gl.constexpr, A_LAYOUT: gl.constexpr, BF16: gl.constexpr):
    """One K step: scales and zeros when the step starts a group, the weights dequantized, one MMA."""
    BK: gl.constexpr = 64 * KH
    if left == 0:
        zp = zs_ptr + (g * N16 * 8 + zs_row) * 2
        za, zb, sa, sb = _prep(gl.load(zp), gl.load(zp + 1), BF16)
        left = group_steps - (k0 - g * group_k) // BK
        g += 1
    a = _a_tile(w, za, zb, sa, sb, RHT, KH, A_LAYOUT, BF16)
    acc = mma_v2(a, xt, acc)
    return acc, za, zb, sa, sb, left - 1, g


@gluon.jit
def _x_step(x_ptr, x_offs, kk, k0, K, live, EVEN_K: gl.constexpr):
    """x.T rows k0 .. k0 + BK ([BK, BM]); none when not ``live`` (past the slice), zeros past K."""
    if EVEN_K:
        return gl.load(x_ptr + x_offs + k0, mask=live, other=0.0)
    else:
        return gl.load(x_ptr + x_offs + k0, mask=live & (k0 + gl.expand_dims(kk, 1) < K), other=0.0)


@gluon.jit
def frag_kernel(x_ptr, wf_ptr, zs_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr, M, N, K, stride_xm, stride_om, K64, N16,
                group_k, steps_per_split, k_stop,
                BM: gl.constexpr, RH: gl.constexpr, KH: gl.constexpr, QL: gl.constexpr, BF16: gl.constexpr,
                EVEN_K: gl.constexpr, DEPTH: gl.constexpr, SPLIT_K: gl.constexpr, HAS_BIAS: gl.constexpr,
                ACTIVATION: gl.constexpr):
    RHT: gl.constexpr = 4 * RH
    BN: gl.constexpr = 16 * RHT
    BK: gl.constexpr = 64 * KH
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    split = gl.program_id(2)

    # word offsets of step 0 for this program, [RHT, KH, 32, 4]
    i0 = gl.arange(0, RHT, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, QL))))
    i1 = gl.arange(0, KH, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, QL))))
    i2 = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, QL))))
    i3 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, QL))))
    t0 = pid_n * RHT + i0
    c0 = split * steps_per_split * KH
    o0 = gl.expand_dims(gl.expand_dims(gl.expand_dims((t0 * K64 + c0) * 128, 1), 2), 3)
    o1 = gl.expand_dims(gl.expand_dims(gl.expand_dims(i1 * 128, 0), 2), 3)
    o2 = gl.expand_dims(gl.expand_dims(gl.expand_dims(i2 * 4, 0), 1), 3)
    o3 = gl.expand_dims(gl.expand_dims(gl.expand_dims(i3, 0), 1), 2)
    w_offs = o0 + o1 + o2 + o3
    # scales and zeros: int32 pairs (z[r], z[r+8]) and (s[r], s[r+8]) at [g, t, rl]
    zs_row = gl.expand_dims(gl.expand_dims(gl.expand_dims(t0 * 8, 1), 2), 3) + \
        gl.expand_dims(gl.expand_dims(gl.expand_dims(i2 // 4, 0), 1), 3)  # [RHT, 1, 32, 1]

    # x.T tile offsets [BK, BM]; rows past M read row M - 1 (their columns are not stored)
    kk = gl.arange(0, BK, layout=gl.SliceLayout(1, b_l))
    mm = gl.minimum(pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, b_l)), M - 1)
    x_offs = gl.expand_dims(mm * stride_xm, 0) + gl.expand_dims(kk, 1)

    acc = gl.zeros([BN, BM], gl.float32, mma)
    k_begin = split * steps_per_split * BK
    k_end = gl.minimum(k_begin + steps_per_split * BK, k_stop)
    # DEPTH steps of weights in flight ahead of the arithmetic, and the next step's x. (Unrolled by two with a
    # buffer per half instead, to spare the loop-carried copies, it ran 5-20% slower: more registers.)
    w = gl.load(wf_ptr + w_offs, mask=k_begin < k_end)
    w_offs += 128 * KH
    if DEPTH == 2:
        w1 = gl.load(wf_ptr + w_offs, mask=k_begin + BK < k_end)
        w_offs += 128 * KH
    xt = _x_step(x_ptr, x_offs, kk, k_begin, K, k_begin < k_end, EVEN_K)
    # scales and zeros are (re)loaded when a step starts a group: every group_steps steps from k_begin's group
    group_steps = group_k // BK
    left = 0
    g = k_begin // group_k
    za = gl.zeros([RHT, 1, 32, 1], gl.int32, QL)
    zb = za
    sa = za
    sb = za
    for k0 in range(k_begin, k_end, BK):
        w_next = gl.load(wf_ptr + w_offs, mask=k0 + DEPTH * BK < k_end)
        x_next = _x_step(x_ptr, x_offs, kk, k0 + BK, K, k0 + BK < k_end, EVEN_K)
        acc, za, zb, sa, sb, left, g = _step(acc, w, xt, za, zb, sa, sb, left, g, k0, group_k, group_steps,
                                             zs_ptr, zs_row, N16, RHT, KH, a_l, BF16)
        if DEPTH == 2:
            w = w1
            w1 = w_next
        else:
            w = w_next
        xt = x_next
        w_offs += 128 * KH

    nn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    om = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    _finish(acc, out_ptr, bias_ptr, ws_ptr, count_ptr, nn, om, M, N, stride_om, pid_m * gl.num_programs(0) + pid_n,
            split, SPLIT_K, HAS_BIAS, ACTIVATION)


@gluon.jit
def _finish(acc, out_ptr, bias_ptr, ws_ptr, count_ptr, nn, om, M, N, stride_om, tile, split, SPLIT_K: gl.constexpr,
            HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr):
    """Store the transposed tile ``acc`` ([features nn, rows om] of the output), or with SPLIT_K > 1 hand it
    over: every slice leaves its partial tile in the workspace; the last to arrive at the tile adds them in
    slice order (deterministic) and stores."""
    inside = gl.expand_dims(nn < N, 1) & gl.expand_dims(om < M, 0)
    if SPLIT_K == 1:
        _store(acc, out_ptr, bias_ptr, nn, om, inside, N, stride_om, HAS_BIAS, ACTIVATION)
    else:
        ws_tile = ws_ptr + gl.expand_dims(om, 0) * N + gl.expand_dims(nn, 1)
        gl.store(ws_tile + split * M * N, acc, mask=inside)
        gl.thread_barrier()
        arrived = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            gl.thread_barrier()
            total = gl.zeros_like(acc)
            for s in range(0, SPLIT_K):
                total += gl.load(ws_tile + s * M * N, mask=inside, other=0.0, cache_modifier=".cg")
            gl.store(count_ptr + tile, 0)
            _store(total, out_ptr, bias_ptr, nn, om, inside, N, stride_om, HAS_BIAS, ACTIVATION)


@gluon.jit
def _store(acc, out_ptr, bias_ptr, nn, om, inside, N, stride_om, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr):
    """out[m, n] = activation(acc[n, m] + bias[n])."""
    if HAS_BIAS:
        acc += gl.expand_dims(gl.load(bias_ptr + nn, mask=nn < N, other=0.0).to(gl.float32), 1)
    acc = apply_activation(acc, ACTIVATION)
    gl.store(out_ptr + gl.expand_dims(om, 0) * stride_om + gl.expand_dims(nn, 1), acc.to(out_ptr.dtype.element_ty),
             mask=inside)


# --- launch ----------------------------------------------------------------------------------------------


def launch_args(x, fw, fzs, bias, out, N: int, K: int, group_k: int, activation: str, cfg: dict):
    """(kernel, grid, args, kwargs) for ``out = activation(x @ W.T + bias)`` from the fragments of W."""
    M = x.shape[0]
    n16, k64 = fw.shape[0], fw.shape[1]
    rh, bm, split, kh = cfg["RH"], cfg["BM"], cfg["SPLIT_K"], cfg.get("KH", 1)
    if group_k % (64 * kh):
        raise ValueError(f"frag: the group length {group_k} must be a multiple of the K step {64 * kh}")
    steps = cdiv(K, 64 * kh)  # the padding past them holds zero weights only
    per_split = cdiv(steps, max(1, min(split, steps)))
    split = cdiv(steps, per_split)
    tiles_n, tiles_m = cdiv(n16 * 16, 64 * rh), cdiv(M, bm)
    if split > 1:
        ws, count = workspace(x.device, split * M * N, tiles_n * tiles_m)
    else:
        ws, count = out, out  # unused
    args = (x, fw, fzs.view(torch.int32), bias if bias is not None else out, out, ws, count, M, N, K, x.stride(0),
            out.stride(0), k64, n16, group_k, per_split, steps * 64 * kh)
    kwargs = dict(BM=bm, RH=rh, KH=kh, QL=q_layout(), BF16=x.dtype == torch.bfloat16,
                  EVEN_K=K % (64 * kh) == 0, DEPTH=cfg.get("DEPTH", 1), SPLIT_K=split, HAS_BIAS=bias is not None,
                  ACTIVATION=activation, num_warps=4)
    return frag_kernel, (tiles_n, tiles_m, split), args, kwargs


def run(p: W4A16Problem, cfg: dict | None = None) -> None:
    if p.fweight is None:
        raise ValueError("the frag kernel needs the weight's fragment layout (Int4Weight.fragments())")
    cfg = cfg or frag_config(p.M, p.N, p.K, p.x.device)
    kernel, grid, args, kwargs = launch_args(p.x, p.fweight, p.fzs, p.bias, p.out, p.N, p.K, p.group_k,
                                             p.activation, cfg)
    # With split-K the workspace (args 5, 6) is the launcher's, made for the current stream (see mma.run).
    split = kwargs["SPLIT_K"] > 1
    launch(kernel, grid, args, kwargs, keep=args[5:7] if split else (),
           stream=current_stream() if split else None)
