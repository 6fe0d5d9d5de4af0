"""A MoE layer's token permutation and its inverse, each one launch: ``moe_route`` and ``moe_combine``.

Around its two grouped products a MoE layer sorts its (token, expert) pairs by expert, counts each expert's rows
(``offs``), gathers the tokens' rows in that order, and after the down projection weights each pair's row by its
routing weight and sums each token's ``k`` rows. In torch ops that is a sort, a search, an index, a multiply, a
zero fill, a scatter and a sum: about ten small kernels a layer, which at decode (a few rows an expert) take longer
than launching them is worth (docs/grouped.md, "The routing kernels"). Here:

- :func:`moe_route` ``(x [T, H], top_k_index [T, k], E) -> (x_sorted [T*k, H], offs [E] int32, pos [T*k] int32)``:
  pair ``p = t * k + j`` (token t's j-th choice) goes to row ``pos[p]`` of ``x_sorted``, pairs ordered by expert
  and, within an expert, by ``p`` (a stable sort); ``offs[e]`` counts the pairs of experts ``<= e``. Pairs whose
  expert is outside ``[0, E)`` (experts another rank holds) come last, past ``offs[-1]``, where the grouped
  products store zero rows. One kernel: each program ranks its own pairs against all of them (``pos[p]`` = the
  pairs of a smaller expert + the earlier pairs of the same one) and copies their rows; the first programs also
  count ``offs``. Its work grows as ``P^2``, so past :data:`KERNEL_MAX_PAIRS` pairs (prefill) the same results
  come from torch's sort.
- :func:`moe_combine` ``(y [T*k, H], pos, weights [T, k]) -> [T, H]``: ``out[t] = sum_j weights[t, j] *
  y[pos[t*k + j]]``, summed in fp32, one kernel at every size.

Both are ``torch.library`` ops with fakes and autograd (the backward in torch ops), so a compiled decode step
traces them and a CUDA graph captures them (no host sync).

- :func:`group_columns` ``(x [M, K], offs [E], perm [E, K]) -> [M, K]``: row r of expert g (by ``offs``) read through
  g's own input permutation, ``out[r, k] = x[r, perm[g, k]]``; the rows past ``offs[-1]`` copied as they are. What
  act-order 4-bit experts (GPTQ ``desc_act``: an input order an expert) multiply; one kernel, its gradient the same
  kernel with the inverse permutations.
"""

from __future__ import annotations

import torch

from tilegemm.core.checked import check_once
from tilegemm.core.runtime import cdiv, check_device, new_output, on_device
from tilegemm.core.torch_ops import lean_autograd
from tilegemm.ops.grouped.checks import check_offs

