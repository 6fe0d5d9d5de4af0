"""Block sizes, warps and pipeline depths for the conv2d kernels: a small table by shape class, no timing.

Every config is a plain dict of the kernel's constexprs plus ``num_warps``/``num_stages``. Under the
interpreter the tiles are small enough that tests cross tile edges, and few enough that they run in seconds
(the interpreter's cost is per program and loop step, nearly whatever the block size).
"""

from __future__ import annotations

import torch

from tilegemm.core.hardware import ring_fits
from tilegemm.core.runtime import cdiv, interpreting
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


def takes_stem(g: Geometry) -> bool:
    """Whether ``implicit_gemm``'s forward runs on its stem kernel
    (:func:`tilegemm.ops.conv2d.implicit_gemm.conv2d_stem_kernel`): one group of at most :data:`STEM_ROWS_MAX_C`
    channels, a filter of at most :data:`STEM_ROWS_MAX_K` (r, s, c) columns (its K loop is unrolled)."""
    return g.groups == 1 and g.C <= STEM_ROWS_MAX_C and g.R * g.S * g.C <= STEM_ROWS_MAX_K


STEM_ROWS_MAX_C = 8  # stems: below, every (r, s, c) a constexpr
STEM_ROWS_MAX_K = 512  # a filter's columns (the K loop is unrolled): 11x11x3 = 363 fits, ViT's 16x16x3 does not


def stem_rows_config(g: Geometry, dtype: torch.dtype) -> dict:
    """The stem kernel's tile (:func:`tilegemm.ops.conv2d.implicit_gemm.conv2d_stem_kernel`): 128 pixels of an
    output row (64 on rows of at most 64), all output channels up to 128 (a power of two, at least 16), 32-wide
    K steps, 4 warps (docs/conv2d.md, "Stems")."""
    if interpreting():
        # K steps of up to 64: the interpreter's cost is per step (a 7x7 stem over 3 channels: 3 steps, not 10)
        return dict(BLOCK_Q=16, BLOCK_N=16, BLOCK_K=_pow2_at_least(g.R * g.S * g.C, 16, 64), num_warps=4,
                    num_stages=1)
    return dict(BLOCK_Q=64 if g.Q <= 64 else 128, BLOCK_N=_pow2_at_least(g.Kg, 16, 128), BLOCK_K=32,
                num_warps=4, num_stages=1)


def dgrad_config(g: Geometry, dtype: torch.dtype) -> dict:
    """Data gradient: M = N*H*W input pixels, N = C/groups, the K loop over (r, s, K/groups)."""
    if interpreting():
        return _cfg(64, 32, 16, 4, 1)
    if dtype == torch.float32 or g.R * g.S == 1:
        return _gemm_tile(g.N * g.H * g.W, g.Cg, g.Kg, dtype)
    # 16-bit with several taps: 64 x 128 tiles with 4 warps and 3 stages (128 pixels where the channels are
    # few: the stem's 3), near each layer's best on ResNet-50's 3x3 layers; the strided 1x1 layers (one tap, a
    # long K loop over the channels) keep 128 x 128 (docs/conv2d.md, "Configs").
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
# the taps unrolled (all loads of a tile in flight), 64 pixels x 32 channels on 4 warps ran best or near it on
# every layer timed (docs/conv2d.md, "Configs").
_DEPTHWISE_UNROLL_TAPS = 49  # up to 7x7 filters unrolled; larger ones loop (compile time)


def depthwise_fwd_config(g: Geometry, dtype: torch.dtype) -> dict:
    """The depthwise forward's tile (see above)."""
    unroll = g.R * g.S <= _DEPTHWISE_UNROLL_TAPS  # the interpreter too: the suite runs both forms
    if interpreting():
        return dict(BLOCK_M=32, BLOCK_N=16, UNROLL=unroll, num_warps=4, num_stages=1)
    return dict(BLOCK_M=64, BLOCK_N=_pow2_at_least(g.K, 16, 32), UNROLL=unroll, num_warps=4, num_stages=2)


# Stride-1 depthwise forwards run depthwise_rows_kernel: a program owns BLOCK elements of flattened
# channels-last output rows and rolls down ROWS_PER rows, the weights of its elements in registers (R*S * BLOCK
# / threads fp32 values a thread: hence the cap on taps; larger filters take the pixel kernel). Four elements a
# thread (BLOCK 256 on 2 warps; two on 4 warps past 3x3) and 32 rows a program; from _DEPTHWISE_PIPELINE_ROWS
# rows Triton's pipeliner with 3 stages (more bytes in flight), below it loads held a row ahead in registers (fewer
# instructions a row).
# docs/conv2d.md, "Configs".
DEPTHWISE_ROWS_MAX_TAPS = 25  # auto's cap: 49 sends stride-1 7x7 forwards here (two elements a thread, 4 warps)
DEPTHWISE_ROWS_CONFIG_MAX_TAPS = 49  # a config's: 7x7 at two elements a thread fits sm_90's registers (see below)
_DEPTHWISE_PIPELINE_ROWS = 48
# True: filters past 3x3 read the weight rewritten tap-major (a second launch; coalesced weight loads): faster on the
# zoo's stride-1 5x5 layers despite the launch (docs/conv2d.md, "Depthwise window kernel").
DEPTHWISE_ROWS_TAP_MAJOR = True


