"""Kernel ``tma``: the MoE forward (2-D x 3-D) on Hopper, operand tiles moved by TMA, persistent over the tiles.

``tiled`` loads every tile through pointers (an address and a mask per element, cp.async); where groups are large
(prefill: hundreds of rows an expert) its K loop is the product's time. Here each program makes two TMA
descriptors once, on the device (no host work per call, nothing the host must read from ``offs``):

- a over the whole ``[M, K]``. A row tile starts at its group's first row plus a multiple of BLOCK_M and may run
  past the group's end into the next group's rows; those rows are multiplied by the wrong expert, but only the
  group's own rows are stored, so they cost nothing but the padding ``tiled`` has too. Rows past M and K past its
  end read as zeros.
- b as the 3-D ``[G, K, N]`` (b row-major in its last two dims) or ``[G, N, K]`` (column-major: torch's own
  layout of expert weights, ``w.transpose(1, 2)``), a box of ``[1, BLOCK_K, BLOCK_N]`` (or ``[1, BLOCK_N,
  BLOCK_K]``) at expert g: one descriptor serves every expert, and K past its end reads zeros within the expert.

The grid is at most one program an SM; each walks the work units ``pid, pid + programs, ...``: a unit is an
output tile, numbered as ``tiled`` numbers them (a group's tiles next to each other, in bands of GROUP_M row tiles,
:func:`~tilegemm.ops.grouped.tiled.swizzle`), the rows past ``offs[-1]`` last. ``offs`` is read once a program:
each group's tiles and their running sum stay in registers, and a unit finds its group by one comparison with
them. The K loop is software-pipelined (``tl.range(num_stages=...)``: TMA runs STAGES - 1 steps ahead of the
wgmma). The epilogue is ``tiled``'s: bias ``[N]`` or ``[G, N]``, the activation, the gate (``GATED``: a second
accumulator over the up projection's columns, N further along b), stored through pointers, masked to the group's
rows (a TMA store would write the next group's rows); the rows past ``offs[-1]`` get zeros.

``FLATTEN`` (a config key the candidates tool times; off in the shipped configs) fuses the tile loop into the K loop, so
the next tile's loads are issued during this tile's last steps; the fusion needs the K loop's bounds the same for
every tile, so the tail's tiles then run it too and store zeros all the same.

``TAIL_SPLIT`` (a config key, off at 1; ``configs.TMA_TAIL_SPLIT``) cuts the units of the last partial wave along K:
the groups' units (the rows past ``offs[-1]`` aside) that fill whole waves over the programs run whole, and each of
the rest becomes up to TAIL_SPLIT work items of whole K steps, as many as the programs left idle in that wave take
(:func:`~tilegemm.ops.grouped.configs.tail_plan`, computed on the device: the units follow from ``offs``). A sliced
item stores its fp32 partial tile in a per-stream workspace (a tile a slot) and counts itself in at its unit's
counter; the last to arrive adds the slots in slice order (deterministic), resets the counter and runs the epilogue.
The other slices store nothing. Nothing waits on another program, so no order of the programs can stall it.

Device-made descriptors live in a global scratch buffer that Triton asks the host to allocate at launch
(:func:`tilegemm.core.launch.ensure_allocator`, at each launch). Measurements: docs/grouped.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilegemm.core.hardware import sm_count, tma_aligned, why_not_tma
from tilegemm.core.launch import ensure_allocator, launch
from tilegemm.core.registry import NotApplicable
from tilegemm.core.runtime import cdiv, interpreting
from tilegemm.core.workspace import split_workspace
from tilegemm.jit.helpers import apply_activation
from tilegemm.ops.grouped import configs
from tilegemm.ops.grouped.configs import row_tiles, tma_config
from tilegemm.ops.grouped.problem import GroupedProblem
from tilegemm.ops.grouped.tiled import _pow2, jagged_groups, locate_group, swizzle, workspace_launch


@triton.jit
def tail_split_of(live_units, k_steps, PROGRAMS, TAIL_SPLIT: tl.constexpr, TAIL_MIN_STEPS: tl.constexpr):
    """(full, tail, split) of the tail split (:func:`tilegemm.ops.grouped.configs.tail_plan`, the same
    arithmetic): the units of the whole waves, the units left for the last, the K slices each of those takes."""
    full = live_units // PROGRAMS * PROGRAMS
    tail = live_units - full
    split = tl.minimum(tl.minimum(PROGRAMS // tl.maximum(tail, 1), TAIL_SPLIT), k_steps // TAIL_MIN_STEPS)
    return full, tail, tl.maximum(split, 1)


@triton.jit
def tail_item(item, live_units, k_steps, PROGRAMS, TAIL_SPLIT: tl.constexpr, TAIL_MIN_STEPS: tl.constexpr):
    """(unit, first K step, end K step, sliced, slot, counter, split) of work item ``item``: items below ``full``
    are whole units, the next ``tail * split`` the slices of the last wave's units (slot ``item - full``, counter
    ``unit - full``), the rest the units of the rows past ``offs[-1]``, whole."""
    full, tail, split = tail_split_of(live_units, k_steps, PROGRAMS, TAIL_SPLIT, TAIL_MIN_STEPS)
    per = tl.cdiv(k_steps, split)
    in_tail = (item >= full) & (item < full + tail * split)
    unit = tl.where(item < full, item, tl.where(in_tail, full + (item - full) // split, item - tail * (split - 1)))
    k_lo = tl.where(in_tail, ((item - full) % split) * per, 0)
    k_hi = tl.where(in_tail, tl.minimum(k_lo + per, k_steps), k_steps)
    return unit, k_lo, k_hi, in_tail & (split > 1), item - full, unit - full, split


@triton.jit
def tail_tile(ws_ptr, slot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pointers of workspace slot ``slot``, a [BLOCK_M, BLOCK_N] fp32 tile (rows first, then columns added: no
    [BLOCK_M, BLOCK_N] offset tensor stays live beside the accumulator)."""
    rows = ws_ptr + slot.to(tl.int64) * (BLOCK_M * BLOCK_N) + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N
    return rows + tl.arange(0, BLOCK_N)[None, :]


