"""Exploration: the warp-specialized promoted-fp8 Gluon kernel (``tilegemm.ops.matmul.gluon_fp8``) in
two-CTA clusters whose CTAs share B's tile through TMA multicast, the schedule cuBLAS runs for these
shapes on the H200 (``nvjet_sm90_qqtst_128x128_128x6_2x1_..._coopA``: 128x128x128 tiles, clusters 2x1).

The two CTAs of a cluster take M-adjacent 128x128 tiles, so they read the same B tile (128 columns of
the output by 128 K, K-major) every K step. Each CTA loads its own A rows and one half (64 rows of B^T)
of B's tile, multicast into both CTAs. That halves the L2-to-SM traffic for B: a K step moves 24 KB
into a CTA instead of 32 KB. fp8 needs that more than 16-bit (``research/cluster_f16.py``, where
multicast only won back what the cluster launch cost): its tensor cores eat K twice as fast, so a
128x128x128 fp8 tile asks L2 for a third more bytes a microsecond than the 256x128x64 16-bit tile.

The pieces Triton 3.6 lacks are those of ``cluster_f16`` (cluster launch by patching the compiled
kernel's metadata; the multicast copy, remote barrier arrives and cluster barriers in inline PTX;
shared-memory addresses from ``global_smem`` and offsets). One thing differs: A and B share one ring
buffer here ([STAGES, 256, 128], A rows 0..127 and B^T rows 128..255 of each slot), so that the ring is
the largest buffer and the allocator puts it at offset 0 (checked against the LLIR); A and B rings of
equal size would leave the order between them to the allocator.

Modes: ``mcast`` (B shared, each consumer releases its slot in both CTAs; ``remote`` is implied),
``own`` (clusters launched, each CTA loads all of B itself and releases only its own slot: what the
cluster launch costs by itself), and ``mcast=False, remote=True`` (the cross-CTA releases without the
sharing). ``split``: a consumer's two arrives come from two threads (the local one on the CTA path)
instead of one thread's two cluster-path arrives. ``forward``: the consumers release their own CTA's
slot only (a local arrive, off their critical path); the producer, once its consumers are done with a
slot, arrives on a "gate" barrier in both CTAs and waits on its own before refilling the slot.
"""

from __future__ import annotations

import re

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from tilegemm.jit.helpers import epilogue_tile, tile_origin

from cluster_f16 import (  # the inline-PTX pieces, the barrier offsets and the host descriptor, as there
    _arrive_cluster, _cluster_sync, _fence_init, _multicast_load, _offsets, _smem_base, encode_descriptor,
)