def depthwise_rows_config(g: Geometry, dtype: torch.dtype) -> dict:
    """depthwise_rows_kernel's config (see above); small blocks under the interpreter."""
    pipeline = g.P >= _DEPTHWISE_PIPELINE_ROWS
    tap_major = dict(TAP_MAJOR=True) if DEPTHWISE_ROWS_TAP_MAJOR and g.R * g.S > 9 else {}
    if interpreting():
        return dict(BLOCK=32, ROWS_PER=4, PIPELINE=pipeline, STAGES=1, num_warps=4, **tap_major)
    # filters past 3x3: two elements a thread on 4 warps (half the weights in registers: 96 against 172 at 5x5),
    # faster on the zoo's stride-1 5x5 layers than four a thread (docs/conv2d.md, "Depthwise rows for any stride")
    warps = 2 if g.R * g.S <= 9 else 4
    return dict(BLOCK=256, ROWS_PER=32, PIPELINE=pipeline, STAGES=3 if pipeline else 1, num_warps=warps, **tap_major)


# depthwise_strided_rows_kernel (any stride and dilation): a program's weights, R*S * BLOCK / threads fp32 values a
# thread, stay in registers, so up to 7x7 filters at two elements a thread. auto runs it on strided forwards of up
# to 5x5 filters (STRIDED_ROWS_MAX_AUTO_TAPS): each input row is loaded once where the pixel kernel loads every tap,
# and it ran ahead of the pixel kernel on the zoo's strided 3x3 and 5x5 depthwise layers (docs/conv2d.md,
# "Depthwise rows for any stride"); stride-1 3x3 forwards on small images too (below). Other stride-1 forwards keep
# the row or window kernel; 7x7 strided ones (not timed) the pixel kernel.
DEPTHWISE_STRIDED_ROWS_MAX_TAPS = 49
STRIDED_ROWS_AUTO = True  # False: the pixel kernel for every strided forward (as before the measurement)
STRIDED_ROWS_MAX_AUTO_TAPS = 25


def depthwise_strided_rows_tile(g: Geometry, dtype: torch.dtype) -> dict:
    """A config of depthwise_strided_rows_kernel whatever the rule says: up to 3x3 filters eight elements a thread
    (16-byte fp16 loads) through Triton's pipeliner (3 stages), up to 5x5 two a thread on 4 warps (fewer weights
    in registers), beyond two a thread; 8 output rows a program where each reads several input rows, else 16;
    small blocks under the interpreter."""
    if interpreting():
        return dict(BLOCK=32, STRIDED_ROWS=4, STAGES=1, num_warps=4)
    rows = 8 if g.stride[0] > 1 else 16
    if g.R * g.S <= 9:
        return dict(BLOCK=512, STRIDED_ROWS=rows, STAGES=3, num_warps=2)
    return dict(BLOCK=256, STRIDED_ROWS=rows, STAGES=1, num_warps=4)


# Stride-1 3x3 forwards on small images: the strided row kernel's pipelined config (eight elements a thread, 16
# output rows a program) ran ahead of the row kernel on the zoo's stride-1 3x3 layers of DEPTHWISE_S1_STRIDED_ROWS
# rows and at most DEPTHWISE_S1_STRIDED_MAX_CHANNELS channels, and the window kernel (two columns of two channels a
# thread) on those of DEPTHWISE_WINDOW_3X3_MIN_CHANNELS channels or more on DEPTHWISE_WINDOW_3X3_ROWS rows (fitted
# on half of the layers, checked on the other half: docs/conv2d.md, "Stride-1 3x3 depthwise").
DEPTHWISE_S1_STRIDED_ROWS = range(8, 32)  # output rows P
DEPTHWISE_S1_STRIDED_MAX_CHANNELS = 512
DEPTHWISE_WINDOW_3X3_MIN_CHANNELS = 640
DEPTHWISE_WINDOW_3X3_ROWS = range(8, 48)  # output rows P


def _small_s1_3x3(g: Geometry) -> bool:
    """A stride-1, undilated 3x3 filter (the rule was fitted on 3x3 layers only)."""
    return g.stride == (1, 1) and g.dilation == (1, 1) and (g.R, g.S) == (3, 3)


def depthwise_strided_rows_config(g: Geometry, dtype: torch.dtype) -> dict | None:
    """depthwise_strided_rows_kernel's config where ``auto`` runs it (strided, at most
    :data:`STRIDED_ROWS_MAX_AUTO_TAPS` taps, :data:`STRIDED_ROWS_AUTO`; stride-1 3x3 on the images and channels
    above), else None."""
    if not STRIDED_ROWS_AUTO or g.R * g.S > STRIDED_ROWS_MAX_AUTO_TAPS:
        return None
    if g.stride == (1, 1) and not (_small_s1_3x3(g) and g.P in DEPTHWISE_S1_STRIDED_ROWS
                                   and g.K <= DEPTHWISE_S1_STRIDED_MAX_CHANNELS):
        return None
    return depthwise_strided_rows_tile(g, dtype)


