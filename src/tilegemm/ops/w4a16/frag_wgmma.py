"""Kernel ``frag_wgmma``: Hopper's warp-group MMAs (``wgmma``) fed from weights pre-shuffled into the MMA's register
fragments, for M from 1 to about a thousand rows (Gluon, sm_90).

The ``mma`` kernel spends about nine instructions per weight unpacking nibbles and moving them into the layout
the MMA wants. Here the shuffle is done once, offline (:func:`~tilegemm.ops.w4a16.format.pack_fragments`): every
int32 a thread reads holds exactly the eight weights of its A fragment of one ``m16n8k16`` MMA tile (the per-warp
layout of ``mma.sync``, which ``wgmma`` takes for an A operand in registers), in the order that lets two nibbles
become an fp16x2 (bf16x2) pair with one LOP3 (the nibbles under the exponent of 1024 / 128: the 16-bit float
``base + q`` exactly). Per int32, in inline PTX: one shift, four LOP3s, two subtractions and two FMAs
(``(base + q) - (base + z)`` and ``(base + 16q) / 16 - (base / 16 + z)``, both exact) and four multiplications by
the scale: the same bits as :func:`~tilegemm.ops.w4a16.format.dequantize` rounds them, about 1.6 instructions per
weight.

The fragment layout (int32 ``[N16, K64, 32, 4]``): word ``(t, c, lane, l)`` with ``lane = 4 * rl + km`` holds,
as nibble ``i = 4h + 2j1 + j0``, the weight of row ``16t + 8j0 + rl`` and input ``64c + 16l + 8j1 + 2km + h``.
Scales and zeros (``[G, N16, 8, 4]`` in the weights' dtype): ``(z[r], z[r + 8], s[r], s[r + 8])`` for row
``r = 16t + rl``. N is padded to 16 and K to 64 with zero weights (x is masked there). Groups of 32 (``GROUP32``)
put two groups in a K step: words ``l = 0, 1`` of step ``c`` take group ``2c``, words ``2, 3`` group ``2c + 1``;
one group of all of K spans the padded steps.

The weights are ``wgmma``'s A operand (rows = output features N), so small M wastes no weight bandwidth; the
activations ``x`` (``[BM, 64]`` a step, ``BM`` = 8 .. 256 rows) its B operand, read from shared memory as they
lie (K contiguous). Each warp owns ``RH`` tiles of 16 weight rows, a program ``16 * RH * num_warps`` rows (the
output's features) and ``BM`` rows of x; its accumulator is the output tile transposed.

Both operands go through a ring of ``STAGES`` shared-memory slots filled by ``cp.async`` (no registers held
for loads in flight): a slot holds one step's x tile (swizzled for ``wgmma``) and its packed weight words,
which each thread reads back exactly as it copied them (16 bytes, one wavefront a quarter-warp). A step waits
for its slot, dequantizes its words into registers and issues the MMA; the MMA is waited for before the next
step writes those registers (the other programs on the SM fill the gap). K slices meet in a last-arrival
reduction (deterministic order).

Act-order weights (``GATHER``, with ``perm_ptr``): x's columns are read through the weight's perm, so no reordered
copy of x is made. A step's tile is gathered by 2-byte loads into registers one ring issue ahead and stored to its
slot at the next issue; the weights keep their ``cp.async`` ring (docs/w4a16.md, "Act-order").
"""

from __future__ import annotations

import torch

from tilegemm.core.launch import current_stream, launch
from tilegemm.core.runtime import cdiv
from tilegemm.jit.helpers import apply_activation
from tilegemm.ops.w4a16.common import workspace
from tilegemm.ops.w4a16.configs import frag_wgmma_config
from tilegemm.ops.w4a16.problem import W4A16Problem

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, warpgroup_mma, warpgroup_mma_wait)


# --- dequantization of the fragments ---------------------------------------------------------------

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


# --- the kernel ----------------------------------------------------------------------------------------