BLOCK = gl.constexpr(128)  # BLOCK_M = BLOCK_N = BLOCK_K
SLOT = gl.constexpr(2 * 128 * 128)  # bytes of one ring slot: A's tile then B^T's
HALF_B = gl.constexpr(128 * 128 // 2)  # bytes of half of B's tile (64 rows of B^T)


@gluon.jit
def _producer(b_half_desc, a_ptr, b_ptr, ring, ready, empty, gate, M, N, K, stride_am, stride_bn, ready_off,
              gate_off, clusters, STAGES: gl.constexpr, GROUP_M: gl.constexpr, MCAST: gl.constexpr,
              FORWARD: gl.constexpr):
    a_ty: gl.constexpr = a_ptr.dtype.element_ty
    b_ty: gl.constexpr = b_ptr.dtype.element_ty
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], a_ty)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], b_ty)
    pid = gl.program_id(0)
    rank = pid % 2
    cluster = pid // 2
    _cluster_sync(pid)
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK, BLOCK], a_layout)
    if not MCAST:
        b_desc = tma.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [BLOCK, BLOCK], b_layout)
    base = _smem_base(pid)
    desc = b_half_desc.to(gl.int64, bitcast=True)
    mask = gl.full([], 3, gl.int16)  # both CTAs of the cluster
    pairs_m = gl.cdiv(gl.cdiv(M, BLOCK), 2)
    tiles_n = gl.cdiv(N, BLOCK)
    steps = gl.cdiv(K, BLOCK)
    count = 0
    for pair in range(cluster, pairs_m * tiles_n, clusters):
        m0p, n0 = tile_origin(pair, pairs_m, tiles_n, GROUP_M, 2 * BLOCK, BLOCK)
        m0 = m0p + rank * BLOCK
        for ks in range(steps):
            slot = count % STAGES
            mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
            if FORWARD:
                # This CTA's consumers are done with the slot's previous use: say so in both CTAs' "gate",
                # then wait until the peer's producer has said the same. (The first lap has nothing to
                # release: an arrive there would complete the gate's phase a lap early.)
                if count >= STAGES:
                    _arrive_split(base + gate_off + slot * 8, 1 - rank)
                mbarrier.wait(gate.index(slot), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, SLOT)  # A from this CTA, B's halves from both
            k0 = ks * BLOCK
            tma.async_copy_global_to_shared(a_desc, [m0, k0], bar, ring.index(slot).slice(0, BLOCK))
            if MCAST:
                dst = base + slot * SLOT + SLOT // 2 + rank * HALF_B
                _multicast_load(dst, desc, k0, n0 + rank * (BLOCK // 2), base + ready_off + slot * 8, mask)
            else:
                tma.async_copy_global_to_shared(b_desc, [n0, k0], bar, _b_tile(ring, slot, b_ty))
            count += 1
    _cluster_sync(pid)


@gluon.jit
def _b_tile(ring, slot, b_ty: gl.constexpr):
    """Slot ``slot``'s B^T tile (rows 128..255 of the ring, which is typed as A) as B's fp8 type."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], b_ty)
    return ring.index(slot).slice(BLOCK, BLOCK)._reinterpret(b_ty, [BLOCK, BLOCK], layout)


@gluon.jit
def _arrive_split(bar, peer):
    """Thread 0 of the warp group arrives on barrier ``bar`` of this CTA, thread 32 (another warp) on the
    same barrier of CTA ``peer``: the local arrive takes the CTA path, the two go out side by side."""
    return gl.inline_asm_elementwise(
        """{
        .reg .pred p0, p1;
        .reg .b32 t, ra;
        mov.u32 t, %tid.x;
        and.b32 t, t, 127;
        setp.eq.u32 p0, t, 0;
        setp.eq.u32 p1, t, 32;
        mapa.shared::cluster.u32 ra, $1, $2;
        @p0 mbarrier.arrive.shared::cta.b64 _, [$1];
        @p1 mbarrier.arrive.shared::cluster.b64 _, [ra];
        mov.u32 $0, 0;
        }""",
        "=r,r,r", [bar, peer], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _release(empty, slot, base, empty_off, REMOTE: gl.constexpr, SPLIT: gl.constexpr):
    """This warp group is done reading ring slot ``slot``: tell the producer(s) that fill it."""
    if REMOTE:
        if SPLIT:
            _arrive_split(base + empty_off + slot * 8, 1 - gl.program_id(0) % 2)
        else:
            _arrive_cluster(base + empty_off + slot * 8, 0, "cta")
            _arrive_cluster(base + empty_off + slot * 8, 1, "cta")
    else:
        mbarrier.arrive(empty.index(slot), count=1)


@gluon.jit
def _issue(count, partial, ready, ring, STAGES: gl.constexpr, ROW0: gl.constexpr, ROWS: gl.constexpr,
           B_TY: gl.constexpr):
    slot = count % STAGES
    mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
    a = ring.index(slot).slice(ROW0, ROWS)
    b = _b_tile(ring, slot, B_TY).permute((1, 0))
    partial = warpgroup_mma(a, b, partial, use_acc=False, is_async=True)
    return count + 1, partial


@gluon.jit
def _consumer(ring, o_bufs, ready, empty, b_ptr, out_ptr, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
              M, N, K, stride_om, stride_cm, stride_cn, stride_bias, stride_sa, stride_sb, alpha, beta,
              empty_off, clusters,
              HAS_C: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
              HAS_SCALE_A: gl.constexpr, HAS_SCALE_B: gl.constexpr,
              STAGES: gl.constexpr, GROUP_M: gl.constexpr, REMOTE: gl.constexpr, SPLIT: gl.constexpr,
              WG: gl.constexpr):
    """gluon_fp8's consumer warp group (64 rows, two partials, promotion overlapped with the next step's
    MMAs) over this CTA's tile of each pair, releasing slots through :func:`_release`."""
    ROWS: gl.constexpr = BLOCK // 2
    ROW0: gl.constexpr = WG * ROWS
    B_TY: gl.constexpr = b_ptr.dtype.element_ty
    pid = gl.program_id(0)
    rank = pid % 2
    cluster = pid // 2
    _cluster_sync(pid)
    base = _smem_base(pid)
    o_ty: gl.constexpr = out_ptr.dtype.element_ty
    o_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK], o_ty)
    o_desc = tma.make_tensor_descriptor(out_ptr, [M, N], [stride_om, 1], [ROWS, BLOCK], o_layout)
    o_smem = o_bufs.index(WG)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK, 32])
    pairs_m = gl.cdiv(gl.cdiv(M, BLOCK), 2)
    tiles_n = gl.cdiv(N, BLOCK)
    steps = gl.cdiv(K, BLOCK)
    count = 0
    for pair in range(cluster, pairs_m * tiles_n, clusters):
        acc = gl.zeros((ROWS, BLOCK), dtype=gl.float32, layout=acc_layout)
        p0 = gl.zeros((ROWS, BLOCK), dtype=gl.float32, layout=acc_layout)
        p1 = gl.zeros((ROWS, BLOCK), dtype=gl.float32, layout=acc_layout)
        prev = count % STAGES
        count, q0 = _issue(count, p0, ready, ring, STAGES, ROW0, ROWS, B_TY)
        for j in range((steps - 1) // 2):
            cur = count % STAGES
            count, q1 = _issue(count, p1, ready, ring, STAGES, ROW0, ROWS, B_TY)
            p0 = warpgroup_mma_wait(1, deps=(q0,))
            _release(empty, prev, base, empty_off, REMOTE, SPLIT)
            acc += p0
            prev = cur
            cur = count % STAGES
            count, q0 = _issue(count, p0, ready, ring, STAGES, ROW0, ROWS, B_TY)
            p1 = warpgroup_mma_wait(1, deps=(q1,))
            _release(empty, prev, base, empty_off, REMOTE, SPLIT)
            acc += p1
            prev = cur
        if (steps - 1) % 2 == 1:
            cur = count % STAGES
            count, q1 = _issue(count, p1, ready, ring, STAGES, ROW0, ROWS, B_TY)
            p0 = warpgroup_mma_wait(1, deps=(q0,))
            _release(empty, prev, base, empty_off, REMOTE, SPLIT)
            acc += p0
            p1 = warpgroup_mma_wait(0, deps=(q1,))
            _release(empty, cur, base, empty_off, REMOTE, SPLIT)
            acc += p1
        else:
            p0 = warpgroup_mma_wait(0, deps=(q0,))
            _release(empty, prev, base, empty_off, REMOTE, SPLIT)
            acc += p0

        m0p, n0 = tile_origin(pair, pairs_m, tiles_n, GROUP_M, 2 * BLOCK, BLOCK)
        m0 = m0p + rank * BLOCK
        offs_m = m0 + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
        offs_n = n0 + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, acc_layout))
        acc = epilogue_tile(acc, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr, offs_m, offs_n, M, N,
                            stride_cm, stride_cn, stride_bias, stride_sa, stride_sb, alpha, beta,
                            HAS_C, HAS_BIAS, ACTIVATION, HAS_SCALE_A, HAS_SCALE_B)
        tma.store_wait(pendings=0)
        o_smem.store(acc.to(o_ty))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [m0 + ROW0, n0], o_smem)
    tma.store_wait(pendings=0)
    _cluster_sync(pid)