# depthwise_window_kernel (stride 1, dilation 1): a thread holds QT adjacent output columns of VEC channels, loads
# the QT + S - 1 input columns under them once a row and keeps R*S weights, R*QT accumulators and the window in
# registers (R*S*V + R*QT*V + (QT + S - 1)*V fp32 values a thread, V its channels). By construction it issues
# (QT + S - 1) / QT loads an output column a row where the row kernel issues S, and a weight register serves QT
# outputs, not one. auto takes it for 7x7 (and filters past 5x5) always, and for 5x5 from
# DEPTHWISE_WINDOW_AUTO_MIN_CHANNELS channels, where the row kernel stays ahead of it on few channels
# (tools/conv2d_depthwise_candidates.py; docs/conv2d.md, "Depthwise window kernel").
DEPTHWISE_WINDOW_MAX_TAPS = 49
DEPTHWISE_WINDOW_AUTO = True  # stride-1 forwards of more than DEPTHWISE_WINDOW_AUTO_MIN_TAPS taps take it (see above)
DEPTHWISE_WINDOW_AUTO_MIN_TAPS = 9  # 5x5 and 7x7 (and other filters past 3x3)
DEPTHWISE_WINDOW_AUTO_MIN_CHANNELS = 192  # filters of at most 25 taps: fewer channels stay on the row kernel


def depthwise_window_blocks(Q: int, K: int, qt: int, vec: int, threads: int = 128) -> tuple[int, int]:
    """(BLOCK_G, BLOCK_C) of a depthwise_window_kernel program of ``threads`` threads, ``vec`` channels and ``qt``
    columns a thread: 4, 2 or 1 column groups, whichever pads the image's columns and channels least (a 7-wide
    image fills one group of 8 columns: four would leave three idle), the channel block no wider than the
    channels' power of two unless it is one warp's."""
    groups = cdiv(Q, qt)
    best = None
    for bg in (4, 2, 1):
        bc = threads * vec // bg
        if bg < 4 and bc > _pow2_at_least(K, 1, 1 << 30):
            continue
        padded = cdiv(groups, bg) * bg * cdiv(K, bc) * bc
        if best is None or padded < best[0]:
            best = (padded, bg, bc)
    return best[1], best[2]


def depthwise_window_tile(g: Geometry, dtype: torch.dtype, qt: int | None = None, vec: int = 1,
                          tap_major: bool = True, ahead: bool = False, maxnreg: int | None = None) -> dict:
    """A config of depthwise_window_kernel whatever the rule says: by default one channel a thread (2-byte loads,
    a warp's 32 channels one 64-byte run; fewest weight registers: R*S), 4 columns a thread up to 5x5 filters, 8
    past them (the window's S - 1 extra columns amortized; ptxas, sm_90, fp16: 110 and 146 registers at 7x7),
    the weight read tap-major (coalesced), 32 rows a program at most; ``maxnreg`` caps ptxas's registers a thread
    (128: four programs of 4 warps an SM, 168: three); small blocks under the interpreter."""
    if qt is None:
        qt = 4 if g.R * g.S <= 25 else 8
    if interpreting():
        return dict(QT=min(qt, 2), BLOCK_G=2, BLOCK_C=16, WINDOW_ROWS=4, VEC=vec, STAGES=1, num_warps=1,
                    TAP_MAJOR=tap_major, AHEAD=ahead)
    bg, bc = depthwise_window_blocks(g.Q, g.K, qt, vec)
    cfg = dict(QT=qt, BLOCK_G=bg, BLOCK_C=bc, WINDOW_ROWS=32, VEC=vec, STAGES=1, num_warps=4,
               TAP_MAJOR=tap_major, AHEAD=ahead)
    if maxnreg is not None:
        cfg["maxnreg"] = maxnreg
    return cfg


def depthwise_window_config(g: Geometry, dtype: torch.dtype) -> dict | None:
    """depthwise_window_kernel's config where ``auto`` runs it (:data:`DEPTHWISE_WINDOW_AUTO`, stride and dilation
    1, more than :data:`DEPTHWISE_WINDOW_AUTO_MIN_TAPS` and at most :data:`DEPTHWISE_WINDOW_MAX_TAPS` taps; 3x3 of
    many channels on small images, :data:`DEPTHWISE_WINDOW_3X3_MIN_CHANNELS`), else None."""
    taps = g.R * g.S
    if (DEPTHWISE_WINDOW_AUTO and _small_s1_3x3(g) and g.K >= DEPTHWISE_WINDOW_3X3_MIN_CHANNELS
            and g.P in DEPTHWISE_WINDOW_3X3_ROWS):
        return depthwise_window_tile(g, dtype, qt=2, vec=2)  # many channels on a small image (see above)
    if (not DEPTHWISE_WINDOW_AUTO or g.stride != (1, 1) or g.dilation != (1, 1)
            or not DEPTHWISE_WINDOW_AUTO_MIN_TAPS < taps <= DEPTHWISE_WINDOW_MAX_TAPS):
        return None
    if taps <= DEPTHWISE_ROWS_MAX_TAPS and g.K < DEPTHWISE_WINDOW_AUTO_MIN_CHANNELS:
        return None
    return depthwise_window_tile(g, dtype, qt=4)  # 4 columns a thread at 7x7 too: a better worst layer than 8's (same doc)