@gluon.jit
def _issue(x_ptr, x_offs, x_ok, kk, wf_ptr, w_offs, x_bufs, w_bufs, step, k_first, k_end, K,
           STAGES: gl.constexpr, EVEN_K: gl.constexpr, perm_ptr, xr, pr, GATHER: gl.constexpr):
    """cp.async the x tile and weight words of K step ``step`` (counted from the slice's first) into its slot;
    nothing past the slice, zeros past K and past M. GATHER (act-order): x's tile is ``xr``, gathered one issue
    earlier, stored to the slot; then the next step's tile is gathered through ``pr`` (its perm slice) and the
    perm slice of the step after is loaded: both arrive while this step's work runs (returned: the new xr, pr)."""
    k0 = k_first + step * 64
    live = k0 < k_end
    slot = step % STAGES
    if GATHER:
        # Stored first, then the next tile's loads: one tile of registers live (issuing the loads before the
        # store, to overlap the ring's first issues, took more registers: docs/w4a16.md, "Act-order")
        x_bufs.index(slot).store(xr)
        fence_async_shared()  # the writer's fence, before the barrier that precedes the MMA reading the slot
        xr = _gather_x(x_ptr, x_offs, x_ok, kk, pr, k0 + 64, k_end, K)
        pr = _perm_slice(perm_ptr, kk, k0 + 128, k_end, K)
    else:
        if EVEN_K:
            x_mask = x_ok & live
        else:
            # by 8-element chunk (K is a multiple of 8), so the compiler sees the mask whole across each 16-byte
            # copy
            x_mask = x_ok & live & (k0 + gl.expand_dims(kk // 8 * 8, 0) < K)
        async_copy.async_copy_global_to_shared(x_bufs.index(slot), x_ptr + x_offs + k0, mask=x_mask)
    async_copy.async_copy_global_to_shared(w_bufs.index(slot), wf_ptr + w_offs + step * 128, mask=live)
    async_copy.commit_group()
    return xr, pr


@gluon.jit
def _perm_slice(perm_ptr, kk, k0, k_end, K):
    """GATHER: ``perm[k0 : k0 + 64]``, the inputs of x that the K step at ``k0`` multiplies (0 past the slice
    and past K)."""
    k = k0 + kk
    if perm_ptr.dtype.element_ty == gl.int64:  # its low words only (indices < 2^31, little-endian): 32-bit registers
        return gl.load(perm_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + 2 * k, mask=(k < k_end) & (k < K),
                       other=0)
    else:
        return gl.load(perm_ptr + k, mask=(k < k_end) & (k < K), other=0)


@gluon.jit
def _gather_x(x_ptr, x_rows, x_ok, kk, pr, k0, k_end, K):
    """GATHER: ``x[rows, pr]``, the K step at ``k0`` in the weight's stored order ([BM, 64] in registers); zeros
    past the slice, K and M (the padded weights are zero, but 0 * NaN is not)."""
    ok = x_ok & gl.expand_dims((k0 + kk < k_end) & (k0 + kk < K), 0)
    return gl.load(x_ptr + x_rows + gl.expand_dims(pr, 0), mask=ok, other=0.0)


@gluon.jit
def _zs_load(zs_ptr, zs_row, N16, g, group_k, k_end):
    """The raw zero and scale pairs of group ``g`` (none past the slice); with GROUP32's ``zs_row``, of groups
    ``g`` and ``g + 1``."""
    zp = zs_ptr + (g * N16 * 8 + zs_row) * 2
    live = g * group_k < k_end
    return gl.load(zp, mask=live), gl.load(zp + 1, mask=live)


@gluon.jit
def _widen(v, ql: gl.constexpr):
    """GROUP32: ``[RHT, 1, 32, 2]`` values by half of the K step -> ``[RHT, 1, 32, 4]`` by the lane's word ``l``
    (words 0, 1 are the step's first 32 inputs, 2, 3 its last 32), in registers (no data moves)."""
    v = gl.join(v, v)  # [RHT, 1, 32, half, copy]
    v = gl.reshape(v, [v.shape[0], 1, 32, 4])
    return gl.convert_layout(v, ql, assert_trivial=True)


@gluon.jit
def _scales(zs_ptr, zs_row, N16, za, zb, sa, sb, zz, ss, left, g, k0, k_end, group_k, group_steps,
            BF16: gl.constexpr, GROUP32: gl.constexpr, ql: gl.constexpr):
    """The prepared scales and zeros for the step at ``k0``. When it starts group ``g``, they are made from
    ``zz, ss`` (group g's, loaded a group ahead) and group g + 1's are loaded, so their latency hides behind
    this group's steps. GROUP32 (groups of 32 inputs, two a step): every step takes groups g, g + 1 (each
    half of the step its own) and loads g + 2, g + 3."""
    if GROUP32:
        pa, pb, pc, pd = _prep(zz, ss, BF16)
        za, zb, sa, sb = _widen(pa, ql), _widen(pb, ql), _widen(pc, ql), _widen(pd, ql)
        g += 2
        zz, ss = _zs_load(zs_ptr, zs_row, N16, g, group_k, k_end)
    else:
        if left == 0:
            za, zb, sa, sb = _prep(zz, ss, BF16)
            left = group_steps - (k0 - g * group_k) // 64
            g += 1
            zz, ss = _zs_load(zs_ptr, zs_row, N16, g, group_k, k_end)
        left -= 1
    return za, zb, sa, sb, zz, ss, left, g


@gluon.jit
def _w_offsets(pid_n, split, steps_per_split, K64, RHT: gl.constexpr, ql: gl.constexpr):
    """(t0, i2, w_offs): the program's 16-row weight tiles ``t0`` (from ``pid_n * RHT``), a warp's lanes ``i2``,
    and the word offsets ``[RHT, 1, 32, 4]`` (layout ``ql``) of its K slice's first step in the fragments."""
    i0 = gl.arange(0, RHT, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, ql))))
    i2 = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, ql))))
    i3 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, ql))))
    t0 = pid_n * RHT + i0
    c0 = split * steps_per_split
    w_offs = gl.expand_dims(gl.expand_dims(gl.expand_dims((t0 * K64 + c0) * 128, 1), 2), 3) + \
        gl.expand_dims(gl.expand_dims(gl.expand_dims(i2 * 4, 0), 1), 3) + \
        gl.expand_dims(gl.expand_dims(gl.expand_dims(i3, 0), 1), 2)
    return t0, i2, w_offs