@triton.jit
def tail_finish(acc, ws_ptr, count_ptr, slot, counter, split, sliced, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The end of a sliced item: its partial tile into workspace slot ``slot``, an arrival at ``counter``; the slice
    that arrives last adds the unit's ``split`` slots in slice order and resets the counter. Returns (finish, acc):
    finish is False for the other slices (they store nothing), True for every unsliced item."""
    tl.store(tail_tile(ws_ptr, slot, BLOCK_M, BLOCK_N), acc, mask=sliced)
    # A scalar atomic runs on one thread: the barrier puts every thread's stores before its release.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + counter, 1, mask=sliced, sem="acq_rel", scope="gpu")
    last = sliced & (arrived == split - 1)
    if last:
        tl.debug_barrier()  # every thread's loads after the last arrival's acquire
        # summed into acc itself, its own value already in its slot: one accumulator's registers, not two
        first = counter * split
        acc = tl.load(tail_tile(ws_ptr, first, BLOCK_M, BLOCK_N), cache_modifier=".cg")
        for s in range(1, split):
            acc += tl.load(tail_tile(ws_ptr, first + s, BLOCK_M, BLOCK_N), cache_modifier=".cg")
        tl.store(count_ptr + counter, 0)
    return (sliced == 0) | last, acc


@triton.jit
def grouped_tma_kernel(
    a_ptr, b_ptr, out_ptr, bias_ptr, offs_ptr, ws_ptr, count_ptr,
    G, M, N, K, N_B, PROGRAMS,
    s_am, s_bg, s_bx, s_om, s_on, s_cg, s_cn, UPC,
    B_NK: tl.constexpr, GP: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, STAGES: tl.constexpr, FLATTEN: tl.constexpr, TAIL_SPLIT: tl.constexpr,
    TAIL_MIN_STEPS: tl.constexpr,
):
    # s_bx: b's stride along its middle dim of the descriptor (K when B_NK is False, N when True).
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[s_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_NK:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[G, N_B, K], strides=[s_bg, s_bx, 1],
                                           block_shape=[1, BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[G, K, N_B], strides=[s_bg, s_bx, 1],
                                           block_shape=[1, BLOCK_K, BLOCK_N])
    # the groups' tiles, read once a program; the tail's rows are [last, M)
    starts, ends, tiles, ends_tiles, group_tiles, last = jagged_groups(offs_ptr, G, M, GP, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    units = (group_tiles + tl.cdiv(M - last, BLOCK_M)) * tiles_n
    k_steps = tl.cdiv(K, BLOCK_K)
    if TAIL_SPLIT > 1:
        _, tail_units, split = tail_split_of(group_tiles * tiles_n, k_steps, PROGRAMS, TAIL_SPLIT, TAIL_MIN_STEPS)
        items = units + tail_units * (split - 1)  # the extra slices of the last wave's units
    else:
        items = units
    for item in tl.range(tl.program_id(0), items, PROGRAMS, flatten=FLATTEN):
        if TAIL_SPLIT > 1:
            unit, k_lo, k_hi, sliced, slot, counter, split = tail_item(item, group_tiles * tiles_n, k_steps,
                                                                       PROGRAMS, TAIL_SPLIT, TAIL_MIN_STEPS)
        else:
            unit = item
        tm = unit // tiles_n
        g, start, end, first_tile = locate_group(tm, starts, ends, tiles, ends_tiles, group_tiles, last, G, M, GP)
        tail = g >= G
        tile_m, tile_n = swizzle(unit - first_tile * tiles_n, (end - start + BLOCK_M - 1) // BLOCK_M, tiles_n,
                                 GROUP_M)
        m0 = start + tile_m * BLOCK_M
        n0 = tile_n * BLOCK_N
        live = g < G
        g = tl.minimum(g, G - 1)  # (the tail reads no group's weight or bias)
        if FLATTEN:
            steps = k_steps  # fusing the loops needs the inner bounds invariant: the tail's products are discarded
        else:
            steps = tl.where(tail, 0, k_steps)  # the tail's tiles multiply nothing: they store zeros
        if TAIL_SPLIT > 1:
            k_first = k_lo  # (a sliced item's units are the groups': steps is k_steps there)
            steps = tl.minimum(steps, k_hi)
        else:
            k_first = 0
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GATED:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in tl.range(k_first, steps, num_stages=STAGES):
            k0 = ks * BLOCK_K
            x = a_desc.load([m0, k0])
            if B_NK:
                w = tl.reshape(b_desc.load([g, n0, k0]), (BLOCK_N, BLOCK_K)).T
            else:
                w = tl.reshape(b_desc.load([g, k0, n0]), (BLOCK_K, BLOCK_N))
            if UPCAST:  # the interpreter's bf16 dot is wrong: multiply fp32 copies there
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, w, acc)
            if GATED:
                if B_NK:
                    u = tl.reshape(b_desc.load([g, n0 + N, k0]), (BLOCK_N, BLOCK_K)).T
                else:
                    u = tl.reshape(b_desc.load([g, k0, n0 + N]), (BLOCK_K, BLOCK_N))
                if UPCAST:
                    u = u.to(tl.float32)
                acc_up = tl.dot(x, u, acc_up)
        if TAIL_SPLIT > 1:
            finish, acc = tail_finish(acc, ws_ptr, count_ptr, slot, counter, split, sliced, BLOCK_M, BLOCK_N)
            end = tl.where(finish, end, m0)  # the slices that do not finish store no row
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = (offs_m < end)[:, None] & (offs_n < N)[None, :]
        if HAS_BIAS:
            c_ptrs = bias_ptr + g.to(tl.int64) * s_cg + offs_n[None, :] * s_cn
            c_ok = (offs_n < N)[None, :] & live
            acc += tl.load(c_ptrs, mask=c_ok, other=0.0).to(tl.float32)
            if GATED:
                acc_up += tl.load(c_ptrs + UPC, mask=c_ok, other=0.0).to(tl.float32)
        acc = apply_activation(acc, ACTIVATION)
        if GATED:
            acc = acc * acc_up
        acc = tl.where(live, acc, 0.0)  # the tail's rows: zeros, whatever the activation of zero
        o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * s_om + offs_n[None, :] * s_on
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# --- host side ---------------------------------------------------------------------------------------------


def _stride(t: torch.Tensor, dim: int) -> int:
    """t's stride along ``dim``, or (a dim of one: never stepped) the smallest TMA takes."""
    return t.stride(dim) if t.shape[dim] > 1 else 16 // t.element_size()


def why_not(p: GroupedProblem) -> str | None:
    """None when this kernel takes ``p``; otherwise why not."""
    reason = why_not_tma()
    if reason is not None:
        return reason
    return operands_reason(p)


def operands_reason(p: GroupedProblem) -> str | None:
    """Why TMA cannot move ``p``'s operands as the MoE forward's kernels describe them (a ``[M, K]``, b ``[G, K, N]``
    or ``[G, N, K]``), or None: also kernel ``gluon``'s checks."""
    if p.layout != "2d3d":
        return f"takes the 2-D x 3-D product (the MoE forward) only, not {p.layout}"
    if p.dtype not in (torch.float16, torch.bfloat16):
        return f"takes fp16 and bf16 operands, not {p.dtype}"
    a, b = p.a, p.b
    if p.K == 0:
        return "K is 0 (a descriptor needs a dimension of at least one)"
    if p.groups == 0:
        # TMA takes no dimension of size 0: b's descriptor [G, ...] (made on the device for tma) needs G >= 1
        return "no groups (a descriptor of b needs at least one)"
    if any(t.stride(d) == 0 and t.shape[d] > 1 for t in (a, b) for d in range(t.dim())):
        return "an operand is broadcast (a stride of 0): TMA reads each row from its own address"
    if a.stride(1) != 1 and a.shape[1] > 1:
        return "a is not row-major (its K stride is not 1)"
    if b.stride(2) != 1 and b.stride(1) != 1:
        return "b has no unit stride along K or N"
    if not tma_aligned(a, _stride(a, 0)):
        return "a's base or row stride is not 16-byte aligned"
    b_nk = b.stride(2) != 1
    if not tma_aligned(b, _stride(b, 0), _stride(b, 2 if b_nk else 1)):
        return "b's base or strides are not 16-byte aligned"
    if p.gated and not b_nk and p.N * b.element_size() % 16:
        # the up half's boxes start N columns into b's contiguous rows: a box not 16-byte aligned there faults
        return (f"the up half of a gated b [G, K, 2N] starts N = {p.N} columns into its rows, not 16-byte aligned "
                f"(an illegal instruction on the H200)")
    return None


def run(p: GroupedProblem, config: dict | None = None) -> None:
    reason = why_not(p)
    if reason is not None:
        raise NotApplicable(f"grouped kernel 'tma' does not take this problem: {reason}")
    if p.M == 0 or p.N == 0:
        return
    cfg = dict(FLATTEN=False, TAIL_SPLIT=1) | dict(config or tma_config(p))
    warps, stages = cfg.pop("num_warps", 8), cfg.pop("num_stages", 4)
    tail_split = cfg["TAIL_SPLIT"]
    if not isinstance(tail_split, int) or tail_split < 1:
        raise ValueError(f"TAIL_SPLIT must be a positive int, got {tail_split!r}")
    if tail_split > 1 and (p.gated or cfg["FLATTEN"]):
        # (the gate's second accumulator has no slot; the fused loop needs one K range for every unit)
        raise ValueError("TAIL_SPLIT applies to the plain product with FLATTEN off")
    # programs an SM (a config key for candidate tools: two smaller tiles' programs resident on an SM overlap one's
    # epilogue with the other's loads, shared memory permitting, else the second waits); the interpreter runs
    # this many programs in all (one by default), so a test walks the units with a stride
    per_sm = cfg.pop("PROGRAMS_PER_SM", 1)
    if not isinstance(per_sm, int) or per_sm < 1:
        raise ValueError(f"PROGRAMS_PER_SM must be a positive int, got {per_sm!r}")
    units = row_tiles(p.M, p.groups, cfg["BLOCK_M"]) * cdiv(p.N, cfg["BLOCK_N"])
    programs = min(units, per_sm * (1 if interpreting() else sm_count(p.out.device)))
    a, b, out, bias = p.a, p.b, p.out, p.bias
    b_nk = b.stride(2) != 1
    c = (0, 0)
    if bias is not None:
        c = (bias.stride(0), bias.stride(1)) if bias.dim() == 2 else (0, bias.stride(0))
    up_bias = p.N * c[1] if p.gated and bias is not None else 0
    ensure_allocator()
    ws, count = out, out  # (never read without the tail split)
    if tail_split > 1:
        # a slot a program at most (a wave's slices) and a counter a sliced unit
        ws, count = split_workspace(out.device, programs * cfg["BLOCK_M"] * cfg["BLOCK_N"], programs,
                                    tag="grouped_tma")
    args = (a, b, out, bias if bias is not None else out, p.offs, ws, count, p.groups, p.M, p.N, p.K, b.shape[2],
            programs, _stride(a, 0), _stride(b, 0), _stride(b, 2 if b_nk else 1), out.stride(0), out.stride(1), *c,
            up_bias)
    flags = dict(B_NK=b_nk, GP=_pow2(p.groups), HAS_BIAS=bias is not None, GATED=p.gated, ACTIVATION=p.activation,
                 UPCAST=interpreting() and p.dtype == torch.bfloat16, STAGES=stages,
                 TAIL_MIN_STEPS=configs.TMA_TAIL_MIN_STEPS, **cfg, num_warps=warps, num_stages=stages)
    launch(grouped_tma_kernel, (programs,), args, flags, **workspace_launch(out, tail_split, ws, count))