def depthwise_config(g: Geometry, dtype: torch.dtype) -> dict:
    """The depthwise gradients' tile: [BLOCK_M pixels, BLOCK_N channels], channels contiguous."""
    if interpreting():
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    bn = _pow2_at_least(g.K, 16, 64)
    return dict(BLOCK_M=64 if bn == 64 else 128, BLOCK_N=bn, num_warps=4, num_stages=2)


DEPTHWISE_WGRAD_ROW_TAPS = False  # a program per filter row (its taps sharing each dy tile): slower than per tap
DEPTHWISE_WGRAD_PER_SM = 32  # its pixel slices: enough for this many programs an SM ...
DEPTHWISE_WGRAD_MIN_STEPS = 2  # ... each at least this many pixel blocks long (configs.pixel_split)
# grouped_direct's weight gradient, the same loop over taps and slices: the same slices (docs/conv2d.md,
# "Depthwise weight gradient")
GROUPED_DIRECT_WGRAD_PER_SM = 32
GROUPED_DIRECT_WGRAD_MIN_STEPS = 2


DEPTHWISE_WGRAD_ALL_TAPS = True  # every tap a program over row slices: ahead of a program a tap on the zoo's
#   depthwise layers (docs/conv2d.md, "Depthwise weight gradient")
DEPTHWISE_WGRAD_TAPS_PER_SM = 4  # its row slices: enough for this many programs an SM ...
DEPTHWISE_WGRAD_TAPS_MIN_ROWS = 2  # ... each at least this many output rows
DEPTHWISE_WGRAD_TAPS_ACC = 64  # the all-taps kernel's accumulator, fp32 registers a thread (T_PAD x BQ x BN)