@gluon.jit
def _zs_start(zs_ptr, t0, i2, N16, g, group_k, k_end, RHT: gl.constexpr, ql: gl.constexpr,
              GROUP32: gl.constexpr, num_warps: gl.constexpr):
    """(the zero and scale rows of row tiles ``t0`` by lanes ``i2``, [RHT, 1, 32, 1]; four zero tensors to
    start the prepared pairs from; group ``g``'s raw pairs, loaded): what :func:`_scales` starts a slice with.
    GROUP32: the rows of groups g and g + 1, [RHT, 1, 32, 2] (both halves of a step), and [RHT, 1, 32, 4]
    prepared pairs."""
    if GROUP32:
        zl: gl.constexpr = gl.BlockedLayout([1, 1, 1, 2], [1, 1, 32, 1], [num_warps, 1, 1, 1], [3, 2, 1, 0])
        r0 = gl.convert_layout(t0 * 8, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, zl))))
        r2 = gl.convert_layout(i2 // 4, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, zl))))
        h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, zl))))
        zs_row = gl.expand_dims(gl.expand_dims(gl.expand_dims(r0, 1), 2), 3) + \
            gl.expand_dims(gl.expand_dims(gl.expand_dims(r2, 0), 1), 3) + \
            gl.expand_dims(gl.expand_dims(gl.expand_dims(h * (N16 * 8), 0), 1), 2)
        z = gl.zeros([RHT, 1, 32, 4], gl.int32, ql)
    else:
        zs_row = gl.expand_dims(gl.expand_dims(gl.expand_dims(t0 * 8, 1), 2), 3) + \
            gl.expand_dims(gl.expand_dims(gl.expand_dims(i2 // 4, 0), 1), 3)
        z = gl.zeros([RHT, 1, 32, 1], gl.int32, ql)
    zz, ss = _zs_load(zs_ptr, zs_row, N16, g, group_k, k_end)
    return zs_row, z, z, z, z, zz, ss


@gluon.jit
def _first_fragments(w_bufs, zs_ptr, zs_row, N16, za, zb, sa, sb, zz, ss, left, g, k_first, k_end, group_k,
                     group_steps, ql: gl.constexpr, a_l: gl.constexpr, RHT: gl.constexpr, STAGES: gl.constexpr,
                     BF16: gl.constexpr, GROUP32: gl.constexpr):
    """OVERLAP's and PIPE's start: once step 0's copies landed (every thread's), its scales and fragments."""
    async_copy.wait_group(STAGES - 2)
    gl.thread_barrier()
    za, zb, sa, sb, zz, ss, left, g = _scales(zs_ptr, zs_row, N16, za, zb, sa, sb, zz, ss, left, g, k_first,
                                              k_end, group_k, group_steps, BF16, GROUP32, ql)
    a = _a_tile(w_bufs.index(0).load(ql), za, zb, sa, sb, RHT, 1, a_l, BF16)
    fence_async_shared()
    return a, za, zb, sa, sb, zz, ss, left, g


@gluon.jit
def _pipe_step(t, acc, x_ptr, x_offs, x_ok, kk, wf_ptr, w_offs, x_bufs, w_bufs, zs_ptr, zs_row, N16,
               za, zb, sa, sb, zz, ss, left, g, k_first, k_end, K, group_k, group_steps, ql: gl.constexpr,
               a_l: gl.constexpr, RHT: gl.constexpr, STAGES: gl.constexpr, EVEN_K: gl.constexpr,
               BF16: gl.constexpr, GROUP32: gl.constexpr, perm_ptr, xr, pr, GATHER: gl.constexpr):
    """PIPE's step ``t`` (``t >= 1``; step t - 1's MMA in flight): wait until step t's copies landed (every
    thread's; every warp has retired step t - 2's MMA), refill the slot step t - 2 read, make step t's
    fragments, issue its MMA, retire step t - 1's."""
    async_copy.wait_group(STAGES - 3)
    gl.thread_barrier()
    xr, pr = _issue(x_ptr, x_offs, x_ok, kk, wf_ptr, w_offs, x_bufs, w_bufs, t + STAGES - 2, k_first, k_end, K,
                    STAGES, EVEN_K, perm_ptr, xr, pr, GATHER)
    za, zb, sa, sb, zz, ss, left, g = _scales(zs_ptr, zs_row, N16, za, zb, sa, sb, zz, ss, left, g,
                                              k_first + t * 64, k_end, group_k, group_steps, BF16, GROUP32, ql)
    a = _a_tile(w_bufs.index(t % STAGES).load(ql), za, zb, sa, sb, RHT, 1, a_l, BF16)
    fence_async_shared()
    acc = warpgroup_mma(a, x_bufs.index(t % STAGES).permute((1, 0)), acc, is_async=True)
    acc, a = warpgroup_mma_wait(1, deps=(acc, a))
    return acc, za, zb, sa, sb, zz, ss, left, g, xr, pr


@gluon.jit
def _plain_step(s, acc, x_ptr, x_offs, x_ok, kk, wf_ptr, w_offs, x_bufs, w_bufs, zs_ptr, zs_row, N16,
                za, zb, sa, sb, zz, ss, left, g, k_first, k_end, K, group_k, group_steps, ql: gl.constexpr,
                a_l: gl.constexpr, RHT: gl.constexpr, STAGES: gl.constexpr, EVEN_K: gl.constexpr,
                BF16: gl.constexpr, GROUP32: gl.constexpr, perm_ptr, xr, pr, GATHER: gl.constexpr):
    """The plain loop's step ``s`` (OVERLAP and PIPE off; also the grouped ``frag`` kernel's): step s's scales,
    wait until its copies landed (every thread's; every warp is done with step s - 1's slot), refill that slot
    with step s + STAGES - 1, make step s's fragments, run its MMA to completion."""
    za, zb, sa, sb, zz, ss, left, g = _scales(zs_ptr, zs_row, N16, za, zb, sa, sb, zz, ss, left, g,
                                              k_first + s * 64, k_end, group_k, group_steps, BF16, GROUP32, ql)
    async_copy.wait_group(STAGES - 2)  # step s has landed (this thread's copies) ...
    gl.thread_barrier()  # ... and every thread's; every warp is done with step s - 1's slot
    fence_async_shared()
    xr, pr = _issue(x_ptr, x_offs, x_ok, kk, wf_ptr, w_offs, x_bufs, w_bufs, s + STAGES - 1, k_first,
                    k_end, K, STAGES, EVEN_K, perm_ptr, xr, pr, GATHER)
    slot = s % STAGES
    a = _a_tile(w_bufs.index(slot).load(ql), za, zb, sa, sb, RHT, 1, a_l, BF16)
    acc = warpgroup_mma(a, x_bufs.index(slot).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    return acc, za, zb, sa, sb, zz, ss, left, g, xr, pr


@gluon.jit
def _pair_step(s, acc, x_ptr, x_offs, x_ok, kk, wf_ptr, w_offs, x_bufs, w_bufs, zs_ptr, zs_row, N16,
               za, zb, sa, sb, zz, ss, left, g, k_first, k_end, K, group_k, group_steps, ql: gl.constexpr,
               a_l: gl.constexpr, RHT: gl.constexpr, STAGES: gl.constexpr, EVEN_K: gl.constexpr,
               BF16: gl.constexpr, GROUP32: gl.constexpr, perm_ptr, xr, pr, GATHER: gl.constexpr):
    """PAIRS's steps ``s`` and ``s + 1`` (the ring issued up to step s + STAGES - 3): one wait and one barrier
    for both (every thread's copies of the two landed; every warp retired the pair before), each thread's words
    of both read back, then the slots of the pair before refilled with steps s + STAGES - 2 and s + STAGES - 1,
    and both MMAs run to completion."""
    async_copy.wait_group(STAGES - 4)
    gl.thread_barrier()
    wa = w_bufs.index(s % STAGES).load(ql)
    wb = w_bufs.index((s + 1) % STAGES).load(ql)
    fence_async_shared()
    xr, pr = _issue(x_ptr, x_offs, x_ok, kk, wf_ptr, w_offs, x_bufs, w_bufs, s + STAGES - 2, k_first, k_end, K,
                    STAGES, EVEN_K, perm_ptr, xr, pr, GATHER)
    xr, pr = _issue(x_ptr, x_offs, x_ok, kk, wf_ptr, w_offs, x_bufs, w_bufs, s + STAGES - 1, k_first, k_end, K,
                    STAGES, EVEN_K, perm_ptr, xr, pr, GATHER)
    za, zb, sa, sb, zz, ss, left, g = _scales(zs_ptr, zs_row, N16, za, zb, sa, sb, zz, ss, left, g,
                                              k_first + s * 64, k_end, group_k, group_steps, BF16, GROUP32, ql)
    a = _a_tile(wa, za, zb, sa, sb, RHT, 1, a_l, BF16)
    acc = warpgroup_mma(a, x_bufs.index(s % STAGES).permute((1, 0)), acc, is_async=True)
    za, zb, sa, sb, zz, ss, left, g = _scales(zs_ptr, zs_row, N16, za, zb, sa, sb, zz, ss, left, g,
                                              k_first + (s + 1) * 64, k_end, group_k, group_steps, BF16, GROUP32, ql)
    a2 = _a_tile(wb, za, zb, sa, sb, RHT, 1, a_l, BF16)
    acc = warpgroup_mma(a2, x_bufs.index((s + 1) % STAGES).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    return acc, za, zb, sa, sb, zz, ss, left, g, xr, pr


@gluon.jit
def frag_wgmma_kernel(x_ptr, wf_ptr, zs_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr, M, N, K, stride_x8, stride_om,
                      K64, N16, group_k, steps_per_split, k_stop,
                      BM: gl.constexpr, RH: gl.constexpr, STAGES: gl.constexpr, BF16: gl.constexpr,
                      EVEN_K: gl.constexpr, SPLIT_K: gl.constexpr, HAS_BIAS: gl.constexpr,
                      ACTIVATION: gl.constexpr, OVERLAP: gl.constexpr, PIPE: gl.constexpr,
                      num_warps: gl.constexpr, GROUP32: gl.constexpr = False, perm_ptr=None,
                      GATHER: gl.constexpr = False, PAIRS: gl.constexpr = False):
    RHT: gl.constexpr = num_warps * RH  # 16-row tiles of weights
    BN: gl.constexpr = 16 * RHT
    dt: gl.constexpr = x_ptr.dtype.element_ty
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, BM, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    # words [RHT, 1, 32, 4]: a lane's four words in one thread (16 bytes), row tiles across the warps
    ql: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [1, 1, 32, 1], [num_warps, 1, 1, 1], [3, 2, 1, 0])
    # x [BM, 64]: 16 bytes a thread along K
    xl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    x_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, 64], dt)
    w_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    split = gl.program_id(2)

    t0, i2, w_offs = _w_offsets(pid_n, split, steps_per_split, K64, RHT, ql)  # the slice's first step's words

    # x tile offsets [BM, 64]; rows past M are zero-filled (their output columns are not stored). GATHER: the
    # rows' offsets [BM, 1] (stride_x8 is then x's row stride in elements), the columns coming through perm.
    mm = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, xl))
    kk = gl.arange(0, 64, layout=gl.SliceLayout(0, xl))
    if GATHER:
        x_offs = gl.expand_dims(mm.to(gl.int64) * stride_x8, 1)
    else:
        x_offs = gl.expand_dims(mm.to(gl.int64) * stride_x8 * 8, 1) + gl.expand_dims(kk, 0)
    x_ok = gl.expand_dims(mm < M, 1)

    x_bufs = gl.allocate_shared_memory(dt, [STAGES, BM, 64], x_sl)
    w_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, RHT, 1, 32, 4], w_sl)

    k_first = split * steps_per_split * 64
    k_end = gl.minimum(k_first + steps_per_split * 64, k_stop)
    steps = gl.cdiv(k_end - k_first, 64)
    if GATHER:  # the first step's tile in registers and the second's perm slice, for the first _issue
        xr = _gather_x(x_ptr, x_offs, x_ok, kk, _perm_slice(perm_ptr, kk, k_first, k_end, K), k_first, k_end, K)
        pr = _perm_slice(perm_ptr, kk, k_first + 64, k_end, K)
    else:
        xr = 0
        pr = 0
    for i in gl.static_range(STAGES - 2 if PAIRS else STAGES - 1):
        xr, pr = _issue(x_ptr, x_offs, x_ok, kk, wf_ptr, w_offs, x_bufs, w_bufs, i, k_first, k_end, K, STAGES,
                        EVEN_K, perm_ptr, xr, pr, GATHER)

    group_steps = group_k // 64
    left = 0
    g = k_first // group_k
    zs_row, za, zb, sa, sb, zz, ss = _zs_start(zs_ptr, t0, i2, N16, g, group_k, k_end, RHT, ql, GROUP32, num_warps)
    acc = gl.zeros([BN, BM], gl.float32, acc_l)
    if PIPE:
        # Two MMA groups in flight: step t's MMA is issued before step t - 1's is retired, so the tensor cores
        # do not idle between steps; step t's fragments are made while step t - 1's MMA runs. A wgmma reads its
        # A fragments from registers until it is retired, so a call site's registers may be rewritten only
        # after the wait that retires it: the steps alternate between two call sites of _pipe_step (the loop
        # is unrolled by two), and a third takes an odd step left over. The wait names the fragments just
        # issued (they must outlive it), not those it retires: that a site's registers are free again by its
        # next turn rests on the two sites and on ptxas keeping a wgmma's registers until a wait retires it.
        # A ptxas or Triton that reused them earlier would break this silently: the GPU tests run PIPE over
        # 1 to 5 steps and rings of 3 to 5 slots (tests/w4a16/test_w4a16_frag_wgmma.py).
        a, za, zb, sa, sb, zz, ss, left, g = _first_fragments(w_bufs, zs_ptr, zs_row, N16, za, zb, sa, sb, zz, ss,
                                                              left, g, k_first, k_end, group_k, group_steps, ql,
                                                              a_l, RHT, STAGES, BF16, GROUP32)
        acc = warpgroup_mma(a, x_bufs.index(0).permute((1, 0)), acc, is_async=True)
        acc, a = warpgroup_mma_wait(1, deps=(acc, a))  # waits for nothing (one group in flight): a tensor again
        for t in range(1, steps - 1, 2):
            acc, za, zb, sa, sb, zz, ss, left, g, xr, pr = _pipe_step(
                t, acc, x_ptr, x_offs, x_ok, kk, wf_ptr, w_offs, x_bufs, w_bufs, zs_ptr, zs_row, N16,
                za, zb, sa, sb, zz, ss, left, g, k_first, k_end, K, group_k, group_steps, ql, a_l, RHT,
                STAGES, EVEN_K, BF16, GROUP32, perm_ptr, xr, pr, GATHER)
            acc, za, zb, sa, sb, zz, ss, left, g, xr, pr = _pipe_step(
                t + 1, acc, x_ptr, x_offs, x_ok, kk, wf_ptr, w_offs, x_bufs, w_bufs, zs_ptr, zs_row, N16,
                za, zb, sa, sb, zz, ss, left, g, k_first, k_end, K, group_k, group_steps, ql, a_l, RHT,
                STAGES, EVEN_K, BF16, GROUP32, perm_ptr, xr, pr, GATHER)
        if steps % 2 == 0:
            acc, za, zb, sa, sb, zz, ss, left, g, xr, pr = _pipe_step(
                steps - 1, acc, x_ptr, x_offs, x_ok, kk, wf_ptr, w_offs, x_bufs, w_bufs, zs_ptr, zs_row, N16,
                za, zb, sa, sb, zz, ss, left, g, k_first, k_end, K, group_k, group_steps, ql, a_l, RHT,
                STAGES, EVEN_K, BF16, GROUP32, perm_ptr, xr, pr, GATHER)
        acc = warpgroup_mma_wait(0, deps=(acc,))
    elif OVERLAP:
        # Step s + 1 is dequantized while step s's MMA runs; its registers stay live (a dependency of the wait)
        # until that MMA is retired. The slot loaded at step s is the one step s - 1 read: every warp retired
        # that MMA before the barrier.
        a, za, zb, sa, sb, zz, ss, left, g = _first_fragments(w_bufs, zs_ptr, zs_row, N16, za, zb, sa, sb, zz, ss,
                                                              left, g, k_first, k_end, group_k, group_steps, ql,
                                                              a_l, RHT, STAGES, BF16, GROUP32)
        for s in range(steps):
            acc = warpgroup_mma(a, x_bufs.index(s % STAGES).permute((1, 0)), acc, is_async=True)
            async_copy.wait_group(STAGES - 3)  # step s + 1 has landed (this thread's copies) ...
            gl.thread_barrier()  # ... and every thread's; every warp retired step s - 1's MMA
            xr, pr = _issue(x_ptr, x_offs, x_ok, kk, wf_ptr, w_offs, x_bufs, w_bufs, s + STAGES - 1, k_first,
                            k_end, K, STAGES, EVEN_K, perm_ptr, xr, pr, GATHER)
            za, zb, sa, sb, zz, ss, left, g = _scales(zs_ptr, zs_row, N16, za, zb, sa, sb, zz, ss, left, g,
                                                      k_first + (s + 1) * 64, k_end, group_k, group_steps, BF16, GROUP32, ql)
            a_next = _a_tile(w_bufs.index((s + 1) % STAGES).load(ql), za, zb, sa, sb, RHT, 1, a_l, BF16)
            fence_async_shared()
            acc, a = warpgroup_mma_wait(0, deps=(acc, a))
            a = a_next
    elif PAIRS:
        # Two steps a wait and a barrier (the ring issues STAGES - 2 steps ahead); an odd last step alone
        for s in range(0, steps - 1, 2):
            acc, za, zb, sa, sb, zz, ss, left, g, xr, pr = _pair_step(
                s, acc, x_ptr, x_offs, x_ok, kk, wf_ptr, w_offs, x_bufs, w_bufs, zs_ptr, zs_row, N16,
                za, zb, sa, sb, zz, ss, left, g, k_first, k_end, K, group_k, group_steps, ql, a_l, RHT,
                STAGES, EVEN_K, BF16, GROUP32, perm_ptr, xr, pr, GATHER)
        if steps % 2 == 1:
            async_copy.wait_group(STAGES - 3)
            gl.thread_barrier()
            t = steps - 1
            za, zb, sa, sb, zz, ss, left, g = _scales(zs_ptr, zs_row, N16, za, zb, sa, sb, zz, ss, left, g,
                                                      k_first + t * 64, k_end, group_k, group_steps, BF16, GROUP32, ql)
            a = _a_tile(w_bufs.index(t % STAGES).load(ql), za, zb, sa, sb, RHT, 1, a_l, BF16)
            fence_async_shared()
            acc = warpgroup_mma(a, x_bufs.index(t % STAGES).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
    else:
        for s in range(steps):
            acc, za, zb, sa, sb, zz, ss, left, g, xr, pr = _plain_step(
                s, acc, x_ptr, x_offs, x_ok, kk, wf_ptr, w_offs, x_bufs, w_bufs, zs_ptr, zs_row, N16,
                za, zb, sa, sb, zz, ss, left, g, k_first, k_end, K, group_k, group_steps, ql, a_l, RHT,
                STAGES, EVEN_K, BF16, GROUP32, perm_ptr, xr, pr, GATHER)
    async_copy.wait_group(0)

    nn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_l))
    om = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_l))
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