@gluon.jit
def matmul_fp8_cluster_kernel(
    b_half_desc, a_ptr, b_ptr, out_ptr, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
    M, N, K,
    stride_am, stride_bn, stride_om,
    stride_cm, stride_cn, stride_bias, stride_sa, stride_sb,
    alpha, beta,
    ready_off, empty_off, gate_off, clusters,
    HAS_C: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
    HAS_SCALE_A: gl.constexpr, HAS_SCALE_B: gl.constexpr,
    STAGES: gl.constexpr, GROUP_M: gl.constexpr, MCAST: gl.constexpr, REMOTE: gl.constexpr,
    SPLIT: gl.constexpr, FORWARD: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    ty: gl.constexpr = a_ptr.dtype.element_ty
    o_ty: gl.constexpr = out_ptr.dtype.element_ty
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK, BLOCK], ty)
    ring = gl.allocate_shared_memory(ty, [STAGES, 2 * BLOCK, BLOCK], layout)
    o_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK // 2, BLOCK], o_ty)
    o_bufs = gl.allocate_shared_memory(o_ty, [2, BLOCK // 2, BLOCK], o_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    gate = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=4 if REMOTE else 2)  # two consumer warp groups per reading CTA
    for i in gl.static_range(STAGES):
        mbarrier.init(gate.index(i), count=2)  # (FORWARD) both CTAs' producers
    _fence_init(gl.program_id(0))
    gl.warp_specialize([
        (_consumer, (ring, o_bufs, ready, empty, b_ptr, out_ptr, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
                     M, N, K, stride_om, stride_cm, stride_cn, stride_bias, stride_sa, stride_sb, alpha, beta,
                     empty_off, clusters, HAS_C, HAS_BIAS, ACTIVATION, HAS_SCALE_A, HAS_SCALE_B,
                     STAGES, GROUP_M, REMOTE, SPLIT, 0)),
        (_consumer, (ring, o_bufs, ready, empty, b_ptr, out_ptr, c_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
                     M, N, K, stride_om, stride_cm, stride_cn, stride_bias, stride_sa, stride_sb, alpha, beta,
                     empty_off, clusters, HAS_C, HAS_BIAS, ACTIVATION, HAS_SCALE_A, HAS_SCALE_B,
                     STAGES, GROUP_M, REMOTE, SPLIT, 1)),
        (_producer, (b_half_desc, a_ptr, b_ptr, ring, ready, empty, gate, M, N, K, stride_am, stride_bn, ready_off,
                     gate_off, clusters, STAGES, GROUP_M, MCAST, FORWARD)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
        mbarrier.invalidate(gate.index(i))


# --- host side ---------------------------------------------------------------------------------------------

_compiled = {}


def _gate_offset(llir: str, stages: int) -> int:
    """gate[0]'s offset: the first barrier initialised after the 2 * stages of the ready and empty rings."""
    inits = re.findall(r'mbarrier\.init\.shared::cta\.b64 \[\$1\], (\d+);", "b,r"\(i1 %[\w.]+, ptr addrspace\(3\) '
                       r'(?:getelementptr \(i8, ptr addrspace\(3\) )?@global_smem(?:, i32 (\d+)\))?', llir)
    assert len(inits) == 3 * stages and all(n == "2" for n, _ in inits[2 * stages:]), inits
    return int(inits[2 * stages][1])


def prepare(a, b, out, stages=6, clusters=66, mcast=True, remote=None, split=False, forward=False,
            scale_a=None, scale_b=None):
    """A function that launches out = scale_a * scale_b * (a @ b) with the cluster kernel (a row-major
    [M, K] fp8, b [K, N] column-major fp8, per-tensor scales or none) in ``clusters`` clusters of two
    CTAs, and the descriptor buffer it reads (keep it alive while the function is used)."""
    M, K = a.shape
    N = b.shape[1]
    assert a.stride(1) == 1 and b.stride(0) == 1
    remote = (mcast and not forward) if remote is None else remote
    assert remote or forward or not mcast, "a shared slot must be released in both CTAs"
    assert not (remote and forward)
    desc = encode_descriptor(b.T, [BLOCK.value // 2, BLOCK.value])
    has_s = scale_a is not None
    sa = scale_a if has_s else out
    sb = scale_b if has_s else out
    kw = dict(HAS_C=False, HAS_BIAS=False, ACTIVATION="none", HAS_SCALE_A=has_s, HAS_SCALE_B=has_s,
              STAGES=stages, GROUP_M=4, MCAST=mcast, REMOTE=remote, SPLIT=split, FORWARD=forward, CONSUMER_REGS=232, PRODUCER_REGS=40,
              num_warps=4)
    args = [desc, a, b, out, out, out, sa, sb, M, N, K, a.stride(0), b.stride(1), out.stride(0), 0, 0, 0, 0, 0,
            1.0, 0.0]
    key = (a.dtype, b.dtype, out.dtype, has_s, stages, mcast, remote, split, forward)
    if key not in _compiled:
        # Placeholder offsets that no specialization keys on (not 1, not a multiple of 16).
        compiled = matmul_fp8_cluster_kernel.warmup(*args, 8, 8, 8, 3, grid=(1,), **kw)
        llir = compiled.asm["llir"]
        offs = (*_offsets(llir, 4 if remote else 2), _gate_offset(llir, stages))
        # The ring is the largest buffer, so it sits at offset 0 and the output buffers right after it.
        assert f"@global_smem, i32 {stages * SLOT.value})" in llir, "ring not at offset 0"
        compiled._init_handles()
        nw, _, shared = compiled.packed_metadata
        compiled.packed_metadata = (nw, 2, shared)  # clusters of two along x
        compiled.run.num_ctas = 2
        _compiled[key] = (compiled, offs)
    compiled, offs = _compiled[key]
    names = matmul_fp8_cluster_kernel.arg_names
    params = args + [*offs, clusters] + [kw[n] for n in names[len(args) + 4:]]
    runner = compiled[(clusters, 1, 1)]
    return lambda: runner(*params), desc