# Pairs (tokens x top-k) up to which moe_route runs its kernel; above, torch's sort (the kernel ranks each pair
# against every other: P^2 / PAIRS_A_PROGRAM programs' work). An estimate, checked by tools/moe_route_probe.py
# (docs/grouped.md, "The routing kernels").
KERNEL_MAX_PAIRS = 8192
PAIRS_A_PROGRAM = 16  # rows a program ranks and copies
RANK_CHUNK = 1024  # pairs compared at once (a [PAIRS_A_PROGRAM, RANK_CHUNK] tile)
EXPERTS_A_CHUNK = 16  # experts a program counts offs for
COPY_COLUMNS = 512  # columns of a row copied at once
COMBINE_COLUMNS = 1024  # columns of an output row a combine program writes


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def moe_route_kernel(ids_ptr, x_ptr, xs_ptr, offs_ptr, pos_ptr, P, E, H, TOPK, s_xt, s_xs,
                         BP: tl.constexpr, CHUNK: tl.constexpr, EB: tl.constexpr, BH: tl.constexpr):
        pid = tl.program_id(0)
        mine = pid * BP + tl.arange(0, BP)
        ok = mine < P
        # range checked in the ids' own dtype: narrowing int64 ids first would wrap some into [0, E)
        e_mine = tl.load(ids_ptr + mine, mask=ok, other=0)
        e_mine = tl.where((e_mine < 0) | (e_mine >= E), E, e_mine).to(tl.int32)  # outside [0, E): last
        rank = tl.zeros((BP,), dtype=tl.int32)
        for j0 in range(0, P, CHUNK):
            j = j0 + tl.arange(0, CHUNK)
            e_j = tl.load(ids_ptr + j, mask=j < P, other=0)
            e_j = tl.where((e_j < 0) | (e_j >= E), E, e_j).to(tl.int32)
            live = (j < P)[None, :]
            before = (e_j[None, :] < e_mine[:, None]) | ((e_j[None, :] == e_mine[:, None]) & (j[None, :] < mine[:, None]))
            rank += tl.sum((before & live).to(tl.int32), axis=1)
        tl.store(pos_ptr + mine, rank, mask=ok)
        # offs: experts pid * EB ... counted by the first cdiv(E, EB) programs
        e = pid * EB + tl.arange(0, EB)
        if pid * EB < E:
            count = tl.zeros((EB,), dtype=tl.int32)
            for j0 in range(0, P, CHUNK):
                j = j0 + tl.arange(0, CHUNK)
                e_j = tl.load(ids_ptr + j, mask=j < P, other=0)
                e_j = tl.where((e_j < 0) | (e_j >= E), E, e_j).to(tl.int32)
                count += tl.sum(((e_j[None, :] <= e[:, None]) & (j < P)[None, :]).to(tl.int32), axis=1)
            tl.store(offs_ptr + e, count, mask=e < E)
        # the rows: x[p // TOPK] -> x_sorted[pos[p]]
        src = x_ptr + (mine // TOPK).to(tl.int64)[:, None] * s_xt
        dst = xs_ptr + rank.to(tl.int64)[:, None] * s_xs
        for h0 in range(0, H, BH):
            h = h0 + tl.arange(0, BH)
            m = ok[:, None] & (h < H)[None, :]
            tl.store(dst + h[None, :], tl.load(src + h[None, :], mask=m), mask=m)

    @triton.jit
    def moe_combine_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, P, H, TOPK, s_y, s_wt, s_wk, s_o,
                           KP: tl.constexpr, BH: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)  # int64: weights may be a strided view whose offsets pass int32
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        j = tl.arange(0, KP)
        jm = j < TOPK
        p = tl.load(pos_ptr + t * TOPK + j, mask=jm, other=0)
        jm = jm & (p >= 0) & (p < P)  # pos outside y's rows adds nothing (not checked on the host: a sync)
        w = tl.load(w_ptr + t * s_wt + j.to(tl.int64) * s_wk, mask=jm, other=0.0).to(tl.float32)
        m = jm[:, None] & (h < H)[None, :]
        rows = tl.load(y_ptr + p.to(tl.int64)[:, None] * s_y + h[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * s_o + h, tl.sum(rows * w[:, None], axis=0).to(out_ptr.dtype.element_ty),
                 mask=h < H)

    @triton.jit
    def group_columns_kernel(x_ptr, offs_ptr, perm_ptr, out_ptr, M, K, E, s_xm, s_om,
                             EP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BK + tl.arange(0, BK)
        e = tl.arange(0, EP)
        ends = tl.load(offs_ptr + e, mask=e < E, other=2147483647)
        g = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)  # the experts that end at or before r
        live = g < E
        m = (rows < M)[:, None] & (cols < K)[None, :]
        src = tl.load(perm_ptr + tl.minimum(g, E - 1).to(tl.int64)[:, None] * K + cols[None, :],
                      mask=m & live[:, None], other=0)
        src = tl.where(live[:, None], src, cols[None, :])  # rows past offs[-1]: unpermuted
        inside = (src >= 0) & (src < K)  # perm's values are unchecked on the GPU (a sync): one outside x's row reads 0
        v = tl.load(x_ptr + rows.to(tl.int64)[:, None] * s_xm + src, mask=m & inside, other=0)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * s_om + cols[None, :], v, mask=m)

    return moe_route_kernel, moe_combine_kernel, group_columns_kernel


