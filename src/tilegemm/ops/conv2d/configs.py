"""Block sizes, warps and pipeline depths for the conv2d kernels: a small table by shape class, no timing.

Every config is a plain dict of the kernel's constexprs plus ``num_warps``/``num_stages``. Under the
interpreter the tiles are small enough that tests cross tile edges, and few enough that they run in seconds
(the interpreter's cost is per program and loop step, nearly whatever the block size).
"""

from __future__ import annotations

import torch

from tilegemm.core.runtime import interpreting
from tilegemm.ops.conv2d.problem import Geometry


def _cfg(bm, bn, bk, warps, stages, group_m=8, **extra) -> dict:
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages, **extra)


def _pow2_at_least(n: int, lo: int, hi: int) -> int:
    """The smallest power of two >= n, clamped to [lo, hi]."""
    p = lo
    while p < n and p < hi:
        p *= 2
    return p


def _gemm_tile(M: int, N: int, K_inner: int, dtype: torch.dtype) -> dict:
    """A tile for an implicit GEMM of M rows (pixels), N columns (channels) and a K loop whose inner step walks
    ``K_inner`` contiguous channels. 16-bit: 64-wide K steps where the channels allow (16-byte loads, full
    wgmma K); fp32 takes twice the shared memory per element, so 32-wide ones."""
    wide = 2 if dtype == torch.float32 else 1
    bk = _pow2_at_least(K_inner, 16, 64 // wide)
    bn = _pow2_at_least(N, 16, 128)
    bm = 128 if M >= 4096 else 64
    warps = 8 if bm * bn >= 128 * 128 else 4
    stages = 3 if wide == 2 else 4
    return _cfg(bm, bn, bk, warps, stages)


def forward_config(g: Geometry, dtype: torch.dtype) -> dict:
    """Implicit-GEMM forward. With fewer than 16 channels per group (the stem's C=3) the K loop walks
    (r, s, c) as one flat index, so a 7x7x3 filter takes three 64-wide steps instead of 49 mostly-masked ones."""
    flat = g.Cg < 16
    if interpreting():
        return _cfg(64, 32, 16, 4, 1, FLAT_K=flat)
    M = g.N * g.P * g.Q
    cfg = _gemm_tile(M, g.Kg, 32 if flat else g.Cg, dtype)
    if flat:
        # every element of the [BM, BK] tile computes its own (r, s, c) and address: with 4 warps the 7x7x3
        # stem spilled 1.2 KB a thread (ptxas, sm_90, 128x64x64 fp16); 8 warps and BK=32 halve the per-thread share
        cfg["num_warps"] = 8
    cfg["FLAT_K"] = flat
    return cfg


def dgrad_config(g: Geometry, dtype: torch.dtype) -> dict:
    """Data gradient: M = N*H*W input pixels, N = C/groups, the K loop over (r, s, K/groups)."""
    if interpreting():
        return _cfg(64, 32, 16, 4, 1)
    if dtype == torch.float32 or g.R * g.S == 1:
        return _gemm_tile(g.N * g.H * g.W, g.Cg, g.Kg, dtype)
    # 16-bit with several taps: 64 x 128 tiles with 4 warps and 3 stages (128 pixels where the channels are
    # few: the stem's 3). Over ResNet-50's layers that reach this kernel on Hopper (the strided ones per phase),
    # each layer's best of 54 configs ran 0.64x cuDNN and the 128 x 128 x 8-warp rule 0.54x; this one was
    # within 5% of each best on the 3x3 layers (H200, CUDA graphs; benchmarks/results/2026-11-24-h200/b128749/).
    # The strided 1x1 layers (one tap, a long K loop over the channels) keep 128 x 128: 64 x 128 ran 20-30%
    # slower there (cd4832f/).
    bn = _pow2_at_least(g.Cg, 16, 128)
    return _cfg(128 if bn <= 32 else 64, bn, _pow2_at_least(g.Kg, 16, 64), 4, 3)


def wgrad_columns(g: Geometry, flat: bool) -> tuple[int, int]:
    """(the weight gradient's tile columns, its taps along grid axis 1 a group): C/groups and R*S, or, FLAT,
    (r, s, c) as one index and one tap."""
    return (g.R * g.S * g.Cg, 1) if flat else (g.Cg, g.R * g.S)


def wgrad_config(g: Geometry, dtype: torch.dtype, sms: int) -> dict:
    """Weight gradient: a [K/groups, C/groups] tile per (r, s, group), the K loop over N*P*Q pixels, split
    over ``SPLIT`` programs (fp32 partial tiles, added in order by the last to arrive) so that small filters
    still fill the GPU."""
    # Fewer than 16 channels a group (the stem's C=3): the tile's columns are (r, s, c) as one index (FLAT), so
    # dy is read once for the whole filter instead of once a tap for 3 useful columns in 16.
    flat = g.Cg < 16 and g.R * g.S > 1
    cols, taps = wgrad_columns(g, flat)
    if interpreting():
        cfg = _cfg(32, 32, 64, 4, 1)
    else:
        wide = 2 if dtype == torch.float32 else 1
        bm = _pow2_at_least(g.Kg, 16, 128)
        bn = _pow2_at_least(cols, 16, 64 if flat else 128)
        # 8 warps: its pointer tiles run along the pixels (no contiguity), and with 4 warps the 64x64 fp16 tile
        # spilled (ptxas, sm_90)
        cfg = _cfg(bm, bn, 64 // wide, 8, 3 if wide == 2 else 4)
    cfg["FLAT"] = flat
    tiles = -(-g.Kg // cfg["BLOCK_M"]) * -(-cols // cfg["BLOCK_N"]) * taps * g.groups
    pixels = g.N * g.P * g.Q
    # Enough programs for two waves, but each slice at least 8 K steps long (fewer and the partial sums cost
    # more memory traffic than they save).
    want = max(1, -(-2 * sms // tiles))
    most = max(1, pixels // (8 * cfg["BLOCK_K"]))
    cfg["SPLIT"] = min(want, most, 64)
    return cfg


# The depthwise forward is bound by its load instructions, not by DRAM: each tap of a [BM, BN] tile is one
# load of activations and one of weights. With the weight tap-major (16-byte loads of a tap's channels) and
# the taps unrolled (all loads of a tile in flight), 64 pixels x 32 channels on 4 warps ran best or within a
# few percent of best on every layer timed (MobileNetV2's nine at batch 64, 5x5 and dilated layers; H200,
# CUDA graphs, research/explore_depthwise.py): 1.2x-1.5x the [K, R, S]-ordered, rolled loop's time.
_DEPTHWISE_UNROLL_TAPS = 49  # up to 7x7 filters unrolled; larger ones loop (compile time)


def depthwise_fwd_config(g: Geometry, dtype: torch.dtype) -> dict:
    """The depthwise forward's tile (see above)."""
    unroll = g.R * g.S <= _DEPTHWISE_UNROLL_TAPS  # the interpreter too: the suite runs both forms
    if interpreting():
        return dict(BLOCK_M=32, BLOCK_N=16, UNROLL=unroll, num_warps=4, num_stages=1)
    return dict(BLOCK_M=64, BLOCK_N=_pow2_at_least(g.K, 16, 32), UNROLL=unroll, num_warps=4, num_stages=2)


# Stride-1 depthwise forwards run depthwise_rows_kernel: a program owns BLOCK elements of flattened
# channels-last output rows and rolls down ROWS_PER rows, the weights of its elements in registers (R*S * BLOCK
# / threads fp32 values a thread: hence the cap on taps; larger filters take the pixel kernel). Timed on
# MobileNetV2's six stride-1 layers at batch 64 and a 5x5 layer (H200, CUDA graphs,
# research/explore_depthwise_flat.py, benchmarks/results/2026-11-25-h200/ed547a3/): four elements a thread
# (BLOCK 256 on 2 warps, 72-92 registers) ran best or within 5% of best almost everywhere, eight (150+
# registers, a third of the programs an SM) up to 1.5x slower on the small images; 16-64 rows a program within
# a few percent of each other, 4-8 up to 1.6x slower (halo rows and per-program setup). The loop's form by
# image height: from 48 rows Triton's pipeliner with 3 stages (cp.async through shared memory: more bytes in
# flight) ran 1.2x-1.25x faster than loads held a row ahead in registers (32 channels at 112x112: 39.8 against
# 49.2 us; 144 at 56x56 48.4 against 60.8), below it the register form, with fewer instructions a row, ran
# 1.05x-1.1x faster (384 at 14x14: 9.0 against 10.0 us; 960 at 7x7 8.2 against 8.7; 5x5 240 at 28x28 26.1
# against 28.1); 192 at 28x28 tied (15.6 / 15.7). Against the pixel kernel: 1.2x-1.6x on each of them.
DEPTHWISE_ROWS_MAX_TAPS = 25
_DEPTHWISE_PIPELINE_ROWS = 48


def depthwise_rows_config(g: Geometry, dtype: torch.dtype) -> dict:
    """depthwise_rows_kernel's config (see above); small blocks under the interpreter."""
    pipeline = g.P >= _DEPTHWISE_PIPELINE_ROWS
    if interpreting():
        return dict(BLOCK=32, ROWS_PER=4, PIPELINE=pipeline, STAGES=1, num_warps=4)
    return dict(BLOCK=256, ROWS_PER=32, PIPELINE=pipeline, STAGES=3 if pipeline else 1, num_warps=2)


def depthwise_config(g: Geometry, dtype: torch.dtype) -> dict:
    """The depthwise gradients' tile: [BLOCK_M pixels, BLOCK_N channels], channels contiguous."""
    if interpreting():
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    bn = _pow2_at_least(g.K, 16, 64)
    return dict(BLOCK_M=64 if bn == 64 else 128, BLOCK_N=bn, num_warps=4, num_stages=2)


# --- tma_implicit_gemm (ops/conv2d/tma_fwd.py) ----------------------------------------------------------------
#
# A cost model rather than a table: the layers of a network differ in image size, channels and filter, and the
# time of a tile choice follows from a few counts. Fitted to ResNet-50's 22 non-stem layers on an H100 (every
# config of 64/128 pixels x 64/128 channels x 3-8 ring slots timed from CUDA graphs,
# research/explore_conv2d_tma.py, benchmarks/results/2026-11-24-h100/tma-configs/): the model's picks ran
# 0.93x of cuDNN in geomean where the best config of each layer ran 0.97x and one fixed 128x128 tile 0.89x.
# What it says: a program holds an SM's tensor cores better the bigger its tile (128x128 reads the fewest
# operand bytes per MMA); one program alone on an SM waits on TMA latency, two mostly hide it; and tiles come
# in waves of SMs x programs-per-SM.
_TILE_EFFICIENCY = {(128, 128): 1.0, (128, 64): 0.6, (64, 128): 0.6, (64, 64): 0.4}
_ALONE = {1: 0.5, 2: 0.7}  # throughput of an SM running 1 or 2 programs (3 or more: 1.0)
_SMEM = 228 * 1024


def _patch(g: Geometry, rows: int) -> tuple[int, int, int, int]:
    """(BI, BH, BW, tiles) of the patch of ``rows`` output pixels (BI images of BH x BW, powers of two) that
    covers the N images of P x Q output pixels in the fewest tiles; ties go to the wider patch (longer runs
    of contiguous pixels), then to fewer images."""
    best = None
    bw = 1
    while bw <= min(rows, 64):
        bh = 1
        while bw * bh <= rows:
            bi = rows // (bw * bh)
            tiles = -(-g.N // bi) * -(-g.P // bh) * -(-g.Q // bw)
            key = (tiles, -bw, bi)
            if best is None or key < best[0]:
                best = (key, (bi, bh, bw, tiles))
            bh *= 2
        bw *= 2
    return best[1]


def tma_estimate(g: Geometry, rows: int, bn: int, bk: int, stages: int, sms: int) -> float:
    """Relative time of a ``rows`` x ``bn`` tile with ``stages`` ring slots of ``bk`` channels (see above)."""
    tiles = _patch(g, rows)[3] * -(-g.Kg // bn) * g.groups
    steps = g.R * g.S * (g.Cg // bk)
    smem = stages * (rows + bn) * bk * 2 + 1024
    per_sm = max(1, min(_SMEM // smem, 2 if rows * bn >= 128 * 128 else 4))  # registers: 2 programs of 128x128
    together = min(per_sm, -(-tiles // sms))
    waves = -(-tiles // (sms * per_sm))
    eff = _TILE_EFFICIENCY.get((rows, bn), 0.4) * _ALONE.get(together, 1.0)
    return waves * together * steps * bk * rows * bn / eff


def tma_forward_config(g: Geometry, sms: int) -> dict:
    """``tma_implicit_gemm``'s config: patch of 64 or 128 pixels, 64 or 128 channels (fewer when the layer has
    fewer), the widest channel step (64, 32, 16) dividing C/groups, by :func:`tma_estimate`; three ring slots
    (two programs an SM), six where the tiles are no more than the SMs."""
    bk = 64 if g.Cg % 64 == 0 else 32 if g.Cg % 32 == 0 else 16
    bns = (64, 128) if g.Kg > 64 else (_pow2_at_least(g.Kg, 16, 64),)
    best = None
    for rows in (64, 128):  # ties: a taller channel tile (the weight's boxes are the smaller operand)
        for bn in sorted(bns, reverse=True):
            t = tma_estimate(g, rows, bn, bk, 3, sms)
            if best is None or t < best[0]:
                best = (t, rows, bn)
    _, rows, bn = best
    if g.R * g.S * (g.Cg // bk) <= 2:
        # One or two K steps (a 1x1 layer over few channels): the program is a load, an MMA and a store of its
        # output tile, and a ring of two slots holds all it can use. With full 64-channel steps the ring's
        # shared memory limits the programs an SM holds, and 64-pixel patches on two slots fit twice as many,
        # overlapping one's store with another's loads: on ResNet-50's three such layers (CUDA graphs,
        # research/explore_conv2d_tma.py --short, 2026-11-25-{h200,h100}/f7d14e6/) they ran 7.7 / 28.1 /
        # 14.9 us on the H200 where the model's 128-pixel tile with 3 slots ran 8.6 / 31.3 / 15.8 (H100: 7.6 /
        # 31.0 / 15.9 against 8.8 / 33.7 / 17.1). With 16-wide steps (MobileNetV2's 16 -> 96) the ring is small
        # at any depth and the smaller patch only cost more programs: 104.6 us against 80.1 for 128 pixels.
        if bk == 64:
            rows = 64
        bi, bh, bw, _ = _patch(g, rows)
        return dict(BI=bi, BH=bh, BW=bw, BLOCK_N=bn, BLOCK_K=bk, STAGES=2, num_warps=4)
    bi, bh, bw, pixel_tiles = _patch(g, rows)
    # One program an SM at most: nothing to share the SM with, so a deeper ring hides TMA's latency instead
    # (6 slots ran 5-7% faster than 3 on ResNet-50's 7x7 layers, H100).
    alone = pixel_tiles * -(-g.Kg // bn) * g.groups <= sms
    return dict(BI=bi, BH=bh, BW=bw, BLOCK_N=bn, BLOCK_K=bk, STAGES=6 if alone else 3, num_warps=4)


def tma_stem_config(g: Geometry, sms: int) -> dict:
    """The config of a stem's window convolution (:func:`tilegemm.ops.conv2d.tma_fwd.stem_geometry`): a short
    reduction (one to three K steps a filter row) over many pixels and few output channels, where a program's
    fixed costs weigh most. With at most 64 output channels and two waves of them, 256-pixel patches on 8 warps
    and 4 ring slots: on the H200 (CUDA graphs, `research/explore_conv2d_stem.py`) ResNet-50's stem ran
    57.9 us against 66.8 us for the cost model's 128-pixel tile on 4 warps (batch 32; 415 against 509 at 256),
    MobileNetV2's 3x3 stride-2 stem 42.1 against 57.0, VGG's 3x3 stride 1 (256 pixels as 8 x 32) 125 against 137."""
    cfg = tma_forward_config(g, sms)
    if g.Kg <= 64:
        bi, bh, bw, tiles = _patch(g, 256)
        if tiles * -(-g.Kg // cfg["BLOCK_N"]) >= 2 * sms:
            cfg.update(BI=bi, BH=bh, BW=bw, STAGES=4, num_warps=8)
    return cfg


# Stride-1 1x1 convolutions run as GEMMs (gemm_1x1) over at most this many output pixels, or when the TMA
# kernel would step through the channels in more than two steps narrower than 64. CUDA graphs,
# research/explore_conv2d_tma.py --short: on ResNet-50's 1x1 layers at 14x14 and 7x7, batch 32 (6272 and 1568
# pixels) the GEMM ran 256 -> 1024 in 8.9 us against the TMA kernel's 11.7, 1024 -> 256 8.5 / 9.4, 1024 -> 512
# 13.4 / 14.6, 512 -> 2048 8.8 / 9.6 (H200; H100 alike), and on MobileNetV2's at 14x14, batch 64 (12544
# pixels) 192 -> 64 3.7 / 4.5, 384 -> 64 4.3 / 5.9, 384 -> 96 5.4 / 6.2, 576 -> 96 6.7 / 8.4; at 28x28, batch 32
# (25088) tilegemm.matmul's choice lost 512 -> 256 (23.1 against 16.0; gluon_f16 wins it, below). With 16- or
# 32-channel steps (C not a multiple of 64) and a longer loop the GEMM ran 144 -> 24 at 56x56 in 22.9 us against
# 47.6, 96 -> 24 18.3 / 26.7, 144 -> 32 7.3 / 8.8, while with one such step the TMA kernel kept 32 -> 16 at
# 112x112 (43 against 50) and 16 -> 96 (80 against 98), and with 64-channel steps 192 -> 32 at 28x28 (5.3
# against 8.4)
# (2026-11-25-h200/f27e92f/tma-1x1-short-mobilenet-narrow.json, c6c0067/, f7d14e6/).
GEMM_1X1_PIXELS = 16384


# Stride-1 1x1 layers over more pixels, with at least 96 output channels and 2.5 waves of 128x128 output
# tiles, run as GEMMs through gluon_f16 (persistent, warp-specialized: the epilogue's TMA stores of one tile
# overlap the next tile's loads and MMAs; the TMA convolution kernel stores through registers after its last
# MMA, and these layers are output-bound). H200, CUDA graphs, research/explore_pointwise_narrow.py
# (2026-11-25-h200/cec87aa/pointwise.json), gluon_f16 against the route before: ResNet-50 (batch 32)
# 64 -> 256 at 56x56 19.4 us against 27.9 (cuDNN 24.3), 256 -> 128 22.6 / 26.4, 128 -> 512 at 28x28 10.5 /
# 14.9, 512 -> 256 13.0 / 16.5; MobileNetV2 (batch 64) 16 -> 96 at 112x112 73.2 / 80.6, 24 -> 144 at 56x56
# 42.7 / 53.1, 32 -> 192 at 28x28 9.6 / 12.0. It lost or tied with fewer tiles (512 -> 128 at 28x28: 9.6
# against 8.7; 512 -> 2048 at 7x7: 9.3 / 8.7), with its 128-wide tile over at most 64 output channels
# (256 -> 64 at 56x56: 20.5 / 19.9; 144 -> 24: 28.7 / 23.0; the narrower tiles below) and at 14x14 and below.
# Its 256x128 tile ran best but where its tiles fill the SMs' last round poorly (512 -> 256 at 28x28: 196
# tiles for 132 SMs, 16.7 us against 13.0 for 128x128 on six ring slots); 128x128 lost where K is a single
# step (16 -> 96: 101 us against 73).
GLUON_1X1_MIN_CHANNELS = 96
# Narrower layers (fewer output channels, or fewer input channels than a 64-deep K step) take gluon_f16 with
# its tile cut to them: a K step of the input channels' power of two (16, 32, at most 64) and, under 96 output
# channels, 256 rows by their power of two (16 to 128), where such tiles make 2.5 waves; the ring as deep as
# fits (at most 8 slots). H200, CUDA graphs, research/explore_gluon_narrow.py (2026-11-25-h200/ee2f5a0/
# gluon-narrow.json), against the route before: MobileNetV2 (batch 64) 32 -> 16 at 112x112 30.0 us against
# 43.3 (cuDNN 26.6; 256x16 in 32-deep steps), 96 -> 24 at 56x56 13.3 / 18.6 (14.5), 144 -> 24 21.6 / 23.4,
# 16 -> 96 at 112x112 63.6 / 73.1 (58.4; 16-deep steps), 24 -> 144 at 56x56 33.6 / 38.8 (28.8), 32 -> 192 at
# 28x28 8.5 / 9.1; 16-deep steps over more channels ran up to 1.5x slower. With 196 tiles (192 -> 32 at
# 28x28) the GEMM before stayed ahead (5.3 against 6.1). ResNet-50's 64 -> 64 and 256 -> 64 at 56x56 tied
# (6.9 / 6.8, 19.5 / 19.4 us; 2026-11-25-h200/b3d1e3b/gluon-narrow-resnet.json; the bench, with the L2
# cleared: 64 -> 64 11.7 against 12.6).
GLUON_1X1_WAVES = 2.5


def gluon_ring(bm: int, bn: int, bk: int, most: int = 8) -> int:
    """Ring slots (at most ``most``, at least 2) of a ``bm x bn`` gluon_f16 tile in ``bk``-deep K steps that
    fit beside its unshared output buffer: 3 for 256x128 and 6 for 128x128 in 64-deep steps (its shipped
    rings), 6 for 256x128 in 32-deep steps."""
    from tilegemm.core.hardware import ring_fits

    stages = most
    while stages > 2 and not ring_fits(bm, bn, bk, stages, bm * bn * 2):
        stages -= 1
    return stages


def pointwise_gluon_tile(g: Geometry, sms: int) -> tuple[int, int, int, int] | None:
    """(BLOCK_M, BLOCK_N, BLOCK_K, STAGES) of the gluon_f16 config a stride-1 1x1 layer runs as a GEMM with
    (see above), or None where it does not. Channel counts must be multiples of 8 (16-bit rows TMA can
    describe) and at least 16. Geometry only: :func:`tilegemm.ops.conv2d.gemm_1x1.gluon_usable` says whether
    a call's tensors let it run."""
    if not g.is_pointwise or g.C % 8 or g.K % 8 or g.C < 16 or g.K < 16:  # gluon_f16's TMA needs 16 of each
        return None
    m = g.N * g.P * g.Q
    if m <= GEMM_1X1_PIXELS:
        return None
    bk = _pow2_at_least(g.C, 16, 64)
    if g.K >= GLUON_1X1_MIN_CHANNELS:
        if -(-m // 128) * -(-g.K // 128) < GLUON_1X1_WAVES * sms:
            return None
        wide = -(-m // 256) * -(-g.K // 128)
        filled = wide / (-(-wide // sms) * sms)  # the share of the last round's SMs the 256x128 tiles keep busy
        bm, bn = (256, 128) if g.C <= 64 or filled >= 0.85 else (128, 128)
    else:
        bm, bn = 256, _pow2_at_least(g.K, 16, 128)
        if -(-m // bm) * -(-g.K // bn) < GLUON_1X1_WAVES * sms:
            return None
    return bm, bn, bk, gluon_ring(bm, bn, bk)


def pointwise_as_gemm(g: Geometry, sms: int, gluon: bool = True) -> bool:
    """True when a 1x1 convolution does better as a GEMM than through the TMA kernel (see above): stride 1 over
    at most :data:`GEMM_1X1_PIXELS` output pixels or with more than two channel steps narrower than 64, or
    (``gluon``: the call's tensors let gluon_f16 run it) where :func:`pointwise_gluon_tile` gives a tile; or
    (any stride) when the TMA kernel's chosen tiles leave SMs idle over a long reduction (32 steps or more),
    where the GEMM's split-K fills the GPU (ResNet-50's 2048 -> 512 at 7x7)."""
    if gluon and pointwise_gluon_tile(g, sms) is not None:
        return True
    if g.is_pointwise:
        bk = 64 if g.Cg % 64 == 0 else 32 if g.Cg % 32 == 0 else 16
        if g.N * g.P * g.Q <= GEMM_1X1_PIXELS or (bk < 64 and g.Cg // bk > 2):
            return True
    cfg = tma_forward_config(g, sms)
    tiles = _patch(g, cfg["BI"] * cfg["BH"] * cfg["BW"])[3] * -(-g.Kg // cfg["BLOCK_N"]) * g.groups
    return tiles < sms and g.R * g.S * (g.Cg // cfg["BLOCK_K"]) >= 32


# --- grouped_direct (ops/conv2d/grouped_direct.py) ------------------------------------------------------------
#
# A group of at most 8 input channels feeds a tl.dot tile (at least 16 deep and 16 wide) at most half its depth
# and, where K/groups is as small, half its width: a quarter or less of every tensor-core operation is used.
# On CUDA cores a 3x3 tap over 8 channels is 144 fp32 FLOPs an output element, a few times the time of the
# element's bytes, with no padding wasted: auto sends such layers (groups > 1, not depthwise) there
# (docs/conv2d.md, "Grouped convolutions with few channels a group").
GROUPED_DIRECT_AUTO_CHANNELS = 8
GROUPED_DIRECT_MOST_CHANNELS = 16  # what the kernels take: a group's channels are unrolled into the loop


def takes_grouped_direct(g: Geometry) -> bool:
    """Whether ``auto`` runs ``g``'s forward and data gradient by ``grouped_direct`` (see above)."""
    return (g.groups > 1 and not g.is_depthwise and g.Cg <= GROUPED_DIRECT_AUTO_CHANNELS
            and g.Kg <= 4 * GROUPED_DIRECT_AUTO_CHANNELS)
