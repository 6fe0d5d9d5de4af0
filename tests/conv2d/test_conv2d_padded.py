"""Odd channel counts on the TMA kernel (ops/conv2d/padded.py): the padded operands (one Triton launch, run by
the interpreter), ``auto``'s rule, and the whole route under the interpreter with the Gluon kernel's launch
computed in torch from its own arguments (:func:`_emulate_tma_forward`: its TMA boxes, zero fill past a
descriptor's edge included); on the GPU, the route itself against F.conv2d, forward and backward."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

import tilegemm
from tilegemm.ops.conv2d import configs, dispatch, padded, tma_fwd, tma_wgrad
from tilegemm.ops.conv2d.problem import Geometry
from tilegemm.ops.conv2d.reference import conv2d_reference, tolerance

from conftest import SM90, assert_rel_close, compile_offline

CL = torch.channels_last


def _geo(N, C, H, W, K, R, S, stride=(1, 1), padding=(1, 1, 1, 1), dilation=(1, 1), groups=1):
    return Geometry(N, C, H, W, K, R, S, groups, stride, padding, dilation)


def _in_place_by_geometry(x, g):
    """:func:`padded.reads_in_place` without its GPU checks (the interpreter's tensors are on the CPU)."""
    return (g.Cg % 8 == 0 and x.stride(1) == 1 and g.H % g.stride[0] == 0 and g.W % g.stride[1] == 0
            and (g.stride[1] == 1 or x.stride(3) == g.C))


def _poison_workspaces(x, g):
    """Fill the padded route's workspaces with NaN, so an element the copy leaves unwritten shows."""
    from tilegemm.core.workspace import buffer

    pl = padded.plan(x, g)
    buffer(x.device, x.dtype, g.N * pl.geo.H * pl.geo.W * pl.geo.C, "conv2d-pad-input").fill_(float("nan"))
    buffer(x.device, x.dtype, g.K * g.R * g.S * padded.padded_group(g.Cg), "conv2d-pad-weight").fill_(float("nan"))


@pytest.mark.parametrize("N,C,H,W,K,R,S,stride,padding,dilation,groups,layout", [
    (2, 17, 5, 6, 23, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 1, CL),
    (2, 33, 7, 5, 47, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1), 1, torch.contiguous_format),  # rows, columns rounded up
    (1, 57, 6, 6, 13, 3, 3, (1, 1), (2, 2, 2, 2), (2, 2), 1, CL),
    (2, 18, 5, 5, 12, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), 2, CL),  # 9 channels a group, each padded to 16
    (1, 40, 9, 7, 8, 5, 5, (3, 2), (2, 0, 2, 1), (1, 1), 1, torch.contiguous_format),
])
def test_padded_operands_are_the_same_convolution(N, C, H, W, K, R, S, stride, padding, dilation, groups, layout,
                                                  device):
    # the copy (each group's channels padded with zeros, the image rounded up to the stride) and the padded weight
    # in one launch; conv over them with the plan's geometry equals conv over the layer's own operands
    g = _geo(N, C, H, W, K, R, S, stride, padding, dilation, groups)
    x = torch.randn(N, C, H, W, device=device).contiguous(memory_format=layout)
    w = torch.randn(K, C // groups, R, S, device=device)
    _poison_workspaces(x, g)
    xp, wp, keep, pl = padded.operands(x, w, g)
    cgp = padded.padded_group(g.Cg)
    gp = pl.geo
    assert not pl.in_place and len(keep) == 2 and pl.x_channels == gp.C == groups * cgp
    assert gp.H % stride[0] == 0 and gp.W % stride[1] == 0 and (gp.P, gp.Q) == (g.P, g.Q)
    assert xp.shape == (N, gp.C, gp.H, gp.W) and xp.is_contiguous(memory_format=CL)
    assert wp.shape == (K, cgp, R, S) and wp.is_contiguous(memory_format=CL)
    assert not xp.isnan().any() and not wp.isnan().any()  # every element written
    xg = xp.view(N, groups, cgp, gp.H, gp.W)
    assert torch.equal(xg[:, :, :g.Cg, :H, :W], x.view(N, groups, g.Cg, H, W))  # the values, per group
    assert not xg[:, :, g.Cg:].any() and not xp[:, :, H:].any() and not xp[:, :, :, W:].any()
    assert torch.equal(wp[:, :g.Cg], w) and not wp[:, g.Cg:].any()
    t, b, l, r = gp.padding  # the bottom and right padding less the rounded-up rows (F.pad crops where negative)
    got = F.conv2d(F.pad(xp.double(), (l, r, t, b)), wp.double(), stride=stride, dilation=dilation, groups=groups)
    top, bottom, left, right = padding
    want = F.conv2d(F.pad(x.double(), (left, right, top, bottom)), w.double(), stride=stride, dilation=dilation,
                    groups=groups)
    assert_rel_close(got, want, 1e-12)


_COMPILE_PAD = SM90 + textwrap.dedent(
    """
    import collections, json, re, sys
    import torch
    from tilegemm.core import launch as launch_module
    from tilegemm.core import workspace
    from tilegemm.ops.conv2d import padded
    from tilegemm.ops.conv2d.problem import Geometry

    seen = []
    launch_module.launch = lambda kernel, grid, args, kwargs, **_: seen.append((kernel, args, kwargs))
    workspace.buffer = lambda device, dtype, n, tag: torch.empty(n, dtype=dtype)
    report = {}
    for name, (C, K, layout) in json.loads(sys.argv[1]).items():
        x = torch.empty(8, C, 28, 28, dtype=torch.float16)
        x = x.contiguous(memory_format=torch.channels_last) if layout == "cl" else x
        seen.clear()
        padded.operands(x, torch.empty(K, C, 3, 3, dtype=torch.float16), Geometry(8, C, 28, 28, K, 3, 3, 1, (1, 1),
                                                                                  (1,) * 4, (1, 1)))
        kernel, args, kwargs = seen[0]
        sig, constexprs, attrs = launch_signature(kernel, args, kwargs)
        for i, arg in enumerate(kernel.arg_names[:len(args)]):  # as Triton specializes integer arguments
            value = args[i]
            if isinstance(value, int) and not isinstance(value, bool) and value == 1:
                sig[arg], constexprs[(i,)] = "constexpr", 1
            elif isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        _, ptx, _ = compile_sm90(kernel, sig, constexprs, attrs, kwargs["num_warps"], gluon=False)
        report[name] = collections.Counter(re.findall(r"\\b((?:ld|st)\\.global[.\\w]*)", ptx))
    print(json.dumps(report))
    """
)


def test_the_copy_stores_16_bytes_at_a_time(tmp_path):
    # compiled for sm_90 without a GPU: the padded copy's rows are whole 16-byte runs, stored so; an NCHW source
    # is read along its pixels 16 bytes at a time (a channels-last one of 57 channels has no aligned run to read)
    ops = compile_offline(tmp_path, _COMPILE_PAD, {"cl": [57, 113, "cl"], "nchw": [57, 113, "nchw"]}, timeout=300)
    for name, counts in ops.items():
        assert counts.get("st.global.v4.b32", 0) > 0 and not any(op.startswith("st.global.b16") for op in counts), \
            f"{name}: {counts}"
    assert ops["nchw"].get("ld.global.v4.b32", 0) > 0, ops["nchw"]


def test_an_input_read_in_place_gets_only_its_weight_padded(device, monkeypatch):
    # one group, stride 1 along the width, C a multiple of 8: the kernel reads x itself (a channel step past C is
    # TMA's zero fill), so the launch writes only the weight, and no input workspace is kept
    monkeypatch.setattr(padded, "reads_in_place", _in_place_by_geometry)
    g = _geo(2, 24, 6, 5, 7, 3, 3)
    x = torch.randn(2, 24, 6, 5, device=device).contiguous(memory_format=CL)
    w = torch.randn(7, 24, 3, 3, device=device)
    xp, wp, keep, pl = padded.operands(x, w, g)
    assert pl.in_place and xp is x and len(keep) == 1 and pl.x_channels == 24
    assert pl.geo == _geo(2, 32, 6, 5, 7, 3, 3)
    assert torch.equal(wp[:, :24], w) and not wp[:, 24:].any()


def test_auto_pads_odd_channels_where_it_pays():
    from tilegemm.ops.conv2d.dispatch import PAD_MIN_CHANNELS, choose_kernel, pads_channels, padding_pays

    def geo(C, K, R, stride=1, groups=1, S=None):
        S = S or R
        return Geometry(32, C, 56, 56, K, R, S, groups, (stride, stride), (R // 2, R // 2, S // 2, S // 2), (1, 1))

    for g in (geo(57, 113, 3), geo(35, 67, 3, 2), geo(24, 40, 5), geo(48, 48, 3, groups=2), geo(17, 23, 1, S=7)):
        assert pads_channels(g) and padding_pays(g)
        # 16-bit groups of 24 take grouped_packed (several groups a tile); fp32 ones the padded TMA route
        want = "grouped_packed" if g.groups > 1 else "tma_implicit_gemm"
        assert choose_kernel(g, True, tma=True) == want
        assert choose_kernel(g, True, tma=True, sixteen_bit=False) == "tma_implicit_gemm"
        # off Hopper: the pointer kernel, as before (16-bit groups: grouped_packed there too)
        assert choose_kernel(g, True, tma=False) == ("grouped_packed" if g.groups > 1 else "implicit_gemm")
    assert choose_kernel(geo(100, 200, 1), True, tma=True) == "gemm_1x1"  # 1x1: its GEMM takes any channel count
    assert choose_kernel(geo(100, 200, 1, 2), True, tma=True) == "gemm_1x1"  # strided too (gathered rows)
    assert choose_kernel(geo(12, 24, 3), True, tma=True) == "implicit_gemm"  # under PAD_MIN_CHANNELS
    assert 12 < PAD_MIN_CHANNELS <= 17
    assert choose_kernel(geo(57, 57, 3, groups=57), True, tma=True) == "depthwise"
    assert choose_kernel(geo(60, 60, 3, groups=15), True, tma=True) == "grouped_packed"  # 4 channels a group
    assert choose_kernel(geo(60, 60, 3, groups=15), True, tma=True, sixteen_bit=False) == "grouped_direct"
    assert not pads_channels(geo(3, 64, 7, 2)) and not pads_channels(geo(64, 113, 3))  # a stem; aligned
    assert choose_kernel(geo(3, 64, 7, 2), True, tma=True) == "tma_implicit_gemm"


def _input_boxes(x_desc, P, Q, eh, ew, SH, SW, off_h, off_w, channels):
    """The input elements the TMA kernels' boxes hold for a tap (shift ``eh``, ``ew`` past the offsets) over all
    P x Q output pixels and the given channels of the descriptor's last dim, ``[N, P, Q, channels]`` in float64:
    zero outside the descriptor's shape, as TMA fills."""
    x5 = x_desc.base.as_strided(x_desc.shape, x_desc.strides).double()
    _, D1, _, D3, D4 = x5.shape
    d1, d3 = torch.arange(P) + eh // SH - off_h // SH, torch.arange(Q) + ew // SW - off_w // SW
    d4 = (ew % SW) * channels[0] + channels[1]
    a = x5[:, d1.clamp(0, D1 - 1)][:, :, eh % SH][:, :, d3.clamp(0, D3 - 1)][..., d4.clamp(max=D4 - 1)]
    inside = (((d1 >= 0) & (d1 < D1))[:, None, None] & ((d3 >= 0) & (d3 < D3))[None, :, None]
              & (d4 < D4)[None, None, :])
    return a * inside


def _emulate_tma_forward(args, kwargs):
    """What ``conv2d_fwd_tma_kernel`` computes from its launch arguments, in float64: for each group, tap and
    channel, the element TMA's input box holds (zero outside the descriptor's shape, as TMA fills), times the
    weight box's, accumulated into the output through its strides, bias and activation after."""
    x_desc, w_desc, base, bias = args[:4]
    (N, P, Q, Kg, Cg, C_ROW, Cg_x, _, _, offset, s_on, s_op, s_oq, s_ok, s_b,
     pad_h, pad_w, dil_h, dil_w, off_h, off_w) = args[4:]
    R, S, SH, SW, BK = (kwargs[k] for k in ("R", "S", "SH", "SW", "BLOCK_K"))
    assert Cg % BK == 0 and x_desc.block_shape[4] == BK  # channel steps tile the (padded) group exactly
    w2 = w_desc.base.as_strided(w_desc.shape, w_desc.strides).double()
    groups = w2.shape[0] // Kg
    acc = torch.zeros(N, P, Q, groups * Kg, dtype=torch.float64)
    j = torch.arange(Cg)
    for grp in range(groups):
        for r in range(R):
            for s in range(S):
                eh, ew = r * dil_h - pad_h + off_h, s * dil_w - pad_w + off_w
                a = _input_boxes(x_desc, P, Q, eh, ew, SH, SW, off_h, off_w, (C_ROW, grp * Cg_x + j))
                wt = w2[grp * Kg:(grp + 1) * Kg, (r * S + s) * Cg + j]  # [Kg, Cg]
                acc[..., grp * Kg:(grp + 1) * Kg] += torch.einsum("npqc,kc->npqk", a, wt)
    if kwargs["HAS_BIAS"]:
        acc += bias.double()
    if kwargs["ACTIVATION"] == "relu":
        acc = acc.relu()
    else:
        assert kwargs["ACTIVATION"] == "none"
    K = groups * Kg
    base.as_strided((N, P, Q, K), (s_on, s_op, s_oq, s_ok), base.storage_offset() + offset).copy_(acc)


def _emulate_tma_wgrad(args, kwargs):
    """What ``conv2d_wgrad_tma_kernel`` computes from its launch arguments, in float64: per group and tap, the
    output gradients' box times the input's boxes over every output pixel (pixels past P x Q have zero output
    gradients there), stored for the layer's own K/groups x C/groups (the boxes' further channels are not)."""
    dy_desc, x_desc, dw = args[:3]
    (Kg, Cg, C_ROW, _, _, _, _, _, _, _, _, pad_h, pad_w, dil_h, dil_w, off_h, off_w) = args[5:]
    R, S, SH, SW = (kwargs[k] for k in ("R", "S", "SH", "SW"))
    dy4 = dy_desc.base.as_strided(dy_desc.shape, dy_desc.strides).double()  # [N, P, Q, K or a copy's more]
    _, P, Q, _ = dy4.shape
    j = torch.arange(Cg)
    for grp in range(dw.shape[0] // Kg):
        for r in range(R):
            for s in range(S):
                eh, ew = r * dil_h - pad_h + off_h, s * dil_w - pad_w + off_w
                a = _input_boxes(x_desc, P, Q, eh, ew, SH, SW, off_h, off_w, (C_ROW, grp * Cg + j))
                dw[grp * Kg:(grp + 1) * Kg, :, r, s] = torch.einsum(
                    "npqk,npqc->kc", dy4[..., grp * Kg:(grp + 1) * Kg], a)


def _why_not_input_here(x, weight, g, channel_step=16):
    """:func:`tma_fwd.why_not_input` without its GPU checks, for 16-bit rows (the interpreter's tensors are fp32
    on the CPU): channels-last, C/groups a multiple of ``channel_step``, the image a multiple of the stride, packed
    pixels at a horizontal stride, strides of whole 8-element (16-byte) rows."""
    sh, sw = g.stride
    if x.stride(1) != 1:
        return "input not channels-last"
    if g.Cg % channel_step:
        return f"C/groups not a multiple of {channel_step}"
    if g.H % sh or g.W % sw:
        return "image size not divisible by the stride"
    strides = tma_fwd._strides(x)
    if sw > 1 and strides[2] != g.C:
        return "pixels not packed"
    return "strides not 16-byte aligned" if any(st % 8 for st in strides) else None


@pytest.fixture
def hopper_like(monkeypatch):
    """``auto`` as on an H200 for these layers: the TMA kernel takes them (padded), NCHW inputs go through the
    NCHW route, and the Gluon launches are :func:`_emulate_tma_forward` and :func:`_emulate_tma_wgrad`. Returns
    what ran: the padded forward's plans (``in_place``), the padded data gradients (whether ``dx`` was NCHW) and
    the TMA weight gradients (their pixel splits)."""
    from tilegemm.core import launch as launch_module
    from tilegemm.ops.conv2d.layout import planar

    plans = dict(fwd=[], dgrad=[], wgrad=[])
    real_launch, real_operands, real_dgrad = launch_module.launch, padded.operands, padded.dgrad

    def fake_launch(kernel, grid, args, kwargs, **kw):
        if kernel is tma_fwd.conv2d_fwd_tma_kernel:
            return _emulate_tma_forward(args, kwargs)
        if kernel is tma_wgrad.conv2d_wgrad_tma_kernel:
            plans["wgrad"].append(kwargs["SPLIT"])
            return _emulate_tma_wgrad(args, kwargs)
        return real_launch(kernel, grid, args, kwargs, **kw)

    def spy_operands(x, weight, g, wide=False):
        out = real_operands(x, weight, g, wide)
        plans["fwd"].append(out[3].in_place)
        plans.setdefault("wide", []).append(wide)
        return out

    def why_not_padded(x, weight, g, wide=False):
        if wide:
            return None if configs.wide_group(g.Cg) > g.Cg and padded.reads_in_place(x, g) else "not wide"
        return None if g.Cg % 16 else "aligned"

    def spy_dgrad(*args, **kwargs):
        dx = real_dgrad(*args, **kwargs)
        if kwargs.get("wide"):
            plans.setdefault("dgrad_wide", []).append(dx is not None)
        else:
            plans["dgrad"].append(dx is not None and dx.is_contiguous())
        return dx

    monkeypatch.setattr(launch_module, "launch", fake_launch)
    monkeypatch.setattr(padded, "operands", spy_operands)
    monkeypatch.setattr(padded, "dgrad", spy_dgrad)
    monkeypatch.setattr(dispatch, "_tma_candidate", lambda t: True)  # the data gradient's TMA routes
    monkeypatch.setattr(tma_fwd, "why_not_input", _why_not_input_here)
    monkeypatch.setattr(padded, "why_not", why_not_padded)
    monkeypatch.setattr(padded, "why_not_wgrad", lambda dy, x, g: None if g.groups == 1 else "groups")
    monkeypatch.setattr(dispatch, "_tma_usable", lambda p: True)
    monkeypatch.setattr(dispatch, "_nchw_route", lambda x: planar(x) and x.shape[1] > dispatch.STEM_MAX_C)
    return plans


ODD = [  # (N, C, H, W, K, R, S, conv, in place for a channels-last input)
    pytest.param(2, 17, 5, 6, 23, 3, 3, dict(padding=1), False, id="17-23"),
    pytest.param(2, 33, 7, 6, 47, 3, 3, dict(stride=2, padding=1), False, id="33-47-stride2-odd-rows"),
    pytest.param(1, 57, 6, 5, 113, 3, 3, dict(padding=2, dilation=2), False, id="57-113-dilated"),
    pytest.param(2, 24, 6, 5, 40, 3, 3, dict(padding=1), True, id="24-40-in-place"),
    pytest.param(2, 40, 8, 5, 19, 3, 3, dict(stride=(2, 1), padding=1), True, id="40-19-stride2x1-in-place"),
    pytest.param(2, 40, 8, 6, 24, 3, 3, dict(stride=2, padding=1), True, id="40-24-stride2-in-place"),
    pytest.param(1, 48, 6, 6, 36, 3, 3, dict(padding=1, groups=2), True, id="48-36-groups2-in-place"),
    pytest.param(1, 60, 8, 6, 36, 3, 3, dict(stride=2, padding=1, groups=3), False, id="60-36-groups3-stride2"),
    pytest.param(1, 20, 6, 7, 9, 5, 5, dict(stride=2, padding=2), False, id="20-9-5x5-stride2"),
]


@pytest.mark.parametrize("layout", [CL, torch.contiguous_format], ids=["channels-last", "nchw"])
@pytest.mark.parametrize("N,C,H,W,K,R,S,conv,in_place", ODD)
def test_auto_runs_odd_channels_padded_forward_and_backward(N, C, H, W, K, R, S, conv, in_place, layout,
                                                            hopper_like, device):
    groups = conv.get("groups", 1)
    x = torch.randn(N, C, H, W, device=device).contiguous(memory_format=layout).requires_grad_()
    w = (torch.randn(K, C // groups, R, S, device=device) / (C // groups * R * S) ** 0.5).requires_grad_()
    b = torch.randn(K, device=device).requires_grad_()
    out = tilegemm.conv2d(x, w, b, activation="relu", **conv)  # outputs NaN-poisoned
    # the padded route ran (an NCHW input is copied whatever its channels), into the layer's own output
    assert hopper_like["fwd"] == [in_place and layout == CL]
    assert out.shape == F.conv2d(x.detach(), w.detach(), b.detach(), **conv).shape
    assert out.is_contiguous(memory_format=layout)
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = conv2d_reference(xr, wr, br, **conv, activation="relu")
    assert_rel_close(out, ref, tolerance(torch.float32))
    # the gradients, in the layouts torch gives: the data gradient of a stride-1 layer over K/groups not a
    # multiple of 16 (at least 16) through the padded route too (its dy padded), the others the pointer kernels'
    dy = torch.randn_like(ref).float()
    out.backward(dy)
    ref.backward(dy.double())
    kg = K // groups
    padded_dgrad = conv.get("stride", 1) == 1 and kg >= 16 and kg % 16 != 0
    assert hopper_like["dgrad"] == ([layout != CL] if padded_dgrad else [])
    # the weight gradient on the TMA kernel for one group (over copies where C or K is not a multiple of 8)
    assert len(hopper_like["wgrad"]) == (groups == 1)
    assert x.grad.is_contiguous(memory_format=layout)
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        assert_rel_close(got, want, tolerance(torch.float32))


def test_wide_steps_pad_16_wide_groups_where_fewer_deeper_steps_cost_less():
    # 16 * odd channels a group step 16 deep; the weight padded to 64 or 32 channels a tap widens the steps where
    # the padding adds at most a third of the channels and the steps' cost model says it pays
    assert {c: configs.wide_group(c) for c in (48, 80, 112, 144, 176, 208, 240)} == \
        {48: 64, 80: 96, 112: 128, 144: 192, 176: 192, 208: 256, 240: 256}
    for c in (16, 24, 32, 57, 64, 96, 160):  # one step already, not a multiple of 16 (padded_group's), or wider
        assert configs.wide_group(c) == c
    def step(n):  # the kernel's K step over n channels a tap
        return 64 if n % 64 == 0 else 32 if n % 32 == 0 else 16

    for c in range(16, 1025, 16):
        w = configs.wide_group(c)
        assert w - c <= c / 3 and configs._steps_cost(c, step(w)) <= configs._steps_cost(c, step(c))
        assert (w > c) == (c % 32 == 16 and c > 16)  # every 16-wide group of more than one step is widened
    assert dispatch.widens_steps(_geo(32, 48, 56, 56, 192, 3, 3))
    assert dispatch.widens_steps(_geo(32, 80, 56, 56, 80, 3, 3, stride=(2, 1)))
    # at horizontal stride 2 the steps past C would read the next stride phase's channels (an inf there would make
    # NaN where F.conv2d has none); a small layer does not repay the weight's padding launch
    assert not dispatch.widens_steps(_geo(32, 80, 56, 56, 80, 3, 3, stride=(2, 2)))
    assert not dispatch.widens_steps(_geo(32, 48, 7, 7, 128, 3, 3))
    assert dispatch.widens_steps(_geo(32, 48, 35, 35, 64, 5, 5, padding=(2,) * 4))
    assert not dispatch.widens_steps(_geo(32, 48, 56, 56, 192, 1, 1, padding=(0,) * 4))  # a 1x1: a GEMM
    assert not dispatch.widens_steps(_geo(32, 224, 56, 56, 224, 3, 3, groups=2))  # grouped: left as they are
    assert not dispatch.widens_steps(_geo(32, 64, 56, 56, 64, 3, 3))
    assert not dispatch.widens_steps(_geo(32, 16, 56, 56, 64, 3, 3))


def test_wide_steps_pad_only_the_weight(device, monkeypatch):
    monkeypatch.setattr(padded, "reads_in_place", _in_place_by_geometry)
    g = _geo(2, 80, 6, 5, 7, 3, 3)
    x = torch.randn(2, 80, 6, 5, device=device).contiguous(memory_format=CL)
    w = torch.randn(7, 80, 3, 3, device=device)
    buffer_nan = torch.full((7 * 9 * 96,), float("nan"), device=device)
    monkeypatch.setattr("tilegemm.core.workspace.buffer", lambda *a: buffer_nan)
    xp, wp, keep, pl = padded.operands(x, w, g, wide=True)
    assert pl.in_place and xp is x and len(keep) == 1 and pl.x_channels == 80
    assert pl.geo == _geo(2, 96, 6, 5, 7, 3, 3)
    assert wp.shape == (7, 96, 3, 3) and torch.equal(wp[:, :80], w) and not wp[:, 80:].any()
    # an input the kernel cannot read in place (NCHW) is refused, not copied
    nchw = x.contiguous()
    with pytest.raises(ValueError, match="in place"):
        padded.plan(nchw, g, wide=True)


WIDE = [  # (N, C, H, W, K, R, S, conv)
    pytest.param(2, 48, 6, 5, 40, 3, 3, dict(padding=1), id="48-40"),
    pytest.param(2, 80, 8, 6, 24, 3, 3, dict(stride=2, padding=1), id="80-24-stride2-direct"),
    pytest.param(2, 80, 8, 6, 24, 3, 3, dict(stride=(2, 1), padding=1), id="80-24-stride2x1"),
    pytest.param(1, 112, 6, 7, 20, 5, 5, dict(padding=2, dilation=1), id="112-20-5x5"),
    pytest.param(1, 48, 7, 6, 17, 3, 3, dict(padding=2, dilation=2), id="48-17-dilated"),
    pytest.param(2, 48, 5, 6, 80, 3, 3, dict(padding=1), id="48-80-wide-data-gradient"),
    pytest.param(2, 112, 6, 4, 48, 3, 3, dict(stride=(1, 2), padding=1), id="112-48-stride1x2-direct"),
]


@pytest.mark.parametrize("layout", [CL, torch.contiguous_format], ids=["channels-last", "nchw"])
@pytest.mark.parametrize("N,C,H,W,K,R,S,conv", WIDE)
def test_auto_widens_16_wide_steps_forward_and_backward(N, C, H, W, K, R, S, conv, layout, hopper_like, device,
                                                         monkeypatch):
    # auto (as on an H200, the Gluon kernel emulated from its launch arguments) runs these layers over the input
    # read in place (an NCHW one: its channels-last copy) and a weight padded to wider steps, at horizontal stride 1;
    # the data gradient of a stride-1 layer of 16 x odd output channels the same way over dy (the weight padded)
    monkeypatch.setattr(configs, "WIDE_STEP_MIN_FLOPS", 0)  # these small layers too
    x = torch.randn(N, C, H, W, device=device).contiguous(memory_format=layout).requires_grad_()
    w = (torch.randn(K, C, R, S, device=device) / (C * R * S) ** 0.5).requires_grad_()
    b = torch.randn(K, device=device).requires_grad_()
    out = tilegemm.conv2d(x, w, b, activation="relu", **conv)
    stride = conv.get("stride", 1)
    wide = (stride if isinstance(stride, int) else stride[1]) == 1
    if wide:
        assert hopper_like["fwd"] == [True] and hopper_like["wide"] == [True]
    else:
        assert hopper_like["fwd"] == []  # the direct kernel's 16-wide steps
    assert out.is_contiguous(memory_format=layout)
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = conv2d_reference(xr, wr, br, **conv, activation="relu")
    assert_rel_close(out, ref, tolerance(torch.float32))
    dy = torch.randn_like(ref).float().contiguous(memory_format=layout)
    out.backward(dy)
    ref.backward(dy.double())
    wide_dgrad = conv.get("stride", 1) == 1 and K % 32 == 16
    assert hopper_like.get("dgrad_wide", []) == ([True] if wide_dgrad else [])
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        assert_rel_close(got, want, tolerance(torch.float32))


# --- on the GPU ------------------------------------------------------------------------------------------


def _check_replay_reads_the_weight_anew(x, w, conv, dtype):
    """Plain calls are recorded, then replayed: a replay pads the weight as it is then (updated in place)."""
    with torch.no_grad():
        xs, ws = x.detach(), w.detach()
        first = tilegemm.conv2d(xs, ws, None, **conv)
        ws.mul_(-1.5)
        again = tilegemm.conv2d(xs, ws, None, **conv)
    assert_rel_close(first, conv2d_reference(xs, ws / -1.5, **conv), tolerance(dtype))
    assert_rel_close(again, conv2d_reference(xs, ws, **conv), tolerance(dtype))


GPU_ODD = [  # (N, C, H, W, K, R, S, conv, in place for a channels-last input)
    pytest.param(4, 57, 28, 28, 113, 3, 3, dict(padding=1), False, id="57-113"),
    pytest.param(3, 17, 15, 17, 23, 3, 3, dict(padding=1), False, id="17-23-odd-image"),
    pytest.param(3, 35, 28, 27, 67, 3, 3, dict(stride=2, padding=1), False, id="35-67-stride2-odd-columns"),
    pytest.param(2, 33, 14, 14, 47, 3, 3, dict(padding=2, dilation=2), False, id="33-47-dilated"),
    pytest.param(3, 24, 20, 20, 40, 5, 5, dict(padding=2), True, id="24-40-5x5-in-place"),
    pytest.param(2, 200, 14, 14, 72, 3, 3, dict(padding=1), True, id="200-72-in-place-past-a-64-step"),
    pytest.param(2, 40, 16, 12, 24, 3, 3, dict(stride=(2, 1), padding=1), True, id="40-24-stride2x1-in-place"),
    pytest.param(2, 120, 14, 14, 120, 3, 3, dict(padding=1, groups=5), True, id="120-groups5-24-a-group"),
    pytest.param(2, 48, 28, 28, 48, 3, 3, dict(stride=2, padding=1, groups=2), True, id="48-groups2-stride2"),
    pytest.param(2, 60, 12, 12, 45, 3, 3, dict(padding=1, groups=3), False, id="60-45-groups3-20-a-group"),
    pytest.param(2, 100, 9, 9, 36, 1, 7, dict(padding=(0, 3)), False, id="100-36-1x7"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", [CL, torch.contiguous_format], ids=["channels-last", "nchw"])
@pytest.mark.parametrize("N,C,H,W,K,R,S,conv,in_place", GPU_ODD)
def test_gpu_odd_channels_through_the_padded_route(N, C, H, W, K, R, S, conv, in_place, layout, dtype, monkeypatch):
    from tilegemm.ops.conv2d import configs, op as replay

    # grouped layers of few channels a group go to grouped_packed under auto: off here, so that they take the
    # padded route this test is about (tests/conv2d/test_conv2d_grouped_packed.py checks auto's rule)
    monkeypatch.setattr(configs, "GROUPED_PACKED_AUTO_CHANNELS", 0)
    plans, dgrads, wgrads = [], [], []
    real, real_dgrad, real_wgrad = padded.operands, padded.dgrad, tma_wgrad.run
    monkeypatch.setattr(padded, "operands", lambda *a, **k: (lambda o: plans.append(o[3].in_place) or o)(
        real(*a, **k)))
    monkeypatch.setattr(padded, "dgrad", lambda *a, **k: (lambda dx: dgrads.append(dx is not None) or dx)(
        real_dgrad(*a, **k)))
    monkeypatch.setattr(tma_wgrad, "run", lambda *a, **k: wgrads.append(1) or real_wgrad(*a, **k))
    replay.REPLAYS.clear()
    groups = conv.get("groups", 1)
    x = torch.randn(N, C, H, W, device="cuda").to(dtype).contiguous(memory_format=layout).requires_grad_()
    w = (torch.randn(K, C // groups, R, S, device="cuda") / (C // groups * R * S) ** 0.5).to(dtype)
    w = w.contiguous(memory_format=layout).requires_grad_()
    b = torch.randn(K, device="cuda").to(dtype).requires_grad_()
    out = tilegemm.conv2d(x, w, b, activation="relu", **conv)
    assert plans == [in_place and layout == CL]
    assert out.is_contiguous(memory_format=layout) and out.dtype == dtype
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = conv2d_reference(xr, wr, br, **conv, activation="relu")
    assert_rel_close(out, ref, tolerance(dtype))
    dy = torch.randn(ref.shape, device="cuda").to(dtype).contiguous(memory_format=layout)
    out.backward(dy)
    ref.backward(dy.double())
    kg, cg = K // groups, C // groups
    assert dgrads == ([True] if conv.get("stride", 1) == 1 and kg >= 16 and kg % 16 else [])
    assert len(wgrads) == (groups == 1 or (cg % 8 == 0 and kg % 8 == 0))  # one group: over copies where odd
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        assert_rel_close(got, want, tolerance(dtype))
    _check_replay_reads_the_weight_anew(x, w, conv, dtype)


@pytest.mark.gpu
def test_gpu_odd_1x1_by_name_and_refusals():
    # asked for by name, the TMA kernel takes a 1x1 over odd channels too (auto gives those to their GEMM)
    x = torch.randn(2, 100, 12, 12, device="cuda").half().contiguous(memory_format=CL)
    w = torch.randn(36, 100, 1, 1, device="cuda").half() / 10
    out = tilegemm.conv2d(x, w, kernel="tma_implicit_gemm")
    assert_rel_close(out, conv2d_reference(x, w), tolerance(torch.float16))
    # fp32 is not the TMA kernel's, padded or not
    from tilegemm.ops.conv2d.checks import check_conv

    assert padded.why_not(x.float(), w.float(), check_conv(x, w, None, 1, 0, 1, 1)) == "not 16-bit"


GPU_WIDE = [  # (N, C, H, W, K, R, S, conv)
    pytest.param(4, 48, 28, 28, 192, 3, 3, dict(padding=1), id="48-192"),
    pytest.param(3, 80, 30, 28, 80, 3, 3, dict(stride=2, padding=1), id="80-80-stride2"),
    pytest.param(2, 112, 14, 14, 72, 5, 5, dict(padding=2), id="112-72-5x5"),
    pytest.param(2, 48, 15, 17, 24, 3, 3, dict(padding=2, dilation=2), id="48-24-dilated-odd-image"),
    pytest.param(3, 48, 20, 20, 80, 3, 3, dict(padding=1), id="48-80-wide-data-gradient"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", [CL, torch.contiguous_format], ids=["channels-last", "nchw"])
@pytest.mark.parametrize("N,C,H,W,K,R,S,conv", GPU_WIDE)
def test_gpu_wide_steps(N, C, H, W, K, R, S, conv, layout, dtype, monkeypatch):
    # 16 * odd channels: auto pads only the weight (the input, or an NCHW input's channels-last copy, read in place)
    # at horizontal stride 1; the stride-2 case runs the direct 16-wide steps
    from tilegemm.ops.conv2d import op as replay

    monkeypatch.setattr(configs, "WIDE_STEP_MIN_FLOPS", 0)  # these small layers too
    wides, dgrads = [], []
    real, real_dgrad = padded.operands, padded.dgrad

    def spy_operands(x, weight, g, wide=False):
        wides.append(wide)
        return real(x, weight, g, wide=wide)

    def spy_dgrad(*a, wide=False, **k):
        dx = real_dgrad(*a, wide=wide, **k)
        if wide:
            dgrads.append(dx is not None)
        return dx

    monkeypatch.setattr(padded, "operands", spy_operands)
    monkeypatch.setattr(padded, "dgrad", spy_dgrad)
    replay.REPLAYS.clear()
    x = torch.randn(N, C, H, W, device="cuda").to(dtype).contiguous(memory_format=layout).requires_grad_()
    w = (torch.randn(K, C, R, S, device="cuda") / (C * R * S) ** 0.5).to(dtype).requires_grad_()
    b = torch.randn(K, device="cuda").to(dtype).requires_grad_()
    out = tilegemm.conv2d(x, w, b, activation="relu", **conv)
    stride1 = conv.get("stride", 1) == 1
    assert wides == ([True] if stride1 else []) and out.is_contiguous(memory_format=layout) and out.dtype == dtype
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = conv2d_reference(xr, wr, br, **conv, activation="relu")
    assert_rel_close(out, ref, tolerance(dtype))
    dy = torch.randn(ref.shape, device="cuda").to(dtype).contiguous(memory_format=layout)
    out.backward(dy)
    ref.backward(dy.double())
    assert dgrads == ([True] if stride1 and K % 32 == 16 else [])
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        assert_rel_close(got, want, tolerance(dtype))
    # the steps past C read TMA's zero fill, not the next pixel's channels: an inf inside the image stays where
    # F.conv2d has it
    if stride1 and layout == CL:
        xi = x.detach().clone()
        xi[0, :, H // 2, W // 2 + 1] = float("inf")
        got, want = tilegemm.conv2d(xi, w.detach(), None, **conv), F.conv2d(xi.float(), w.detach().float(), **conv)
        assert torch.equal(got.isfinite(), want.isfinite())
    _check_replay_reads_the_weight_anew(x, w, conv, dtype)