def depthwise_wgrad_taps_config(g: Geometry, dtype: torch.dtype) -> dict:
    """The all-taps depthwise weight gradient's tile: [T_PAD taps, BLOCK_Q columns, BLOCK_N channels], BLOCK_Q as
    many columns as keep the accumulator at :data:`DEPTHWISE_WGRAD_TAPS_ACC` registers a thread."""
    t_pad = _pow2_at_least(g.R * g.S, 1, 1 << 12)
    if interpreting():
        return dict(ALL_TAPS=True, BLOCK_Q=4, BLOCK_N=16, num_warps=4, num_stages=1)
    bn = _pow2_at_least(g.K, 16, 64)
    bq = 1 << max(1, min(4, (DEPTHWISE_WGRAD_TAPS_ACC * 128 // (t_pad * bn)).bit_length() - 1))
    return dict(ALL_TAPS=True, BLOCK_Q=bq, BLOCK_N=bn, num_warps=4, num_stages=2,
                PER_SM=DEPTHWISE_WGRAD_TAPS_PER_SM, MIN_ROWS=DEPTHWISE_WGRAD_TAPS_MIN_ROWS)


DEPTHWISE_WGRAD_WALK = True  # auto walks where walk_takes
# (0.42x -> 0.66x cuDNN: docs/conv2d.md, "Depthwise weight gradient")
DEPTHWISE_WGRAD_WALK_MAX_TAPS = 49  # the walking kernel's taps (an accumulator each): up to 7x7
# Filters of more taps than this walk a filter row a program (ROWS=1: 2-4 channels a thread, dy re-read R times)
# rather than all rows in one (1-2 channels a thread): faster on 5x5 and 7x7, slower on 3x3 (docs/conv2d.md,
# "Depthwise weight gradient")
DEPTHWISE_WGRAD_WALK_ROW_TAPS = 9
# A stride-1 layer walking a filter row a program takes at most 2 channels a thread and 8 programs an SM (twice
# the programs, each with fewer registers): faster on the zoo's stride-1 5x5 and 7x7 layers, slower on its
# stride-2 ones (docs/conv2d.md, "Depthwise weight gradient")
DEPTHWISE_WGRAD_ROW_STRIDE1 = dict(VEC=2, PER_SM=8)
# Where the row slices alone give fewer programs than PER_SM an SM (few channel blocks, few output rows), the walk
# also splits the output columns into runs (COLS), up to enough programs, at most WALK_MAX_RUNS and at most one per
# WALK_RUN_COLS columns: faster on such layers of 28 columns and more, slower on narrower ones (docs/conv2d.md,
# "Depthwise weight gradient")
DEPTHWISE_WGRAD_WALK_RUN_COLS = 14
DEPTHWISE_WGRAD_WALK_MAX_RUNS = 8


def walk_column_runs(g: Geometry, programs: int, target: int) -> int:
    """The walking depthwise weight gradient's runs of output columns (``COLS``) where its config names none:
    enough for ``target`` programs over the ``programs`` its row slices allow at most (each a channel block and
    group of filter rows over a slice of rows), at most :data:`DEPTHWISE_WGRAD_WALK_MAX_RUNS` runs and one per
    :data:`DEPTHWISE_WGRAD_WALK_RUN_COLS` output columns."""
    return max(1, min(-(-target // max(1, programs)), g.Q // DEPTHWISE_WGRAD_WALK_RUN_COLS,
                      DEPTHWISE_WGRAD_WALK_MAX_RUNS))


def walk_takes(g: Geometry) -> bool:
    """Whether the walking depthwise weight gradient takes the layer: one output channel an input channel,
    undilated along the width (or one column of taps), a width stride of at most 4 (a compile-time constant), at
    most :data:`DEPTHWISE_WGRAD_WALK_MAX_TAPS` taps (an accumulator each)."""
    return (g.K == g.C and (g.dilation[1] == 1 or g.S == 1) and g.stride[1] <= 4
            and g.R * g.S <= DEPTHWISE_WGRAD_WALK_MAX_TAPS)


def depthwise_wgrad_walk_config(g: Geometry, dtype: torch.dtype, rows: int | None = None) -> dict:
    """The walking depthwise weight gradient's tile: [BLOCK_P output rows, BLOCK_N channels], VEC channels a
    thread (fewer where a program's taps' accumulators and kept columns take more registers), 4 warps; a column's
    loads issued ``AHEAD`` columns before its products; ``rows`` filter rows a program (default all R, one past
    :data:`DEPTHWISE_WGRAD_WALK_ROW_TAPS` taps)."""
    if rows is None:
        rows = 1 if g.R * g.S > DEPTHWISE_WGRAD_WALK_ROW_TAPS else g.R
    if interpreting():
        return dict(WALK=True, BLOCK_P=4, BLOCK_N=16, AHEAD=2, ROWS=rows, num_warps=4, num_stages=1)
    taps = rows * g.S
    vec = 4 if taps <= 9 else 2 if taps <= 25 else 1
    per_sm = 4
    if rows == 1 < g.R and g.stride == (1, 1):
        vec, per_sm = min(vec, DEPTHWISE_WGRAD_ROW_STRIDE1["VEC"]), DEPTHWISE_WGRAD_ROW_STRIDE1["PER_SM"]
    bn = max(vec, min(64, _divisor_pow2(g.K)))
    threads = 128
    bp = max(1, threads * vec // bn)
    return dict(WALK=True, BLOCK_P=bp, BLOCK_N=bn, AHEAD=1, ROWS=rows, num_warps=4, num_stages=1, PER_SM=per_sm,
                MIN_CHUNKS=1)


def _divisor_pow2(n: int) -> int:
    """The largest power of two dividing ``n`` (``n`` > 0)."""
    return n & -n


def depthwise_wgrad_config(g: Geometry, dtype: torch.dtype, rows: bool | None = None,
                           taps: bool | None = None) -> dict:
    """The depthwise weight gradient's config: :func:`depthwise_config`'s tile, and with ``rows`` (default
    :data:`DEPTHWISE_WGRAD_ROW_TAPS`) a program per filter row (``S_PAD``, the row's taps padded to a power of
    two) with its pixel block divided by ``S_PAD`` (the same accumulator registers). Off by default: sharing a dy
    tile across a row's taps ran slower than a program per tap at every slice count (docs/conv2d.md, "Depthwise
    weight gradient"). Without rows and with ``taps`` left None, the walking kernel's config where
    :data:`DEPTHWISE_WGRAD_WALK` is on and it takes the layer (:func:`depthwise_wgrad_walk_config`); else ``taps``
    (default :data:`DEPTHWISE_WGRAD_ALL_TAPS`) gives the all-taps kernel's config
    (:func:`depthwise_wgrad_taps_config`), else a program a tap."""
    rows = DEPTHWISE_WGRAD_ROW_TAPS if rows is None else rows
    if not rows and taps is None and DEPTHWISE_WGRAD_WALK and walk_takes(g):
        return depthwise_wgrad_walk_config(g, dtype)
    if not rows and (DEPTHWISE_WGRAD_ALL_TAPS if taps is None else taps):
        return depthwise_wgrad_taps_config(g, dtype)
    cfg = depthwise_config(g, dtype)
    if rows and g.S > 1:
        sp = _pow2_at_least(g.S, 2, 64)
        cfg.update(S_PAD=sp, BLOCK_M=max(8, cfg["BLOCK_M"] // sp))
    return cfg


# --- tma_implicit_gemm (ops/conv2d/tma_fwd.py) ----------------------------------------------------------------
#
# A cost model rather than a table: the layers of a network differ in image size, channels and filter, and the
# time of a tile choice follows from a few counts. Fitted to ResNet-50's non-stem layers, every config timed
# (docs/conv2d.md, "Configs"). What it says: a program holds an SM's tensor cores better the bigger its tile
# (128x128 reads the fewest operand bytes per MMA); one program alone on an SM waits on TMA latency, two mostly
# hide it; and tiles come in waves of SMs x programs-per-SM.
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
    steps = g.R * g.S * -(-g.Cg // bk)
    smem = stages * (rows + bn) * bk * 2 + 1024
    per_sm = max(1, min(_SMEM // smem, 2 if rows * bn >= 128 * 128 else 4))  # registers: 2 programs of 128x128
    together = min(per_sm, -(-tiles // sms))
    waves = -(-tiles // (sms * per_sm))
    eff = _TILE_EFFICIENCY.get((rows, bn), 0.4) * _ALONE.get(together, 1.0)
    return waves * together * steps * bk * rows * bn / eff


def ragged_channel_step(g: Geometry) -> bool:
    """True where ``tma_implicit_gemm`` may take 64-channel steps past C/groups: a strided 1x1 layer, whose one tap
    reads x through a descriptor ending at C and the weight through one ending at Cg, so TMA's zero fill ends the
    last step; 16-wide steps (C a multiple of 16 but not of 32) quartered each MMA (docs/conv2d.md, "Configs")."""
    return g.is_strided_pointwise and g.Cg > 64


def tma_forward_config(g: Geometry, sms: int) -> dict:
    """``tma_implicit_gemm``'s config: patch of 64 or 128 pixels, 64 or 128 channels (fewer when the layer has
    fewer), the widest channel step (64, 32, 16) dividing C/groups, by :func:`tma_estimate`; three ring slots
    (two programs an SM), six where the tiles are no more than the SMs."""
    bk = 64 if g.Cg % 64 == 0 else 32 if g.Cg % 32 == 0 else 16
    if bk == 16 and ragged_channel_step(g):
        bk = 64
    bns = (64, 128) if g.Kg > 64 else (_pow2_at_least(g.Kg, 16, 64),)
    best = None
    for rows in (64, 128):  # ties: a taller channel tile (the weight's boxes are the smaller operand)
        for bn in sorted(bns, reverse=True):
            t = tma_estimate(g, rows, bn, bk, 3, sms)
            if best is None or t < best[0]:
                best = (t, rows, bn)
    _, rows, bn = best
    if g.R * g.S * -(-g.Cg // bk) <= 2:
        # One or two K steps (a 1x1 layer over few channels): the program is a load, an MMA and a store of its
        # output tile, and a ring of two slots holds all it can use. With full 64-channel steps the ring's
        # shared memory limits the programs an SM holds, and 64-pixel patches on two slots fit twice as many,
        # overlapping one's store with another's loads; with 16-wide steps the ring is small at any depth and the
        # smaller patch only costs more programs (docs/conv2d.md, "Configs").
        if bk == 64:
            rows = 64
        bi, bh, bw, _ = _patch(g, rows)
        return dict(BI=bi, BH=bh, BW=bw, BLOCK_N=bn, BLOCK_K=bk, STAGES=2, num_warps=4)
    bi, bh, bw, pixel_tiles = _patch(g, rows)
    # One program an SM at most: nothing to share the SM with, so a deeper ring hides TMA's latency instead.
    alone = pixel_tiles * -(-g.Kg // bn) * g.groups <= sms
    return dict(BI=bi, BH=bh, BW=bw, BLOCK_N=bn, BLOCK_K=bk, STAGES=6 if alone else 3, num_warps=4)


def tma_stem_config(g: Geometry, sms: int) -> dict:
    """The config of a stem's window convolution (:func:`tilegemm.ops.conv2d.tma_fwd.stem_geometry`): a short
    reduction (one to three K steps a filter row) over many pixels and few output channels, where a program's
    fixed costs weigh most. With at most 64 output channels and two waves of them, 256-pixel patches on 8 warps
    and 4 ring slots, faster than the cost model's 128-pixel tile on ResNet-50's, MobileNetV2's and VGG's stems
    (docs/conv2d.md, "Configs")."""
    cfg = tma_forward_config(g, sms)
    if g.Kg <= 64:
        bi, bh, bw, tiles = _patch(g, 256)
        if tiles * -(-g.Kg // cfg["BLOCK_N"]) >= 2 * sms:
            cfg.update(BI=bi, BH=bh, BW=bw, STAGES=4, num_warps=8)
    return cfg


# --- gluon_f16 for 1x1 layers (the tile rule is auto's: tilegemm.ops.conv2d.dispatch.pointwise_gluon_tile) ------


def gluon_ring(bm: int, bn: int, bk: int, most: int = 8) -> int:
    """Ring slots (at most ``most``, at least 2) of a ``bm x bn`` gluon_f16 tile in ``bk``-deep K steps that
    fit beside its unshared output buffer: 3 for 256x128 and 6 for 128x128 in 64-deep steps (its shipped
    rings), 6 for 256x128 in 32-deep steps."""
    stages = most
    while stages > 2 and not ring_fits(bm, bn, bk, stages, bm * bn * 2):
        stages -= 1
    return stages


# --- padded channels (ops/conv2d/padded.py) ----------------------------------------------------------------

PAD_WIDE_STEP_WASTE = 0.25  # padded to a multiple of 64 (or 32) where that adds at most this share of channels:
#   a 16-deep K step pays the same barrier wait and TMA issue as a 64-deep one for a quarter of the MMAs


def padded_group(cg: int) -> int:
    """A group's channel count padded for ``tma_implicit_gemm`` (:mod:`tilegemm.ops.conv2d.padded`): to a multiple
    of 64 or 32 where that adds at most :data:`PAD_WIDE_STEP_WASTE` of the channels (wider K steps), else of 16
    (the narrowest K step, one wgmma's depth)."""
    for step in (64, 32, 16):
        if step == 16 or -(-cg // step) * step - cg <= PAD_WIDE_STEP_WASTE * cg:
            return -(-cg // step) * step


# Wider K steps for groups of 16 * odd channels (48, 80, 112, ...), whose direct steps are 16 deep: only the weight
# is padded (the input read in place, TMA's zero fill or the next stride phase's channels past C against zero weight
# columns), so the padding costs MMAs, not a copy.
WIDE_STEP_OVERHEAD = 3.0  # a K step's fixed cost (barrier wait, TMA issue) in 16-deep MMAs of its tile: between 1.4
#   and 5 on the strided 1x1 layers whose ragged 64-wide steps ran 1.7x-2.3x their 16-wide ones (docs/conv2d.md,
#   "Odd channel counts")
WIDE_STEP_MOST_WASTE = 1 / 3  # padded channels at most this share of the group's
WIDE_STEP_GAIN = 0.8  # taken where the wider steps cost at most this share of the direct ones
WIDE_STEP_MIN_FLOPS = 2**32  # ... in layers of at least this much work: the weight's padding is a launch of its own,
#   a few microseconds that a small layer's saved steps may not repay (a guard, not a measurement)


def _steps_cost(cg: int, step: int) -> float:
    """The K steps' cost of ``cg`` channels a tap ``step`` at a time, in 16-deep MMAs (:data:`WIDE_STEP_OVERHEAD`)."""
    return -(-cg // step) * (WIDE_STEP_OVERHEAD + step / 16)


def wide_group(cg: int) -> int:
    """A group's channels padded for ``tma_implicit_gemm``'s in-place padded route (:mod:`tilegemm.ops.conv2d.padded`,
    ``wide``): C/groups a multiple of 16 but not of 32 rounded up to the multiple of 64 or 32 whose steps cost least
    (:func:`_steps_cost`) among those adding at most :data:`WIDE_STEP_MOST_WASTE` of the channels, where that is at
    most :data:`WIDE_STEP_GAIN` of the 16-wide steps' cost; else ``cg`` itself (48 -> 64, 80 -> 96, 112 -> 128)."""
    if cg % 16 or cg % 32 == 0:
        return cg
    best, cost = cg, WIDE_STEP_GAIN * _steps_cost(cg, 16)
    for step in (64, 32):
        wide = -(-cg // step) * step
        if wide - cg <= WIDE_STEP_MOST_WASTE * cg and _steps_cost(cg, step) < cost:
            best, cost = wide, _steps_cost(cg, step)
    return best


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


# --- the weight gradient of a coarser grouping (dispatch._coarse_wgrad) --------------------------------------
#
# A grouped layer's weight gradient is the block diagonal of that of the same layer with GT times fewer groups,
# which tma_wgrad runs in full tensor-core tiles, GT times the products (docs/conv2d.md, "Grouped weight gradient
# by a coarser grouping"). Timed on the zoo's grouped layers, it led at up to 32 channels a group and lost on
# depthwise layers and at 48-56 (same section).
COARSE_WGRAD_MAX_CHANNELS = 32  # layers of at most this many input and output channels a group take it
COARSE_WGRAD_CHANNELS = (32, 128)  # a coarse group's channels: in this range, a multiple of 8 (tma_wgrad's step)
COARSE_WGRAD_NEAREST = 64  # of several GT, the one nearest this many channels a coarse group (tma_wgrad's tiles)


def coarse_wgrad_groups(g: Geometry) -> int | None:
    """GT (fine groups a coarse group) of ``auto``'s coarse weight gradient of ``g`` (see above), or None where it
    keeps the layer's own: one group, depthwise, more than :data:`COARSE_WGRAD_MAX_CHANNELS` input or output
    channels a group, or no GT >= 2 dividing the groups whose coarse group's channels are a multiple of 8 within
    :data:`COARSE_WGRAD_CHANNELS` (of several, the nearest :data:`COARSE_WGRAD_NEAREST`; ties: the smaller)."""
    if g.groups == 1 or g.is_depthwise or max(g.Cg, g.Kg) > COARSE_WGRAD_MAX_CHANNELS:
        return None
    lo, hi = COARSE_WGRAD_CHANNELS
    gts = [gt for gt in range(2, g.groups + 1)
           if g.groups % gt == 0 and gt * g.Cg % 8 == 0 and lo <= gt * g.Cg <= hi]
    return min(gts, key=lambda gt: abs(gt * g.Cg - COARSE_WGRAD_NEAREST), default=None)


def pixel_split(npq: int, blocks: int, block_m: int, device, split: int | None = None, per_sm: int = 2,
                min_steps: int = 8) -> tuple[int, int]:
    """(slices, slice length) of a weight gradient's reduction over ``npq`` output pixels: enough slices for
    ``per_sm`` programs an SM over ``blocks`` programs each, each slice at least ``min_steps`` ``block_m`` steps
    long and a whole number of them (``split``: a config's own count)."""
    sms = 4
    if device.type == "cuda":
        from tilegemm.core.hardware import sm_count  # (a CUDA query: only for CUDA tensors)

        sms = sm_count(device)
    split = split or max(1, min(-(-per_sm * sms // blocks), npq // (min_steps * block_m), 256))
    slice_len = cdiv(cdiv(npq, split), block_m) * block_m
    return cdiv(npq, slice_len), slice_len


# --- grouped_packed (ops/conv2d/grouped_packed.py) ------------------------------------------------------------
#
# A tile of GT whole groups, its weight tile block-diagonal: 64 channels a tile (8 groups of 8, 4 of 16, 2 of
# 24) reads a pixel's 128 bytes of them at once and wastes (GT - 1) / GT of the tensor cores' products, which
# these byte-bound layers can spare; 32 for groups of at most 4 channels and for groups of 32 (one group, no
# waste). On the zoo's grouped layers of 4-56 channels a group it ran ahead of grouped_direct (4-8) and of the TMA
# kernel (16-56); at 64 the TMA kernel stays ahead (docs/conv2d.md, "Several groups a tensor-core tile").
GROUPED_PACKED_TILE_CHANNELS = 64
GROUPED_PACKED_NARROW_TILE = 32  # ... for groups of at most 4 channels, and of 32
GROUPED_PACKED_AUTO_CHANNELS = 56  # auto runs grouped layers of at most this many channels a group (input and
#   output) on grouped_packed (0: none)
GROUPED_PACKED_TMA_AUTO = False  # ... through its TMA form (grouped_packed_tma) where that takes the call: it ran
#   behind the pointer form on most of those layers (same section)


def takes_grouped_packed(g: Geometry, sixteen_bit: bool = True) -> bool:
    """Whether ``auto`` runs ``g``'s forward by ``grouped_packed`` (see above): 16-bit operands (measured so; in fp32
    its block-diagonal tile would multiply its zeros on CUDA cores too), grouped, not depthwise, at most
    :data:`GROUPED_PACKED_AUTO_CHANNELS` input and output channels a group."""
    return (sixteen_bit and g.groups > 1 and not g.is_depthwise and g.Cg <= GROUPED_PACKED_AUTO_CHANNELS
            and g.Kg <= GROUPED_PACKED_AUTO_CHANNELS)


def grouped_packed_tiles(g: Geometry, gt: int, dtype: torch.dtype, taps_flat: bool = False) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of a grouped_packed tile of ``gt`` groups: its GT*K/groups output channels to a power
    of two (16 at least: tl.dot's least), and K steps of its GT*C/groups input channels to a power of two, at
    most 64 (fp32: 32, twice the shared memory an element); ``taps_flat`` (K steps over taps and channels as
    one index): 64 (fp32: 32), or less where the whole filter's columns are fewer."""
    wide = 2 if dtype == torch.float32 else 1
    if taps_flat:  # whole taps of the tile's channels (to a power of two) a step
        tcp = _pow2_at_least(gt * g.Cg, 1, 1 << 20)
        bk = _pow2_at_least(g.R * g.S * tcp, max(16, tcp), max(64 // wide, tcp))
    else:
        bk = _pow2_at_least(gt * g.Cg, 16, 64 // wide)
    return _pow2_at_least(gt * g.Kg, 16, 1 << 20), bk


def grouped_packed_config(g: Geometry, dtype: torch.dtype, tile_channels: int | None = None) -> dict:
    """grouped_packed's config: GT groups a tile with about ``tile_channels`` channels (default
    :data:`GROUPED_PACKED_TILE_CHANNELS`; :data:`GROUPED_PACKED_NARROW_TILE` for groups of at most 4 channels or
    of 32), the groups spread evenly over the tiles (13 groups of 8: two tiles of 7 and 6, not 8 and 5); 128
    output pixels a tile (64 on small images), 4 warps, 3 stages."""
    width = max(g.Cg, g.Kg)
    narrow = width <= 4 or width == 32
    per = tile_channels or (GROUPED_PACKED_NARROW_TILE if narrow else GROUPED_PACKED_TILE_CHANNELS)
    gt = min(g.groups, max(1, per // width))
    gt = -(-g.groups // -(-g.groups // gt))  # as many tiles, the groups spread evenly
    if interpreting():
        return dict(GT=gt, BLOCK_M=32, num_warps=4, num_stages=1)
    m = g.N * g.P * g.Q
    return dict(GT=gt, BLOCK_M=128 if m >= 8192 else 64, num_warps=4, num_stages=3)


def grouped_packed_tma_groups(g: Geometry, tile_channels: int | None = None) -> int:
    """GT of grouped_packed_tma: the largest divisor of the groups with at most ``tile_channels`` (default
    :data:`GROUPED_PACKED_TILE_CHANNELS`) channels a coarse group (1 at least)."""
    per = tile_channels or GROUPED_PACKED_TILE_CHANNELS
    return max(d for d in range(1, g.groups + 1) if g.groups % d == 0 and (d == 1 or d * max(g.Cg, g.Kg) <= per))