def launch_args(x, fw, fzs, bias, out, N: int, K: int, group_k: int, activation: str, cfg: dict, perm=None):
    """(kernel, grid, args, kwargs) for ``out = activation(x @ W.T + bias)`` from the fragments of W; with
    ``perm`` (int32 or int64 ``[K]``, act-order), of ``x[:, perm] @ W.T``: x's columns read through it
    (``GATHER``)."""
    M = x.shape[0]
    n16, k64 = fw.shape[0], fw.shape[1]
    rh, bm, split, warps = cfg["RH"], cfg["BM"], cfg["SPLIT_K"], cfg["num_warps"]
    steps = cdiv(K, 64)  # the padding past them holds zero weights only
    if group_k >= K:  # one group (all of K): it spans every step, the padded last one included
        group_k = steps * 64
    if group_k % 64 and group_k != 32:
        raise ValueError(f"frag_wgmma: the group length {group_k} must be 32, a multiple of the K step 64, or all "
                         f"of K")
    if perm is not None:
        if perm.dtype not in (torch.int32, torch.int64) or tuple(perm.shape) != (K,) or perm.stride(0) != 1 \
                or perm.device != x.device:
            raise ValueError(f"frag_wgmma: perm must be a contiguous int32 or int64 [K] = [{K}] on x's device, got "
                             f"{perm.dtype} {list(perm.shape)} (stride {perm.stride()}) on {perm.device}")
        if x.stride(1) != 1:
            raise ValueError(f"frag_wgmma: x's inputs must be contiguous (stride 1), got stride {x.stride(1)}")
    elif x.stride(0) % 8:
        raise ValueError(f"frag_wgmma: x's row stride {x.stride(0)} must be a multiple of 8 elements (16 bytes)")
    elif x.data_ptr() % 16:
        raise ValueError(f"frag_wgmma: x must start 16-byte aligned (its address is {x.data_ptr() % 16} bytes past)")
    if (cfg.get("OVERLAP", True) or cfg.get("PIPE", False)) and cfg["STAGES"] < 3:
        raise ValueError("frag_wgmma: OVERLAP needs STAGES >= 3 (a step in the MMA, the next landed, one loading)")
    per_split = cdiv(steps, max(1, min(split, steps)))
    split = cdiv(steps, per_split)
    tiles_n, tiles_m = cdiv(n16 * 16, 16 * rh * warps), cdiv(M, bm)
    if split > 1:
        ws, count = workspace(x.device, split * M * N, tiles_n * tiles_m)
    else:
        ws, count = out, out  # unused
    args = (x, fw, fzs.view(torch.int32), bias if bias is not None else out, out, ws, count, M, N, K,
            x.stride(0) if perm is not None else x.stride(0) // 8, out.stride(0), k64, n16, group_k, per_split,
            steps * 64)
    kwargs = dict(BM=bm, RH=rh, STAGES=cfg["STAGES"], BF16=x.dtype == torch.bfloat16, EVEN_K=K % 64 == 0,
                  SPLIT_K=split, HAS_BIAS=bias is not None, ACTIVATION=activation,
                  OVERLAP=cfg.get("OVERLAP", True), PIPE=cfg.get("PIPE", False), num_warps=warps)
    if group_k == 32:  # named only here, so the other group lengths' launches are what they were
        kwargs["GROUP32"] = True
    if cfg.get("PAIRS"):  # named only where on, so the other launches compile as before
        if cfg.get("OVERLAP", True) or cfg.get("PIPE", False) or cfg["STAGES"] < 4:
            raise ValueError("frag_wgmma: PAIRS takes the plain loop (OVERLAP and PIPE off) and STAGES >= 4")
        kwargs["PAIRS"] = True
    if perm is not None:  # named only for act-order launches (gathered x: element loads, no 16-byte alignment)
        kwargs["perm_ptr"], kwargs["GATHER"] = perm, True
    return frag_wgmma_kernel, (tiles_n, tiles_m, split), args, kwargs


def run(p: W4A16Problem, cfg: dict | None = None) -> None:
    if p.fweight is None:
        raise ValueError("the frag_wgmma kernel needs the weight's fragment layout (Int4Weight.fragments())")
    cfg = cfg or frag_wgmma_config(p.M, p.N, p.K, p.x.device, gather=p.perm is not None)
    # 16-byte copies need rows 16-byte aligned: copy x if they are not, its start included (a launch on the copy
    # is not replayed: the copy is no tensor of the call). A gathered x (act-order) is read element by element.
    x = p.x if p.perm is not None or p.x.stride(0) % 8 == 0 and p.x.data_ptr() % 16 == 0 else \
        p.x.clone(memory_format=torch.contiguous_format)
    kernel, grid, args, kwargs = launch_args(x, p.fweight, p.fzs, p.bias, p.out, p.N, p.K, p.group_k,
                                             p.activation, cfg, p.perm)
    split = kwargs["SPLIT_K"] > 1
    launch(kernel, grid, args, kwargs, keep=args[5:7] if split else (),
           stream=current_stream() if split else None)