_KERNELS = None


def kernels():
    """(route, combine, group_columns): compiled on first use, so importing this module builds nothing."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _kernels()
    return _KERNELS


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def route_torch(x: torch.Tensor, ids: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moe_route` through torch's sort (large P, and the reference the tests compare the kernel with)."""
    P = ids.numel()
    k = ids.shape[-1] if ids.dim() > 1 else 1
    flat = ids.reshape(-1).to(torch.int64)
    keyed = torch.where((flat < 0) | (flat >= E), E, flat)
    ids_sorted, perm = torch.sort(keyed, stable=True)
    offs = torch.searchsorted(ids_sorted, torch.arange(E, device=ids.device, dtype=ids_sorted.dtype),
                              right=True).to(torch.int32)
    pos = torch.empty(P, dtype=torch.int32, device=ids.device)
    pos[perm] = torch.arange(P, dtype=torch.int32, device=ids.device)
    return x[perm // k], offs, pos


def route(x: torch.Tensor, ids: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward of :func:`moe_route` (arguments checked by the caller)."""
    P, H = ids.numel(), x.shape[1]
    if P > KERNEL_MAX_PAIRS or P == 0:
        return route_torch(x, ids, E)
    k = ids.shape[1]
    xs = new_output((P, H), x.dtype, x.device)
    offs = new_output((E,), torch.int32, x.device)
    pos = new_output((P,), torch.int32, x.device)
    ids = ids.reshape(-1)
    if ids.stride(0) != 1:
        ids = ids.contiguous()
    if x.stride(1) != 1 and H > 1:
        x = x.contiguous()
    route_kernel = kernels()[0]
    programs = max(cdiv(P, PAIRS_A_PROGRAM), cdiv(E, EXPERTS_A_CHUNK))
    with on_device(x.device), _one_launch():
        route_kernel[(programs,)](ids, x, xs, offs, pos, P, E, H, k, x.stride(0), xs.stride(0),
                                  BP=PAIRS_A_PROGRAM, CHUNK=min(RANK_CHUNK, _pow2(P)), EB=EXPERTS_A_CHUNK,
                                  BH=min(COPY_COLUMNS, _pow2(H)), num_warps=4)
    return xs, offs, pos


def _one_launch():
    """What tilegemm.core.launch.launch holds around a launch under the interpreter (these launch directly)."""
    import contextlib

    from tilegemm.core.runtime import interpreting, quiet_interpreter

    return quiet_interpreter() if interpreting() else contextlib.nullcontext()


def combine(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The forward of :func:`moe_combine` (arguments checked by the caller)."""
    T, k = weights.shape
    H = y.shape[1]
    out = new_output((T, H), y.dtype, y.device)
    if out.numel() == 0:
        return out
    if y.stride(1) != 1:
        y = y.contiguous()
    pos = pos if pos.stride(0) == 1 else pos.contiguous()
    combine_kernel = kernels()[1]
    bh = min(COMBINE_COLUMNS, _pow2(H))
    with on_device(y.device), _one_launch():
        combine_kernel[(T, cdiv(H, bh))](y, pos, weights, out, y.shape[0], H, k, y.stride(0), weights.stride(0),
                                         weights.stride(1), out.stride(0), KP=_pow2(k), BH=bh, num_warps=4)
    return out


GROUP_COLUMNS_ROWS = 16  # rows of a group_columns program
GROUP_COLUMNS_COLS = 128  # columns of a group_columns program


def columns(x: torch.Tensor, offs: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """The forward of :func:`group_columns` (arguments checked by the caller)."""
    M, K = x.shape
    E = perm.shape[0]
    out = new_output((M, K), x.dtype, x.device)
    if out.numel() == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    offs = offs if offs.stride(0) == 1 else offs.contiguous()
    perm = perm if perm.is_contiguous() else perm.contiguous()
    kernel = kernels()[2]
    with on_device(x.device), _one_launch():
        kernel[(cdiv(M, GROUP_COLUMNS_ROWS), cdiv(K, GROUP_COLUMNS_COLS))](
            x, offs, perm, out, M, K, E, x.stride(0), out.stride(0), EP=_pow2(E), BM=GROUP_COLUMNS_ROWS,
            BK=GROUP_COLUMNS_COLS, num_warps=4)
    return out


# --- the torch.library ops ---------------------------------------------------------------------------------------


@torch.library.custom_op("tilegemm::group_columns", mutates_args=())
def group_columns_op(x: torch.Tensor, offs: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    check_columns(x, offs, perm)  # called directly (torch.ops.tilegemm.group_columns) nothing else checks them
    return columns(x, offs, perm)


@group_columns_op.register_fake
def _fake_columns(x, offs, perm):
    check_columns(x, offs, perm)  # a traced call fails where it is traced (shapes, dtypes, devices: no values)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_columns(ctx, inputs, output):
    _, offs, perm = inputs
    ctx.save_for_backward(offs, perm)


def _backward_columns(ctx, grad):
    offs, perm = ctx.saved_tensors
    inverse = torch.empty_like(perm)
    inverse.scatter_(1, perm, torch.arange(perm.shape[1], device=perm.device).expand_as(perm).contiguous())
    return group_columns_op(grad.contiguous(), offs, inverse), None, None


group_columns_op.register_autograd(_backward_columns, setup_context=_setup_columns)


@torch.library.custom_op("tilegemm::moe_route", mutates_args=())
def moe_route_op(x: torch.Tensor, top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                        torch.Tensor]:
    # called directly (torch.ops.tilegemm.moe_route) nothing else checked them: a top_k_index of more tokens than
    # x's rows would read past x
    check_once(_check_route, x, top_k_index, num_experts)
    return route(x, top_k_index, num_experts)


@moe_route_op.register_fake
def _fake_route(x, top_k_index, num_experts):
    _check_route(x, top_k_index, num_experts)  # a traced call fails where it is traced (shapes, dtypes, devices)
    P = top_k_index.numel()
    return (x.new_empty((P, x.shape[1])), x.new_empty((num_experts,), dtype=torch.int32),
            x.new_empty((P,), dtype=torch.int32))


def _setup_route(ctx, inputs, output):
    x, top_k_index, _ = inputs
    ctx.save_for_backward(output[2])
    ctx.shape, ctx.k = x.shape, top_k_index.shape[1]


def _backward_route(ctx, grad_xs, grad_offs, grad_pos):
    (pos,) = ctx.saved_tensors
    T, H = ctx.shape
    g = grad_xs[pos.long()].view(T, ctx.k, H).float().sum(1).to(grad_xs.dtype)  # each token's k rows
    return g, None, None


moe_route_op.register_autograd(_backward_route, setup_context=_setup_route)


@torch.library.custom_op("tilegemm::moe_combine", mutates_args=())
def moe_combine_op(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    check_once(_check_combine, y, pos, weights)  # (called directly, nothing else checked them)
    return combine(y, pos, weights)


@moe_combine_op.register_fake
def _fake_combine(y, pos, weights):
    _check_combine(y, pos, weights)
    return y.new_empty((weights.shape[0], y.shape[1]))


def _setup_combine(ctx, inputs, output):
    y, pos, weights = inputs
    ctx.save_for_backward(y, pos, weights)


def _backward_combine(ctx, grad):
    y, pos, weights = ctx.saved_tensors
    T, k = weights.shape
    H = y.shape[1]  # named: a -1 cannot be inferred from 0 elements (T or k of 0)
    idx = pos.long()
    live = (idx >= 0) & (idx < y.shape[0])  # as the forward: pos outside y's rows adds nothing
    idx = torch.where(live, idx, 0)
    g = grad.float()
    gy = gw = None
    if ctx.needs_input_grad[0]:
        wl = torch.where(live.view(T, k), weights.float(), 0.0)
        rows = (wl.reshape(T, k, 1) * g[:, None, :]).reshape(T * k, H)
        # index_add: pos may name a row more than once (moe_combine takes any pos), each read adds its gradient
        gy = torch.zeros(y.shape, dtype=torch.float32, device=y.device).index_add_(0, idx, rows).to(y.dtype)
    if ctx.needs_input_grad[2]:
        gw = torch.where(live.view(T, k), (y[idx].float().view(T, k, H) * g[:, None, :]).sum(-1), 0.0)
        gw = gw.to(weights.dtype)
    return gy, None, gw


moe_combine_op.register_autograd(_backward_combine, setup_context=_setup_combine)
# the routing ops as every op: a recorded call's lean kernel, and the clear refusals of forward-mode AD and
# torch.func's gradient transforms, whose tangents and wrappers the ops would drop (core/torch_ops.py)
for _routing_op in (group_columns_op, moe_route_op, moe_combine_op):
    lean_autograd(_routing_op)


# --- public functions --------------------------------------------------------------------------------------------


def _check_route(x, top_k_index, num_experts):
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"moe_route: x must be a 2-D tensor [tokens, hidden], got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not isinstance(top_k_index, torch.Tensor) or top_k_index.dim() != 2 or top_k_index.shape[0] != x.shape[0]:
        raise ValueError(f"moe_route: top_k_index must be [tokens, k] with x's {x.shape[0]} tokens, got "
                         f"{tuple(top_k_index.shape) if isinstance(top_k_index, torch.Tensor) else top_k_index!r}")
    if top_k_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"moe_route: top_k_index must be int32 or int64, got {top_k_index.dtype}")
    if top_k_index.device != x.device:
        raise ValueError(f"moe_route: top_k_index is on {top_k_index.device}, x on {x.device}")
    if isinstance(num_experts, torch.SymInt):  # (a traced call's: the public call checked the int it traced)
        pass
    elif not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:  # (True is an int)
        kind = "" if isinstance(num_experts, int) and not isinstance(num_experts, bool) else \
            f" ({type(num_experts).__name__}, not a Python int)"
        raise ValueError(f"moe_route: num_experts must be a positive int, got {num_experts!r}{kind}")
    check_device("x", x.device)  # CPU tensors while kernels compile for the GPU: refused, not launched


def moe_route(x: torch.Tensor, top_k_index: torch.Tensor, num_experts: int):
    """``(x_sorted, offs, pos)``: the rows of ``x`` ``[T, H]`` for each of the ``T * k`` (token, expert) pairs of
    ``top_k_index`` ``[T, k]``, ordered by expert (stable); ``offs`` ``[num_experts]`` int32, the cumulative
    counts :func:`tilegemm.grouped_mm` takes; ``pos`` ``[T * k]`` int32, the row of pair ``t * k + j``. Experts
    outside ``[0, num_experts)`` sort last, past ``offs[-1]``. Differentiable in ``x``."""
    _check_route(x, top_k_index, num_experts)
    return moe_route_op(x, top_k_index, num_experts)


def moe_combine(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * y[pos[t * k + j]]`` ``[T, H]`` in ``y``'s dtype (summed in fp32): the
    inverse of :func:`moe_route`'s permutation, weighted; entries of ``pos`` outside ``[0, T * k)`` add nothing.
    Differentiable in ``y`` and ``weights``."""
    _check_combine(y, pos, weights)
    return moe_combine_op(y, pos, weights)


def _check_combine(y, pos, weights) -> None:
    if not all(isinstance(t, torch.Tensor) for t in (y, pos, weights)):
        raise TypeError("moe_combine: y, pos and weights must be tensors")
    if y.dim() != 2 or weights.dim() != 2 or pos.dim() != 1:
        raise ValueError(f"moe_combine: y [T*k, H], pos [T*k] and weights [T, k] expected, got "
                         f"{tuple(y.shape)}, {tuple(pos.shape)}, {tuple(weights.shape)}")
    if pos.numel() != weights.numel() or y.shape[0] != pos.numel():
        raise ValueError(f"moe_combine: y has {y.shape[0]} rows, pos {pos.numel()} entries and weights "
                         f"{weights.numel()}: all must be T*k")
    if pos.dtype != torch.int32:
        raise TypeError(f"moe_combine: pos must be int32 (as moe_route gives it), got {pos.dtype}")
    if not weights.is_floating_point():
        raise TypeError(f"moe_combine: weights must be floating point, got {weights.dtype}")
    if not y.is_floating_point():  # (summed in fp32: integers past 2^24 came back rounded)
        raise TypeError(f"moe_combine: y must be floating point (the experts' outputs), got {y.dtype}")
    if len({y.device, pos.device, weights.device}) != 1:
        raise ValueError(f"moe_combine: y, pos and weights on different devices ({y.device}, {pos.device}, "
                         f"{weights.device})")
    check_device("y", y.device)  # CPU tensors while kernels compile for the GPU: refused, not launched


def check_columns(x, offs, perm) -> None:
    """Raise TypeError/ValueError naming the bad argument of a ``group_columns`` call: shapes, dtypes, devices,
    and the values of ``offs`` and ``perm`` where reading them costs no device sync (plain CPU tensors, no tracer).
    The registered op and its fake run it, so ``torch.ops.tilegemm.group_columns`` called directly is checked."""
    if not all(isinstance(t, torch.Tensor) for t in (x, offs, perm)):
        raise TypeError(f"group_columns: x, offs and perm must be tensors, got {type(x).__name__}, "
                        f"{type(offs).__name__} and {type(perm).__name__}")
    if x.dim() != 2 or offs.dim() != 1 or perm.dim() != 2:
        raise ValueError(f"group_columns: x [M, K], offs [E] and perm [E, K] expected, got {tuple(x.shape)}, "
                         f"{tuple(offs.shape)}, {tuple(perm.shape)}")
    if perm.shape != (offs.shape[0], x.shape[1]):
        raise ValueError(f"group_columns: perm must be [E, K] = [{offs.shape[0]}, {x.shape[1]}] (offs' experts, x's "
                         f"columns), got {list(perm.shape)}")
    if offs.dtype != torch.int32 or perm.dtype != torch.int64:
        raise TypeError(f"group_columns: offs must be int32 and perm int64, got {offs.dtype} and {perm.dtype}")
    if len({x.device, offs.device, perm.device}) != 1:
        raise ValueError(f"group_columns: x, offs and perm on different devices ({x.device}, {offs.device}, "
                         f"{perm.device})")
    check_device("x", x.device)  # CPU tensors while kernels compile for the GPU: refused, not launched
    check_offs(offs, perm.shape[0], "perm.shape[0]", "x's rows: x.shape[0]", x.shape[0])
    K = x.shape[1]
    # perm's values where reading them stalls nothing (on the GPU the kernel reads an entry outside 0..K-1 as 0)
    if perm.device.type == "cpu" and perm.numel() and not torch.compiler.is_compiling() \
            and type(perm) in (torch.Tensor, torch.nn.Parameter) \
            and not torch.equal(perm.sort(-1).values, torch.arange(K).expand(perm.shape)):
        raise ValueError(f"group_columns: each row of perm must be a permutation of 0..{K - 1} (K = {K})")


def group_columns(x: torch.Tensor, offs: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``out[r, k] = x[r, perm[g, k]]`` for the rows r of expert g (``offs``, int32 cumulative ends, as
    :func:`tilegemm.grouped_mm` takes them); rows past ``offs[-1]`` unchanged. ``x`` ``[M, K]``, ``perm`` int64
    ``[E, K]``, each row a permutation of ``range(K)`` (its values and offs' checked on the CPU only: elsewhere that
    needs them on the host). What
    act-order stacked 4-bit experts multiply. Differentiable in ``x``."""
    if not all(isinstance(t, torch.Tensor) for t in (x, offs, perm)):  # (the op's schema refuses with a cast error)
        check_columns(x, offs, perm)
    return group_columns_op(x, offs, perm)  # the op checks the rest (:func:`check_columns`)
