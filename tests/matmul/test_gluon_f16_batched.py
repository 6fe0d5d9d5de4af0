"""``gluon_f16``'s batched launch: (batch, tile) work units, 3-D TMA descriptors with a box of 1 along the batch
(2-D for an operand broadcast over the batch), and ``auto``'s switch for it (``dispatch.GLUON_F16_BATCHED``).

Gluon has no interpreter: without a GPU the batched kernel is compiled for sm_90 and its code checked, and the
host side (refusals, descriptors, the untimed config rule, the routing) is checked; on a GPU (``pytest -m gpu``)
it runs against an fp32 reference into NaN-poisoned outputs, ragged and sliced operands in every layout.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

import tilegemm
from tilegemm.core.registry import NotApplicable
from tilegemm.ops.matmul import dispatch, gluon_f16, persistent_tma
from tilegemm.ops.matmul.problem import make_problems
from tilegemm.ops.matmul.reference import tolerance

from conftest import SM90, compile_offline, rel_err


def _problem(a, b, out, c=None, bias=None, alpha=1.0, beta=0.0, act="none"):
    return make_problems(a, b, out, c, bias, alpha, beta, act, "ieee", False)[0]


def _operand(batch, rows, cols, transposed, dtype, device, broadcast=False, pad=0):
    """[batch, rows, cols] (a transposed view where ``transposed``), each matrix's rows ``pad`` elements longer
    than needed (a sliced view); ``broadcast``: one matrix expanded over the batch (batch stride 0)."""
    lead = () if broadcast else (batch,)
    if transposed:
        t = torch.randn(*lead, cols, rows + pad, device=device).to(dtype)[..., :rows].mT
    else:
        t = torch.randn(*lead, rows, cols + pad, device=device).to(dtype)[..., :cols]
    return t.expand(batch, rows, cols) if broadcast else t


def _meta(B, M, N, K, dtype=torch.float16, out_dtype=None):
    a = torch.empty(B, M, K, device="meta", dtype=dtype)
    b = torch.empty(B, K, N, device="meta", dtype=dtype)
    return _problem(a, b, torch.empty(B, M, N, device="meta", dtype=out_dtype or dtype))


# --- host side, no GPU ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case, reason", [
    ("fp16", None), ("bf16", None), ("fp32-out", "16-bit output"), ("fp32", "16-bit"),
])
def test_batched_usable(case, reason):
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(case, torch.float16)
    out_dtype = torch.float32 if case.startswith("fp32") else dtype
    p = _meta(3, 64, 48, 32, dtype, out_dtype)
    got = gluon_f16.why_not(p)
    assert got is None if reason is None else reason in got


def test_batched_refuses_an_output_without_batch_stride():
    import dataclasses

    p = _meta(3, 64, 48, 32)
    assert gluon_f16.why_not(dataclasses.replace(p, out_strides=(0, *p.out_strides[1:]))) is not None


def test_batched_descriptors_box_one_along_the_batch():
    B, M, N, K = 4, 1000, 264, 72
    a = torch.empty(B, K, M + 8, dtype=torch.float16)[..., :M].mT  # each A^T: [K, M] rows of M + 8, sliced
    b = torch.empty(K, N, dtype=torch.float16).expand(B, K, N)  # broadcast over the batch
    p = _problem(a, b, torch.empty(B, M, N, dtype=torch.float16))
    cfg = dict(gluon_f16.configs()[0])
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"]) == (256, 128)
    da, db, do = gluon_f16.descriptors(p, cfg)
    assert (da.shape, da.strides, da.block_shape) == ([B, K, M], [K * (M + 8), M + 8, 1], [1, 64, 256])
    assert (db.shape, db.strides, db.block_shape) == ([K, N], [N, 1], [64, 128])  # 2-D: read at every batch
    assert (do.shape, do.strides, do.block_shape) == ([B, M, N], [M * N, N, 1], [1, 128, 128])
    # A box is the 2-D tile's bytes: the swizzle the 2-D block takes, rank 3.
    flat = gluon_f16.host_descriptor(p.out, [M, N], N, [128, 128]).layout
    assert do.layout.rank == 3 and do.layout.swizzle_byte_width == flat.swizzle_byte_width
    _, grid, args, kwargs = gluon_f16.launch_args(p, cfg, 132)
    assert kwargs["BATCHED"] and kwargs["A_BATCHED"] and not kwargs["B_BATCHED"] and kwargs["batch"] == B
    assert grid == (min(132, 4 * 3 * B),)  # 1000 rows: 4 tiles of 256, 264 columns: 3 of 128


@pytest.mark.parametrize("B", [1, 3])
def test_outputs_whose_rows_end_inside_a_16_byte_unit_of_wider_rows_are_refused(B):
    a = torch.empty(B, 64, 64, dtype=torch.float16)
    b = torch.empty(B, 64, 257 + 15, dtype=torch.float16)[..., :257]
    padded = torch.empty(B, 64, 272, dtype=torch.float16)[..., :257]  # rows of 257 in 272: TMA can describe them
    assert "16-byte unit" in persistent_tma.why_not(_problem(a, b, padded))
    wide = torch.empty(B, 64, 272, dtype=torch.float16)[..., :264]  # 264 columns end on a unit: taken
    assert persistent_tma.why_not(_problem(a, torch.empty(B, 64, 264, dtype=torch.float16), wide)) is None


@pytest.mark.parametrize("which", ["a", "a_t", "b", "b_t"])
def test_operands_broadcast_along_their_rows_are_refused(which, device):
    """A row stride of 0 (an expand) would be a descriptor stride of 0: refused, and the public call still right."""
    M, N, K = 64, 48, 32
    a, b = torch.randn(M, K, device=device).half(), torch.randn(K, N, device=device).half()
    if which == "a":
        a = torch.randn(1, K, device=device).half().expand(M, K)
    elif which == "a_t":
        a = torch.randn(M, 1, device=device).half().expand(M, K)
    elif which == "b":
        b = torch.randn(1, N, device=device).half().expand(K, N)
    else:
        b = torch.randn(K, 1, device=device).half().expand(K, N)
    assert "broadcast" in persistent_tma.why_not(_problem(a, b, torch.empty(M, N, dtype=torch.float16, device=device)))
    got = tilegemm.matmul(a, b)
    ref = a.double() @ b.double()
    assert torch.allclose(got.double(), ref, rtol=2e-3, atol=2e-3)


def test_unbatched_launch_passes_no_batched_argument():
    a = torch.empty(256, 64, dtype=torch.float16)
    b = torch.empty(64, 128, dtype=torch.float16)
    p = _problem(a, b, torch.empty(256, 128, dtype=torch.float16))
    _, _, args, kwargs = gluon_f16.launch_args(p, gluon_f16.configs()[0], 132)
    assert not {"batch", "stride_cb", "BATCHED", "A_BATCHED", "B_BATCHED"} & set(kwargs)
    assert all(len(d.shape) == 2 for d in args[:3])


@pytest.mark.parametrize("shape, tile, shared_out", [
    ((32, 2048, 2048, 128), (128, 256), False),  # attention's scores: short K keeps a buffer per warp group
    ((2, 4096, 4096, 4096), (128, 256), True),  # long K: the 4-deep ring (the 2-D pick at 4096^3)
    ((8, 4096, 512, 14336), (256, 128), True),  # taller than wide
    ((4, 1000, 1000, 1000), (128, 256), False),  # 128 units of 128x256 fill one wave: no 128x128
    ((67, 256, 256, 64), (128, 128), False),  # 134 big units take two waves, 268 small ones three (x 0.5 / 0.85)
])
def test_batched_config_rule(shape, tile, shared_out):
    cfg = gluon_f16.batched_config(_meta(*shape), 132)
    assert cfg in gluon_f16.configs()
    assert ((cfg["BLOCK_M"], cfg["BLOCK_N"]), cfg["SHARED_OUT"]) == (tile, shared_out), cfg


@pytest.mark.parametrize("shape, off, on", [
    ((8, 4096, 128, 4096), (256, 128), (128, 128)),  # attention's P x V at 4096: one column tile
    ((64, 512, 64, 512), (256, 128), (128, 128)),  # narrower than any tile
    ((4, 1000, 1000, 1000), (128, 256), (128, 256)),  # wider than the knob: as before
])
def test_batched_narrow_small_tile_knob(shape, off, on, monkeypatch):
    # BATCHED_NARROW_SMALL_TILE_N (a knob of tools/grouped_rule_candidates.py, off as shipped): outputs of at most
    # that many columns take the 128x128 tile whatever the wave count says
    assert gluon_f16.BATCHED_NARROW_SMALL_TILE_N == 0
    cfg = gluon_f16.batched_config(_meta(*shape), 132)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"]) == off, cfg
    monkeypatch.setattr(gluon_f16, "BATCHED_NARROW_SMALL_TILE_N", 128)
    cfg = gluon_f16.batched_config(_meta(*shape), 132)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"]) == on and cfg in gluon_f16.configs(), cfg


def _fake_hopper(monkeypatch, sms=132):
    import tilegemm.core.hardware

    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(dispatch, "_has_tma", lambda: True)
    monkeypatch.setattr(tilegemm.core.hardware, "sm_count", lambda device: sms)
    monkeypatch.setattr(persistent_tma, "why_not_gluon", lambda: None)


def test_auto_keeps_persistent_tma_with_the_switch_off(monkeypatch):
    _fake_hopper(monkeypatch)
    assert dispatch.GLUON_F16_BATCHED is True  # on since tools/batched_candidates.py timed it
    monkeypatch.setattr(dispatch, "GLUON_F16_BATCHED", False)
    assert persistent_tma.batched_gluon_f16(_meta(32, 2048, 2048, 128)) is gluon_f16
    assert dispatch.choose_kernel(_meta(32, 2048, 2048, 128)) == "persistent_tma"
    # gluon_kernel_for (persistent_tma's candidates, the 2-D rule) never offers it for batches.
    assert persistent_tma.gluon_kernel_for(_meta(32, 2048, 2048, 128)) is None


def test_auto_takes_batched_products_to_gluon_f16_with_the_switch_on(monkeypatch):
    _fake_hopper(monkeypatch)
    monkeypatch.setattr(dispatch, "GLUON_F16_BATCHED", True)
    assert dispatch.choose_kernel(_meta(32, 2048, 2048, 128)) == "gluon_f16"
    assert dispatch.choose_kernel(_meta(4, 1000, 1000, 1000)) == "gluon_f16"  # 256 tiles of 128x128: ~2 per SM
    assert dispatch.choose_kernel(_meta(2, 1024, 1024, 64)) == "autotuned"  # 128 tiles: under one per SM
    assert dispatch.choose_kernel(_meta(8, 1024, 1024, 64, out_dtype=torch.float32)) == "persistent_tma"
    assert dispatch.choose_kernel(_meta(8, 2048, 64, 2048)) == "autotuned"  # narrow N: as before
    assert dispatch.choose_kernel(_meta(1, 4096, 4096, 4096)) != "gluon_f16"  # one product: the 2-D rules
    assert dispatch.choose_kernel(_meta(256, 64, 128, 128)) == "split_k"  # M <= 64 a batch: split_k's rows
    monkeypatch.setattr(dispatch, "GLUON_F16_BATCHED_NARROW", True)
    assert dispatch.choose_kernel(_meta(32, 2048, 64, 2048)) == "gluon_f16"
    assert dispatch.choose_kernel(_meta(32, 2048, 128, 2048)) == "gluon_f16"


def test_gluon_f16_by_name_takes_the_batched_rule_untimed(monkeypatch):
    """kernel="gluon_f16" (what auto's switch launches) on an untimed batched class: the batched rule's config."""
    launched = []
    monkeypatch.setattr(persistent_tma, "why_not_gluon", lambda: None)
    monkeypatch.setattr(persistent_tma, "ensure_allocator", lambda: None)
    monkeypatch.setattr(persistent_tma, "sm_count", lambda device: 132)
    monkeypatch.setattr(persistent_tma, "launch", lambda kernel, grid, args, kwargs: launched.append(kwargs))
    a = torch.empty(2, 4096, 4096, dtype=torch.float16)
    p = _problem(a, a, torch.empty(2, 4096, 4096, dtype=torch.float16))
    persistent_tma.run_gluon_f16(p)
    want = gluon_f16.batched_config(p, 132)
    assert launched and launched[0]["BLOCK_N"] == want["BLOCK_N"] and launched[0]["SHARED_OUT"] == want["SHARED_OUT"]
    assert launched[0]["BATCHED"]


def test_gluon_f16_by_name_refuses_what_tma_cannot_describe(monkeypatch):
    monkeypatch.setattr(persistent_tma, "why_not_gluon", lambda: None)
    a = torch.empty(3, 17, 1, dtype=torch.float16)  # K = 1: under 16
    p = _problem(a, torch.empty(3, 1, 24, dtype=torch.float16), torch.empty(3, 17, 24, dtype=torch.float16))
    with pytest.raises(NotApplicable, match="gluon_f16"):
        persistent_tma.run_gluon_f16(p)


# --- compiled for sm_90, no GPU -------------------------------------------------------------------------------

_COMPILE = SM90 + textwrap.dedent(
    """
    import json, re, sys
    import torch
    from tilegemm.ops.matmul import gluon_f16
    from tilegemm.ops.matmul.problem import make_problems

    def operand(batch, n, transposed, broadcast, dt):
        x = torch.empty((n, n) if broadcast else (batch, n, n), dtype=dt)
        x = x.mT if transposed else x
        return x.expand(batch, n, n) if broadcast else x

    kernel = gluon_f16.matmul_f16_coop_kernel
    report = {}
    for name, v in json.loads(sys.argv[1]).items():
        dt, B, n = getattr(torch, v["dtype"]), 4, 512
        a = operand(B, n, v["layout"][0] == "T", v["broadcast"] == "a", dt)
        b = operand(B, n, v["layout"][1] == "T", v["broadcast"] == "b", dt)
        c = torch.empty(B, n, n, dtype=dt) if v["epilogue"] else None
        bias = torch.empty(n, dtype=dt) if v["epilogue"] else None
        p = make_problems(a, b, torch.empty(B, n, n, dtype=dt), c, bias, 1.0, 0.5 if c is not None else 0.0,
                          "gelu" if c is not None else "none", "ieee", False)[0]
        assert p.batch == B and gluon_f16.why_not(p) is None
        cfg = [c for c in gluon_f16.configs() if (c["BLOCK_M"], c["BLOCK_N"], c["STAGES"]) == tuple(v["tile"])][0]
        _, _, args, kwargs = gluon_f16.launch_args(p, cfg, 132)
        sig, constexprs, attrs = launch_signature(kernel, args, kwargs)
        compiled, ptx, info = compile_sm90(kernel, sig, constexprs, attrs, 4)
        report[name] = dict(
            mmas=len(re.findall(r"wgmma\\.mma_async", ptx)),
            loads3d=len(re.findall(r"cp\\.async\\.bulk\\.tensor\\.3d\\.shared::cluster\\.global", ptx)),
            loads2d=len(re.findall(r"cp\\.async\\.bulk\\.tensor\\.2d\\.shared::cluster\\.global", ptx)),
            stores3d=len(re.findall(r"cp\\.async\\.bulk\\.tensor\\.3d\\.global\\.shared", ptx)),
            setmaxnreg=sorted({int(n) for n in re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)}),
            tensormaps_made=len(re.findall(r"tensormap\\.replace", ptx)),
            spills=[int(n) for n in re.findall(r"(\\d+) bytes spill stores", info)],
            warps=compiled.metadata.num_warps, shared=compiled.metadata.shared,
        )
    print(json.dumps(report))
    """
)

_VARIANTS = {
    "nn-128x256-s3": dict(dtype="float16", layout="NN", broadcast="", epilogue=False, tile=[128, 256, 3]),
    "tt-256x128-s4": dict(dtype="bfloat16", layout="TT", broadcast="", epilogue=False, tile=[256, 128, 4]),
    "nt-128x128-s6-broadcast-b": dict(dtype="float16", layout="NT", broadcast="b", epilogue=False,
                                      tile=[128, 128, 6]),
    "tn-128x256-s3-broadcast-a-epilogue": dict(dtype="bfloat16", layout="TN", broadcast="a", epilogue=True,
                                               tile=[128, 256, 3]),
}


def test_batched_compiled_code(tmp_path):
    report = compile_offline(tmp_path, _COMPILE, _VARIANTS, timeout=900)
    for name, r in report.items():
        v = _VARIANTS[name]
        bm = v["tile"][0]
        # The 2-D kernel's MMAs (4 k16 MMAs per 64 rows of a half tile, at two places, in two consumers).
        assert r["mmas"] == 4 * (bm // 2 // 64) * 2 * 2, f"{name}: {r['mmas']} MMA instructions"
        # TMA loads: 3-D boxes for each batched operand, 2-D for a broadcast one; the output stored in 3-D
        # (by each consumer, in the SHARED_OUT and the per-warp-group branch alike).
        batched = 2 - (v["broadcast"] != "")
        assert r["loads3d"] == batched and r["loads2d"] == 2 - batched, f"{name}: {r}"
        assert r["stores3d"] >= 2, f"{name}: {r}"
        assert r["warps"] == 12
        for regs in (gluon_f16.CONSUMER_REGS, gluon_f16.PRODUCER_REGS):
            assert regs in r["setmaxnreg"], f"{name}: {regs} not among {r['setmaxnreg']}"
        assert r["tensormaps_made"] == 0, f"{name}: descriptors made on the device"
        if not v["epilogue"]:
            assert r["spills"] and max(r["spills"]) == 0, f"{name}: spills {r['spills']}"


# --- on a GPU ---------------------------------------------------------------------------------------------------


def _hopper():
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("the Gluon kernel is written for sm_90")


def _reference(a, b, c=None, bias=None, alpha=1.0, beta=0.0, activation="none"):
    """fp32 torch: alpha * a @ b + beta * c + bias, then the activation."""
    out = alpha * torch.matmul(a.float(), b.float())
    if c is not None:
        out = out + beta * c.float()
    if bias is not None:
        out = out + bias.float()
    if activation == "gelu":
        out = torch.nn.functional.gelu(out)
    return out


def _check(out, ref, dtype):
    assert not torch.isnan(out).any(), "an output element was not written"
    for i in range(out.shape[0]):
        err = rel_err(out[i], ref[i])
        assert err <= tolerance(dtype), f"batch {i}: relative error {err:.2e}"


def _poisoned_out(B, M, N, dtype, pad=8):
    """A NaN-filled [B, M, N] view whose rows are ``pad`` longer: what lies past N must stay NaN."""
    full = torch.full((B, M, N + pad), float("nan"), device="cuda", dtype=dtype)
    return full, full[..., :N]


# (B, M, N, K): batches 1 / 3 / 8; M, N, K small, odd and not tile multiples (a row stride is padded to 16 bytes
# by slicing, so TMA can describe it); 1000 not a multiple of any tile. Outputs of N not a multiple of 8 (rows
# ending inside a 16-byte unit of the wider row) are refused, batched or not.
_SHAPES = [(3, 17, 257, 1000), (8, 1000, 17, 257), (3, 257, 1000, 17), (1, 1000, 264, 72), (8, 64, 136, 1000),
           (3, 1000, 1000, 1000), (1, 1000, 257, 72), (1, 64, 17, 1000), (3, 17, 264, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", _SHAPES, ids=lambda s: "b{}-{}x{}x{}".format(*s))
def test_batched_gluon_f16_matches_the_reference(shape, dtype, layout):
    """Every config, forced, into NaN-poisoned outputs with padded rows (the padding must stay NaN)."""
    _hopper()
    B, M, N, K = shape
    torch.manual_seed(0)
    a = _operand(B, M, K, layout[0] == "T", dtype, "cuda", pad=-M % 8 + 8 if layout[0] == "T" else -K % 8 + 8)
    b = _operand(B, K, N, layout[1] == "T", dtype, "cuda", pad=-K % 8 + 8 if layout[1] == "T" else -N % 8 + 8)
    ref = _reference(a, b)
    wrote_past = []
    for cfg in gluon_f16.configs():
        full, out = _poisoned_out(B, M, N, dtype, pad=-N % 8 + 8)
        p = _problem(a, b, out)
        if N % 8:  # rows that end inside a 16-byte unit of a wider row: TMA stores would write past N
            assert "16-byte unit" in persistent_tma.why_not(p)
            with pytest.raises(NotApplicable, match="16-byte unit"):
                persistent_tma.run_gluon_f16(p, cfg)
            continue
        assert persistent_tma.why_not(p) is None and gluon_f16.why_not(p) is None, persistent_tma.why_not(p)
        persistent_tma.run_gluon_f16(p, cfg)
        torch.cuda.synchronize()
        _check(out, ref, dtype)
        if not torch.isnan(full[..., N:]).all():
            wrote_past.append(cfg)
    assert not wrote_past, f"wrote past N: {wrote_past}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_batched_transposed_views_broadcast_and_epilogue(dtype):
    """A batch dim that is not outermost (a transposed 3-D view), an operand broadcast over the batch, and the
    whole epilogue with a batched C and a broadcast one."""
    _hopper()
    torch.manual_seed(1)
    B, M, N, K = 3, 264, 392, 200
    a = torch.randn(M, B, K, device="cuda").to(dtype).transpose(0, 1)  # batch stride K, row stride B * K
    b = torch.randn(K, N, device="cuda").to(dtype).expand(B, K, N)  # broadcast
    bias = torch.randn(N, device="cuda").to(dtype)
    for c in (torch.randn(B, M, N, device="cuda").to(dtype), torch.randn(M, N, device="cuda").to(dtype)):
        kw = dict(c=c, bias=bias, alpha=0.5, beta=-1.0, activation="gelu")
        ref = _reference(a, b, **kw)
        for cfg in gluon_f16.configs():
            out = torch.full((B, M, N), float("nan"), device="cuda", dtype=dtype)
            p = _problem(a, b, out, c, bias, 0.5, -1.0, "gelu")
            assert p.batch == B and p.b_strides[0] == 0 and p.a_strides[0] == K
            persistent_tma.run_gluon_f16(p, cfg)
            torch.cuda.synchronize()
            _check(out, ref, dtype)
    a2 = torch.randn(K, M, device="cuda").to(dtype).T.expand(B, M, K)  # A broadcast, column-major
    b2 = torch.randn(B, N, K, device="cuda").to(dtype).mT
    out = tilegemm.matmul(a2, b2, kernel="gluon_f16")
    _check(out, _reference(a2, b2), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(3, 1, 257, 17), (3, 17, 1, 64), (8, 257, 24, 1)], ids=str)
def test_what_gluon_f16_refuses_runs_elsewhere(shape, monkeypatch):
    """A dimension under 16: kernel="gluon_f16" refuses it, auto (switch on) still computes it."""
    _hopper()
    monkeypatch.setattr(dispatch, "GLUON_F16_BATCHED", True)
    B, M, N, K = shape
    a = torch.randn(B, M, K, device="cuda").half()
    b = torch.randn(B, K, N, device="cuda").half()
    with pytest.raises(NotApplicable):
        tilegemm.matmul(a, b, kernel="gluon_f16")
    _check(tilegemm.matmul(a, b), _reference(a, b), torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_auto_with_the_switch_on_runs_gluon_f16_and_replays(dtype, monkeypatch):
    """With dispatch.GLUON_F16_BATCHED on, auto takes a big batched product to gluon_f16; repeated calls (replays
    of the recorded launch over new tensors) and batched_matmul compute the new operands right."""
    _hopper()
    monkeypatch.setattr(dispatch, "GLUON_F16_BATCHED", True)
    B, M, N, K = 8, 1024, 1024, 64
    p = _problem(*(torch.empty(B, *s, device="cuda", dtype=dtype) for s in ((M, K), (K, N), (M, N))))
    assert dispatch.choose_kernel(p) == "gluon_f16"
    for _ in range(3):
        a = torch.randn(B, M, K, device="cuda").to(dtype)
        b = torch.randn(B, K, N, device="cuda").to(dtype)
        out = tilegemm.matmul(a, b)
        torch.cuda.synchronize()
        _check(out, _reference(a, b), dtype)
    _check(tilegemm.ops.grouped.batched_matmul(a, b), _reference(a, b), dtype)


def test_auto_takes_small_m_batched_products_to_gluon_f16_from_its_threshold(monkeypatch):
    _fake_hopper(monkeypatch)
    assert (dispatch.GLUON_F16_BATCHED_MIN_M, dispatch.GLUON_F16_BATCHED_SMALL_M_MAX_K) == (65, 384)
    assert dispatch.choose_kernel(_meta(256, 128, 128, 128)) == "gluon_f16"  # narrow N too: split_k the alternative
    assert dispatch.choose_kernel(_meta(64, 96, 512, 256)) == "gluon_f16"
    assert dispatch.choose_kernel(_meta(256, 64, 128, 128)) == "split_k"  # under the threshold
    assert dispatch.choose_kernel(_meta(2, 128, 1024, 128)) == "split_k"  # 16 tiles: under one per SM
    assert dispatch.choose_kernel(_meta(32, 120, 768, 768)) == "split_k"  # past the K bound: split_k's slices
    assert dispatch.choose_kernel(_meta(256, 128, 128, 128, out_dtype=torch.float32)) == "split_k"  # not 16-bit out
    monkeypatch.setattr(dispatch, "GLUON_F16_BATCHED", False)
    assert dispatch.choose_kernel(_meta(256, 128, 128, 128)) == "split_k"
