"""The TMA weight gradient's pixel split (``tma_wgrad.config``), as plain Python on geometries: no kernel runs."""

from __future__ import annotations

import itertools

import pytest

from tilegemm.core.runtime import cdiv
from tilegemm.ops.conv2d import tma_wgrad
from tilegemm.ops.conv2d.configs import _patch
from tilegemm.ops.conv2d.problem import Geometry

TILES = [(64, 64), (64, 128), (128, 128)]


def geo(N, C, H, K, R=3, stride=1) -> Geometry:
    return Geometry(N, C, H, H, K, R, R, 1, (stride, stride), (R // 2,) * 4, (1, 1))


def sizes(g, sms, bm=64, bn=64):
    """(split, tiles, patches, programs at once) of the config."""
    split = tma_wgrad.config(g, sms, bm, bn)["SPLIT"]
    return split, cdiv(g.Kg, bm) * cdiv(g.Cg, bn) * g.R * g.S, _patch(g, 128)[3], sms * (2 if bm == bn == 64 else 1)


GRID = [geo(N, C, H, K, R, st) for N, C, H, K, R, st in itertools.product(
    (1, 4, 32, 256), (16, 64, 256, 1024), (7, 14, 56), (64, 512), (1, 3), (1, 2))]


@pytest.mark.parametrize("sms", [132, 114, 16])
@pytest.mark.parametrize("tile", TILES)
def test_split_in_range_and_every_slice_used(sms, tile):
    for g in GRID:
        cfg = tma_wgrad.config(g, sms, *tile)
        split, tiles, patches, slots = sizes(g, sms, *tile)
        assert (cfg["BM"], cfg["BN"]) == tile and cfg["num_warps"] == (8 if tile[0] >= 128 else 4)
        assert 1 <= split <= 64
        assert split == 1 or cdiv(patches, split) >= 8  # slices of 8 patches or more
        assert cdiv(patches, cdiv(patches, split)) == split  # what run() launches: no empty slice


@pytest.mark.parametrize("tile", TILES)
def test_never_more_programs_than_pay(tile):
    """Each slice past one shortens the busiest slot's work (rounds of programs x their slice); and where the
    tiles leave room for a round of slices of the whole reduction, the split does not overfill a round."""
    for g in GRID:
        split, tiles, patches, slots = sizes(g, 132, *tile)
        work = lambda s: cdiv(tiles * s, slots) * cdiv(patches, s)  # noqa: E731
        assert all(work(s) > work(split) for s in range(1, split))
        if tiles * 8 <= slots and patches < 8 * 64:
            assert tiles * split <= slots, (g, split)


@pytest.mark.parametrize("g", [geo(32, 512, 7, 512), geo(32, 512, 14, 512, stride=2),  # 576 tiles, 14 patches
                               geo(32, 1024, 14, 2048, 1, 2),  # 512 tiles
                               geo(32, 256, 14, 256), geo(32, 256, 28, 256, stride=2)])  # 144 tiles, 49 patches
def test_many_tiles_one_slice(g):
    assert sizes(g, 132)[0] == 1


def test_few_tiles_long_reduction_fill_the_sms():
    # 9 tiles of 64 -> 64 channels 3x3: 784 patches at N=32 (timed best at split 12: 108 programs, one an SM)
    split, tiles, _, slots = sizes(geo(32, 64, 56, 64), 132)
    assert 132 // 2 <= tiles * split <= 132
    # eight times the pixels: slices of 216 patches still, so two programs an SM
    split, tiles, _, slots = sizes(geo(256, 64, 56, 64), 132)
    assert 132 < tiles * split <= slots
    # 36 tiles, 196 patches (timed best at 6 or 3; the former rule's 4 overfilled 132 SMs)
    for g in (geo(32, 128, 28, 128), geo(32, 128, 56, 128, stride=2)):
        split, tiles, _, slots = sizes(g, 132)
        assert split == 6 and tiles * split <= slots
    # 64x128 tiles, one program an SM: 18 tiles take a round of one program an SM
    split, tiles, _, slots = sizes(geo(32, 128, 28, 128), 132, 64, 128)
    assert slots == 132 and 132 // 2 < tiles * split <= 132


def test_short_reduction_stays_whole():
    assert sizes(geo(4, 40, 9, 24), 132)[0] == 1  # 3 patches
    assert sizes(geo(32, 512, 7, 512), 132)[0] == 1


@pytest.mark.parametrize("C,H,R,stride", [(64, 56, 3, 1), (128, 28, 3, 1), (256, 56, 1, 2), (512, 7, 3, 1),
                                          (32, 14, 3, 1)])
def test_split_grows_with_the_batch(C, H, R, stride):
    splits = [sizes(geo(N, C, H, C, R, stride), 132)[0] for N in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)]
    assert splits == sorted(splits) and splits[-1] > 1


def test_split_shrinks_with_the_tiles():
    """At the same pixels, more channel tiles take no more slices while they fit one round of programs."""
    splits = [sizes(geo(32, c, 56, c), 132)[0] for c in (16, 32, 64, 96, 128)]  # 9, 9, 9, 36, 36 tiles
    assert splits == sorted(splits, reverse=True) and splits[-1] > 1


@pytest.mark.parametrize("K,C,pixels,tile", [
    (696, 232, 32 * 56 * 56, (128, 256)),  # 16G multiply-adds: the wide tile
    (80, 480, 32 * 75 * 75, (128, 256)),
    (224, 32, 32 * 112 * 112 * 2, (128, 64)),  # 5.8G, but 128x256 would pad 32 input channels to 256
    (128, 256, 32 * 56 * 56, (64, 64)),  # 3.3G: under the wide tile's work
    (40, 96, 32 * 14 * 14, (64, 128)),  # one 64x128 tile covers it where 64x64 takes two
    (120, 40, 32 * 14 * 14, (128, 64)),
    (80, 80, 32 * 56 * 56, (64, 128)),  # tie of padding and count: the first listed
    (64, 64, 32 * 56 * 56, (64, 64)),  # the least padding
    (128, 1216, 32 * 14 * 14, (64, 64)),  # 38 tiles: 64x64's deeper ring, not 128x64's 19 tiles of equal padding
    (112, 672, 32 * 15 * 15, (64, 64)),
    (24, 512, 32 * 14 * 14, (64, 64)),  # 8 tiles of 64x64: past the few that take fewer, larger tiles
    (144, 24, 32 * 56 * 56, (64, 64)),
])
def test_pointwise_wgrad_tile(K, C, pixels, tile):
    from tilegemm.ops.conv2d import gemm_1x1

    got = gemm_1x1.wgrad_tile(K, C, pixels)
    assert got[:2] == tile
    assert got in gemm_1x1.WGRAD_TILES + (gemm_1x1.WGRAD_WIDE_TILE,)


def test_pointwise_wgrad_tile_pads_least_then_takes_fewest_tiles():
    from tilegemm.ops.conv2d import gemm_1x1

    for M, N in itertools.product((8, 24, 40, 64, 96, 120, 144, 200, 512), repeat=2):
        t = gemm_1x1.wgrad_tile(M, N, 1024)
        area = cdiv(M, t[0]) * t[0] * cdiv(N, t[1]) * t[1]
        assert all(area <= cdiv(M, o[0]) * o[0] * cdiv(N, o[1]) * o[1] for o in gemm_1x1.WGRAD_TILES)


@pytest.mark.parametrize("smem_kb, major", [(99, 8), (163, 8), (227, 9)])
def test_pointwise_wgrad_config_fits_the_gpus_shared_memory(monkeypatch, smem_kb, major):
    # sm_86/89 GPUs (RTX 4090, L40S) give a block 99 KB: 64x64's 6-slot ring (160 KB) raised OutOfResources there
    from tilegemm.core import hardware
    from tilegemm.ops.conv2d import gemm_1x1

    monkeypatch.setattr(hardware, "_smem_of", lambda device: (smem_kb * 1024, major))
    for M, N, K in [(128, 512, 8 * 28 * 28), (512, 128, 8 * 28 * 28), (64, 64, 32 * 56 * 56), (256, 512, 32 * 56 * 56),
                    (2048, 2048, 32 * 56 * 56)]:
        cfg = gemm_1x1.pointwise_wgrad_config(M, N, K, "cuda", 132)
        buffers = cfg["num_stages"] if major >= 9 else cfg["num_stages"] - 1  # as Triton allocates them
        assert (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2 * buffers <= smem_kb * 1024, (M, N, K, cfg)
        tile = gemm_1x1.wgrad_tile(M, N, K)
        if smem_kb >= 163:  # room for every tile: the choice is the one the rule makes without a limit
            assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"], cfg["num_stages"]) == tile
        assert cfg["SPLIT_K"] == gemm_1x1.wave_split(-(-M // cfg["BLOCK_M"]) * -(-N // cfg["BLOCK_N"]),
                                                     -(-K // cfg["BLOCK_K"]), 132)
    monkeypatch.setattr(hardware, "_smem_of", lambda device: (32 * 1024, 8))
    assert gemm_1x1.pointwise_wgrad_config(64, 64, 1024, "cuda", 132) is None  # none fits: split_k's own choice
