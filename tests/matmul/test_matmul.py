"""Every rung x layout x odd shape x dtype x epilogue against a float64 reference."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.ops.matmul.reference import matmul_reference, tolerance

from conftest import assert_rel_close, crossed, kernels, mm

RUNGS = kernels("matmul")  # every registered kernel, then "auto"
SHAPES = [(1, 1, 1), (1, 17, 33), (17, 1, 5), (33, 65, 17), (100, 70, 129), (257, 31, 40)]
LAYOUTS = ["NN", "NT", "TN", "TT"]


def make_operand(rows: int, cols: int, transposed: bool, dtype, device, batch=()):
    """A [*batch, rows, cols] operand; transposed ones are views of a [*batch, cols, rows] tensor."""
    if transposed:
        return torch.randn(*batch, cols, rows, dtype=dtype, device=device).mT
    return torch.randn(*batch, rows, cols, dtype=dtype, device=device)


@crossed("dtype, shape, layout, kernel", [torch.float16, torch.float32], SHAPES, LAYOUTS, RUNGS,
         ids=(lambda d: str(d)[6:], lambda s: "x".join(map(str, s))))
def test_layouts_and_odd_shapes(kernel, layout, shape, dtype, device):
    M, N, K = shape
    a = make_operand(M, K, layout[0] == "T", dtype, device)
    b = make_operand(K, N, layout[1] == "T", dtype, device)
    a0, b0 = a.clone(), b.clone()
    out = mm(a, b, kernel=kernel, precision="ieee")
    assert out.dtype == dtype and out.device == a.device
    assert_rel_close(out, matmul_reference(a, b), tolerance(dtype))
    assert torch.equal(a, a0) and torch.equal(b, b0), "inputs were modified"


@crossed("dtype, activation, kernel", [torch.float16, torch.float32], tilegemm.ACTIVATIONS, RUNGS,
         ids=(lambda d: str(d)[6:],))
def test_fused_epilogue(kernel, activation, dtype, device):
    M, N, K = 45, 37, 50
    a = torch.randn(M, K, dtype=dtype, device=device)
    b = torch.randn(K, N, dtype=dtype, device=device)
    bias = torch.randn(N, dtype=dtype, device=device)
    c = torch.randn(M, N, dtype=dtype, device=device)
    kwargs = dict(bias=bias, c=c, alpha=0.5, beta=-1.5, activation=activation)
    out = mm(a, b, kernel=kernel, precision="ieee", **kwargs)
    assert_rel_close(out, matmul_reference(a, b, **kwargs), tolerance(dtype))


@pytest.mark.parametrize("kernel", ["naive", "grouped", "autotuned"])
def test_epilogue_parts_alone(kernel, device):
    a = torch.randn(19, 23, device=device)
    b = torch.randn(23, 29, device=device)
    c = torch.randn(19, 29, device=device)
    bias = torch.randn(29, device=device)
    for kwargs in (dict(alpha=2.0), dict(bias=bias), dict(c=c), dict(c=c, beta=0.0), dict(activation="relu")):
        out = mm(a, b, kernel=kernel, precision="ieee", **kwargs)
        assert_rel_close(out, matmul_reference(a, b, **kwargs), 1e-5)


@pytest.mark.parametrize("c_shape", [(37,), (1, 37), (45, 1), (1, 1), (3, 45, 37), (3, 1, 37)])
def test_c_broadcasts(c_shape, device):
    a = torch.randn(3, 45, 20, device=device)
    b = torch.randn(20, 37, device=device)
    c = torch.randn(*c_shape, device=device)
    out = tilegemm.matmul(a, b, c=c, beta=0.75, precision="ieee")
    assert_rel_close(out, matmul_reference(a, b, c=c, beta=0.75), 1e-5)


@crossed(
    "a_shape, b_shape, kernel",
    [
        pytest.param((4, 33, 20), (4, 20, 17), id="plain batch"),
        pytest.param((4, 33, 20), (20, 17), id="2-D b shared by the batch"),
        pytest.param((33, 20), (3, 20, 17), id="2-D a shared by the batch"),
        pytest.param((2, 1, 33, 20), (3, 20, 17), id="broadcast to [2, 3]"),
        pytest.param((2, 3, 5, 9, 7), (1, 3, 1, 7, 4), id="several batch dims"),
    ],
    RUNGS,
)
def test_batched_broadcast(kernel, a_shape, b_shape, device):
    a = torch.randn(*a_shape, dtype=torch.float16, device=device)
    b = torch.randn(*b_shape, dtype=torch.float16, device=device)
    out = mm(a, b, kernel=kernel)
    assert out.shape == torch.matmul(a.float(), b.float()).shape
    assert_rel_close(out, matmul_reference(a, b), tolerance(torch.float16))


def test_sliced_and_strided_views_read_in_place(device):
    base_a = torch.randn(6, 80, 90, device=device, dtype=torch.float16)
    base_b = torch.randn(90, 200, device=device, dtype=torch.float16)
    a = base_a[::2, 5:70:3, 1:80]  # strided batch, rows and columns
    b = base_b[1:80, ::4]  # non-unit column stride
    assert not a.is_contiguous() and not b.is_contiguous()
    out = tilegemm.matmul(a, b, kernel="grouped")
    assert_rel_close(out, matmul_reference(a, b), tolerance(torch.float16))


def negative_view(*shape, device):
    """``z.conj().imag``: a float32 tensor whose memory holds its values negated, a bit torch's ops resolve."""
    t = torch.complex(torch.randn(*shape, device=device), torch.randn(*shape, device=device)).conj().imag
    assert t.is_neg()
    return t


def test_negative_views_are_read_as_their_values(device):
    # the kernels read memory as it is: each of these came out with its sign flipped
    a, b, bias, c = (negative_view(*s, device=device) for s in ((9, 12), (12, 7), (7,), (9, 7)))
    out = tilegemm.matmul(a, b, bias=bias, c=c, beta=0.5, precision="ieee")
    assert_rel_close(out, matmul_reference(a, b, bias=bias, c=c, beta=0.5), 1e-5)
    # the registered op too (a graph compiled by torch.compile calls it with its inputs as they are)
    out = torch.ops.tilegemm.matmul(a, b, bias, c, 1.0, 0.5, "none", None, "ieee", "auto")
    assert_rel_close(out, matmul_reference(a, b, bias=bias, c=c, beta=0.5), 1e-5)


def test_batch_dims_that_cannot_merge(device):
    # The batch dims of a permuted tensor do not merge into one stride: the op loops over the outer one.
    a = torch.randn(5, 3, 16, 24, device=device).permute(1, 0, 2, 3)
    b = torch.randn(3, 5, 24, 8, device=device)
    out = tilegemm.matmul(a, b, precision="ieee")
    assert_rel_close(out, matmul_reference(a, b), 1e-5)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_out_dtype(out_dtype, device):
    a = torch.randn(30, 40, dtype=torch.float16, device=device)
    b = torch.randn(40, 20, dtype=torch.float16, device=device)
    out = tilegemm.matmul(a, b, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    assert_rel_close(out, matmul_reference(a, b), tolerance(torch.float16, out_dtype=out_dtype))


@pytest.mark.parametrize("kernel", ["grouped", "auto"])
@pytest.mark.parametrize(
    "dtype,out_dtype,bias_dtype",
    [
        (torch.float16, None, torch.float16),
        (torch.float16, torch.float32, torch.float32),  # the output's dtype
        (torch.float16, torch.float32, torch.float16),  # the operands' dtype, another output
        (torch.float16, torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float16, torch.float16),
        (torch.float32, torch.float16, torch.float16),
        (torch.float32, torch.bfloat16, torch.float32),
    ],
    ids=lambda d: "none" if d is None else str(d).removeprefix("torch."),
)
def test_bias_of_the_operands_or_the_output_dtype(kernel, dtype, out_dtype, bias_dtype, device):
    a = torch.randn(3, 21, 40, dtype=dtype, device=device)
    b = torch.randn(40, 26, dtype=dtype, device=device)
    bias = torch.randn(26, device=device).to(bias_dtype)
    out = mm(a, b, kernel=kernel, bias=bias, out_dtype=out_dtype, activation="gelu", precision="ieee")
    assert out.dtype == (out_dtype or dtype)
    ref = matmul_reference(a, b, bias=bias, activation="gelu")
    assert_rel_close(out, ref, tolerance(dtype, out_dtype=out.dtype))


@pytest.mark.parametrize("dtype,out_dtype", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                             (torch.float32, torch.float16)])
def test_gradients_with_a_bias_of_the_output_dtype(dtype, out_dtype, device):
    # the backward recomputes the pre-activation in fp32: a bias of the call's output dtype must pass there too
    a = torch.randn(9, 24, dtype=dtype, device=device, requires_grad=True)
    b = torch.randn(24, 13, dtype=dtype, device=device, requires_grad=True)
    bias = torch.randn(13, device=device).to(out_dtype).requires_grad_()
    out = tilegemm.matmul(a, b, bias=bias, out_dtype=out_dtype, activation="silu", precision="ieee")
    grad = torch.randn(out.shape, device=device)
    out.backward(grad.to(out_dtype))
    a64, b64, bias64 = (t.detach().double().requires_grad_() for t in (a, b, bias))
    matmul_reference(a64, b64, bias=bias64, activation="silu").backward(grad.to(out_dtype).double())
    bound = max(tolerance(dtype), tolerance(out_dtype))
    for ours, theirs in ((a, a64), (b, b64), (bias, bias64)):
        assert ours.grad.dtype == ours.dtype
        assert_rel_close(ours.grad, theirs.grad, bound)


@pytest.mark.parametrize("a_t", [False, True], ids=["a-rows", "a-columns"])
def test_fp32_gradients_of_fp16_operands_keep_their_range(a_t, device):
    # out_dtype fp32 of fp16 operands: a gradient past fp16's range (or below it) whose products fit still gives
    # them (cast to fp16 first, the first became inf and NaN, the second zero); one inside the range gives the
    # bits of the fp16 output's backward
    a = torch.randn(24, 9, dtype=torch.float16, device=device).mT if a_t else \
        torch.randn(9, 24, dtype=torch.float16, device=device)
    a.requires_grad_()
    for size, b_scale in ((1e5, 1e-3), (1e-7, 1e3)):
        b = (torch.randn(24, 13, device=device) * b_scale).half().requires_grad_()
        out = tilegemm.matmul(a, b, out_dtype=torch.float32)
        grad = torch.randn(out.shape, device=device) * size
        (ga,) = torch.autograd.grad(out, a, grad)
        want = grad.double() @ b.detach().double().T
        assert ga.dtype == torch.float16 and 2 ** -14 < want.abs().max() < 1e4  # (fp16 holds them)
        assert_rel_close(ga, want, 2e-3)
    b = torch.randn(24, 13, dtype=torch.float16, device=device, requires_grad=True)
    grad = torch.randn(9, 13, device=device).half()
    grad[1:] *= 1e-4  # (rows 1e4 times smaller than the first: inside fp16's range, they are no zeros)
    wide = torch.autograd.grad(tilegemm.matmul(a, b, out_dtype=torch.float32), (a, b), grad.float())
    narrow = torch.autograd.grad(tilegemm.matmul(a, b), (a, b), grad)
    assert all(torch.equal(w, n) for w, n in zip(wide, narrow)) and wide[0][1:].abs().amin(-1).gt(0).all()


def test_the_backward_keeps_only_what_it_reads(device):
    # as torch's addmm: a frozen weight's layer keeps no input, and a bias or an addend written in place after the
    # call (no activation) makes no autograd error
    from tilegemm.nn import Linear

    kept = []
    lin = Linear(16, 8).to(device).requires_grad_(False)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y = lin(x)
    assert len(kept) == 1 and (kept[0] is lin.weight or kept[0]._base is lin.weight)
    with torch.no_grad():
        lin.bias.add_(1)
    (gx,) = torch.autograd.grad(y.sum(), x)
    assert_rel_close(gx, torch.ones(4, 8, device=device, dtype=torch.float64) @ lin.weight.double(), 1e-5)
    a = torch.randn(5, 6, device=device, requires_grad=True)
    b, c = torch.randn(6, 3, device=device), torch.randn(5, 3, device=device, requires_grad=True)
    out = tilegemm.matmul(a, b, c=c, beta=2.0)
    with torch.no_grad():
        a.add_(1)  # (b is kept for a's gradient; a and c are not)
        c.add_(1)
    ga, gc = torch.autograd.grad(out.sum(), (a, c))
    assert_rel_close(ga, torch.ones(5, 3, device=device, dtype=torch.float64) @ b.double().T, 1e-5)
    assert torch.equal(gc, torch.full_like(c, 2.0))


@pytest.mark.parametrize("kernel", ["naive", "grouped", "autotuned"])
def test_bf16(kernel, device):
    a = torch.randn(2, 70, 33, dtype=torch.bfloat16, device=device)
    b = torch.randn(33, 45, dtype=torch.bfloat16, device=device).mT.contiguous().mT
    bias = torch.randn(45, dtype=torch.bfloat16, device=device)
    out = mm(a, b, bias=bias, activation="silu", kernel=kernel)
    assert out.dtype == torch.bfloat16
    assert_rel_close(out, matmul_reference(a, b, bias=bias, activation="silu"), tolerance(torch.bfloat16))


def test_fp32_precision_follows_torch_setting(device):
    a = torch.randn(64, 64, device=device)
    b = torch.randn(64, 64, device=device)
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        out = tilegemm.matmul(a, b)
        assert_rel_close(out, matmul_reference(a, b), 1e-5)
        torch.set_float32_matmul_precision("high")
        out = tilegemm.matmul(a, b)  # tf32 on a GPU: a looser bound
        assert_rel_close(out, matmul_reference(a, b), tolerance(torch.float32, "tf32"))
    finally:
        torch.set_float32_matmul_precision(old)


@pytest.mark.parametrize("kernel", ["naive", "grouped", "autotuned"])
def test_empty_dims(kernel, device):
    a = torch.randn(0, 5, device=device)
    b = torch.randn(5, 7, device=device)
    assert mm(a, b, kernel=kernel).shape == (0, 7)
    assert tilegemm.matmul(torch.randn(4, 5, device=device), torch.randn(5, 0, device=device)).shape == (4, 0)
    assert tilegemm.matmul(torch.randn(0, 4, 5, device=device), b).shape == (0, 4, 7)


@pytest.mark.parametrize("kernel", ["naive", "grouped", "autotuned"])
def test_k_zero_gives_the_epilogue_of_zero(kernel, device):
    a = torch.randn(9, 0, device=device)
    b = torch.randn(0, 11, device=device)
    c = torch.randn(9, 11, device=device)
    bias = torch.randn(11, device=device)
    out = mm(a, b, c=c, beta=2.0, bias=bias, activation="relu", kernel=kernel)
    torch.testing.assert_close(out, torch.relu(2.0 * c + bias))
    assert torch.equal(mm(a, b, kernel=kernel), torch.zeros(9, 11, device=device))


def test_large_values_do_not_overflow_activation(device):
    # gelu_tanh and silu go through exp(); huge inputs must give x or 0, not NaN.
    a = torch.tensor([[1.0e4], [-1.0e4]], device=device)
    b = torch.ones(1, 3, device=device)
    for act, want_pos, want_neg in (("silu", 1.0e4, 0.0), ("gelu_tanh", 1.0e4, 0.0), ("gelu", 1.0e4, 0.0)):
        out = tilegemm.matmul(a, b, activation=act, precision="ieee")
        assert torch.isfinite(out).all(), act
        torch.testing.assert_close(out[0], torch.full((3,), want_pos, device=device))
        torch.testing.assert_close(out[1], torch.full((3,), want_neg, device=device), atol=1e-6, rtol=0)


def test_tile_errors_see_one_bad_tile_and_unwritten_elements():
    """The per-tile check the GPU tests use: one spoiled tile of 28 stands out, a NaN makes its tile inf,
    edge tiles are judged on what is left of the matrix."""
    from tilegemm.core.checks import relative_error, tile_errors, worst_tile_error

    ref = torch.randn(1000, 776, dtype=torch.float64)
    out = (ref + 1e-5 * torch.randn_like(ref)).float()
    assert worst_tile_error(out, ref, 256, 128) < 1e-4
    out[800:900, 10:20] += 1.0  # tile (3, 0), the ragged last row of tiles
    out[300, 700] = float("nan")  # tile (1, 5)
    errs = tile_errors(out, ref, 256, 128)
    assert errs.shape == (4, 7)
    assert errs[1, 5].item() == float("inf")
    assert errs[3, 0].item() == pytest.approx(relative_error(out[768:, :128], ref[768:, :128]))
    assert errs[3, 0] > 1e-2
    bad = (errs > 1e-3).nonzero().tolist()
    assert bad == [[1, 5], [3, 0]]
    with pytest.raises(ValueError, match="2-D"):
        tile_errors(out[0], ref[0], 256, 128)


def test_replay_cache_keeps_aliased_calls_only_when_the_key_says_so():
    """Tensors sharing a data pointer take the first one's slots in a replay; the cache keeps such a call
    only when its key records the aliasing (tilegemm.matmul's does)."""
    from tilegemm.core import replay as replay_module
    from tilegemm.core.launch import Launch
    from tilegemm.core.replay import ReplayCache

    class FakeCompiled:  # what Replay reads from a compiled Triton kernel
        run = function = packed_metadata = None

        def __getitem__(self, grid):
            return lambda *args, **kw: None

    x, out, scale = torch.randn(4, 4), torch.empty(4, 4), torch.ones(1)
    params = [x, x.mT, out, scale, scale, 7]
    plain, aliasing = ReplayCache("test-plain"), ReplayCache("test-aliasing", aliases_in_key=True)
    try:
        plain.store("k", [Launch(FakeCompiled(), (1, 1, 1), params)], (x, x.mT, scale, scale), out)
        assert plain.get("k") is None, "aliased tensors are refused unless the key says how they alias"
        aliasing.store("k", [Launch(FakeCompiled(), (1, 1, 1), params)], (x, x.mT, scale, scale), out)
        # the output is the last of a replay's tensors
        assert aliasing.get("k").slots == [(0, 0, None), (1, 0, None), (2, 4, None), (3, 2, None), (4, 2, None)]
        assert aliasing.count() == 1 and replay_module.cache("test-aliasing") is aliasing
        aliasing.store("t", [Launch(FakeCompiled(), (1, 1, 1), [x, out.mT])], (x,), out.mT)
        assert aliasing.get("t") is None, "an output a replay would not allocate alike is not kept"
    finally:
        del replay_module._CACHES["test-plain"], replay_module._CACHES["test-aliasing"]


def test_replays_encode_host_descriptors_once_per_base_address(monkeypatch):
    """Under Triton 3.6's descriptor wrapper a replay expands the parameters itself, as the wrapper would,
    and encodes a descriptor once per base address: the C launch gets what Triton's own path would pass."""
    from triton.backends.nvidia import driver
    from triton.tools.tensor_descriptor import TensorDescriptor

    from tilegemm.core import launch as tl_launch
    from tilegemm.core.launch import Launch, Replay, _rebased

    encodes = []

    def fake_encode(arg, meta):  # stands for cuTensorMapEncodeTiled (no GPU here)
        if meta is None:
            return [arg.base, *arg.shape, *arg.strides, arg.padding == "nan", *arg.shape, *arg.strides]
        encodes.append(arg.base.data_ptr())
        return [("map", arg.base.data_ptr(), tuple(meta["block_size"])), *arg.shape, *arg.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", fake_encode)
    monkeypatch.setattr(tl_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(tl_launch, "_raw_stream", lambda device: 0)
    calls = []
    signature = {"a": "tensordesc<fp16[64, 32]>", "out": "*fp16", "b": "tensordesc<fp16[32, 64]>", "n": "i32"}
    metas = [dict(block_size=[64, 32]), None]  # a descriptor encoded on the host, one passed unencoded
    inner = driver.wrap_handle_tensordesc(lambda *args: calls.append(args), signature, metas)

    class Launcher:
        launch, global_scratch_size, profile_scratch_size, num_ctas = inner, 0, 0, 1
        launch_cooperative_grid = launch_pdl = False

    class FakeCompiled:
        run, function, packed_metadata = Launcher(), "fn", "packed"

        def __getitem__(self, grid):
            return lambda *args, **kw: None

    def tensors():
        return (torch.randn(64, 32, dtype=torch.float16), torch.empty(64, 64, dtype=torch.float16),
                torch.randn(32, 64, dtype=torch.float16))

    a, out, b = tensors()
    da, db = TensorDescriptor(a, [64, 32], [32, 1], [64, 32]), TensorDescriptor(b, [32, 64], [64, 1], [32, 64])
    replay = Replay(Launch(FakeCompiled(), (3, 1, 1), [da, out, db, 7], device=0), (a, out, b))
    assert replay.expanded is not None
    a2, out2, b2 = tensors()
    for _ in range(3):
        assert replay(a2, out2, b2)
    ours = calls[-1]
    # Triton's own wrapper, given the rebased descriptors, passes the same parameters.
    inner(*ours[:13], _rebased(da, a2), out2, _rebased(db, b2), 7)
    assert calls[-1] == ours and ours[:4] == (3, 1, 1, 0)
    assert ours[13] == ("map", a2.data_ptr(), (64, 32)) and ours[18] is out2 and ours[19] is b2 and ours[-1] == 7
    assert encodes.count(a2.data_ptr()) == 2, "encoded once by the replay (three calls), once by Triton's wrapper"
    replay(a, out, b)
    assert calls[-1][13] == ("map", a.data_ptr(), (64, 32)) and calls[-1][18] is out


def test_replay_slots_take_host_descriptors_over_the_new_tensors():
    """A host-side TMA descriptor among a launch's parameters gets a slot by its base's data pointer; a
    replay passes a copy over the new tensor, with the recorded shape, strides, block and layout."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from tilegemm.core.launch import Launch, Replay, _rebased

    class FakeCompiled:
        run = function = packed_metadata = None

        def __getitem__(self, grid):
            return lambda *args, **kw: None

    a, out, other = torch.randn(64, 32), torch.empty(64, 64), torch.randn(64, 32)
    layout = gl.NVMMASharedLayout.get_default_for([64, 32], gl.float32)
    desc = TensorDescriptor(a, [64, 32], [32, 1], [64, 32], layout)
    replay = Replay(Launch(FakeCompiled(), (1, 1, 1), [desc, out, 5]), (a, out))
    (i0, j0, kept), second = replay.slots
    assert (i0, j0) == (0, 0) and second == (1, 1, None)
    # The recording call's tensors are not kept alive: their slots are empty, the descriptor covers no memory.
    assert replay.params == [None, None, 5] and kept.base is None
    assert (kept.shape, kept.strides, kept.block_shape, kept.layout) == (desc.shape, desc.strides, desc.block_shape,
                                                                         desc.layout)
    copy = _rebased(desc, other)
    assert copy.base is other and desc.base is a
    assert (copy.shape, copy.strides, copy.block_shape, copy.layout, copy.padding) == \
        (desc.shape, desc.strides, desc.block_shape, desc.layout, desc.padding)
    stranger = TensorDescriptor(torch.randn(64, 32), [64, 32], [32, 1], [64, 32], layout)
    with pytest.raises(LookupError):
        Replay(Launch(FakeCompiled(), (1, 1, 1), [stranger, out]), (a, out))
    # Triton's own host descriptor (no layout) is taken the same way, never passed as recorded.
    from triton.tools.tensor_descriptor import TensorDescriptor as TritonDescriptor

    tdesc = TritonDescriptor(a, [64, 32], [32, 1], [64, 32])
    replay = Replay(Launch(FakeCompiled(), (1, 1, 1), [out, tdesc]), (a, out))
    assert [(i, j, d is None) for i, j, d in replay.slots] == [(0, 1, True), (1, 0, False)]
    assert replay.slots[1][2].block_shape == [64, 32] and replay.slots[1][2].base is None
    assert _rebased(tdesc, other).base is other and _rebased(tdesc, other).block_shape == [64, 32]


def _laid_out(M, N, K, layout, dtype, device):
    """A [M, K] and B [K, N] in ``layout``'s storage orders (T: column-major, its own storage)."""
    a = make_operand(M, K, layout[0] == "T", dtype, device)
    b = make_operand(K, N, layout[1] == "T", dtype, device)
    a = a.mT.contiguous().mT if layout[0] == "T" else a
    b = b.mT.contiguous().mT if layout[1] == "T" else b
    return a, b


def _spy_on_copies(monkeypatch) -> list:
    """(slot, source, copy) of every operand ``padding.padded_operands`` copies from now on."""
    from tilegemm.ops.matmul import padding

    seen = []
    real = padding.padded_operands

    def spy(*specs):
        got = real(*specs)
        seen.extend((slot, t, copy) for (t, _, _, slot), copy in zip(specs, got))
        return got

    monkeypatch.setattr(padding, "padded_operands", spy)
    return seen


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("shape", [(5, 23, 37), (17, 9, 1), (40, 33, 64)], ids=lambda s: "x".join(map(str, s)))
def test_auto_pads_operands_whose_rows_are_not_16_byte_aligned(layout, dtype, shape, device, monkeypatch):
    """Where auto pads (forced here; on a GPU the cost model decides), the product runs as its aligned twin:
    operands and bias copied into zero-padded, aligned buffers in their own layouts, the product's corner
    copied into the (poisoned) output; with a bias and an activation."""
    from tilegemm.ops.matmul import dispatch, padding

    M, N, K = shape
    a, b = _laid_out(M, N, K, layout, dtype, device)
    seen = _spy_on_copies(monkeypatch)
    monkeypatch.setattr(dispatch, "_pads", lambda p, a, b, c=None, bias=None: True)
    bias = torch.randn(N, dtype=dtype, device=device)
    out = tilegemm.matmul(a, b, bias=bias, activation="relu", precision="ieee")
    assert_rel_close(out, matmul_reference(a, b, bias=bias, activation="relu"), tolerance(dtype))
    assert out.is_contiguous() and out.shape == (M, N)
    per = 16 // a.element_size()
    Mp, Np, Kp = (-(-x // per) * per for x in (M, N, K))
    (_, _, a2), (_, _, b2), (_, _, bias2) = seen
    bias2 = bias2[0]  # padded as a one-row matrix
    assert a2.shape == (Mp, Kp) and b2.shape == (Kp, Np) and bias2.shape == (Np,)
    assert (a2.stride(0) == 1) == (a.stride(0) == 1 and a.stride(1) != 1), "A's layout is kept"
    assert (b2.stride(0) == 1) == (b.stride(0) == 1 and b.stride(1) != 1), "B's layout is kept"
    for t in (a2, b2):
        assert max(t.stride()) * t.element_size() % 16 == 0, "rows start 16 bytes apart"
    assert torch.equal(a2[:M, :K], a) and torch.equal(b2[:K, :N], b) and torch.equal(bias2[:N], bias)
    assert not a2[:, K:].any() and not a2[M:].any() and not b2[K:].any() and not b2[:, N:].any()
    tilegemm.matmul(a, b, kernel="grouped", precision="ieee")
    assert len(seen) == 3, "a rung asked for by name reads its operands as given"
    c = torch.randn(M, N, dtype=dtype, device=device)
    assert not padding.can_pad(a, b, c, None, out), "a call with c is never padded"


@pytest.mark.parametrize("with_bias", [False, True])
def test_twin_copies_both_operands_in_one_launch(with_bias, device, monkeypatch):
    """The aligned twin's launches: A and B padded by one copy launch (the bias by its own), the product, the
    corner copied back."""
    from tilegemm.ops.matmul import dispatch, padding

    launched = []
    real = padding.launch

    def spy(kernel, *args, **kwargs):
        launched.append(kernel)
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(padding, "launch", spy)
    monkeypatch.setattr(dispatch, "_pads", lambda p, a, b, c=None, bias=None: True)
    a, b = _laid_out(21, 13, 35, "NT", torch.float16, device)
    bias = torch.randn(13, dtype=torch.float16, device=device) if with_bias else None
    out = tilegemm.matmul(a, b, bias=bias)
    assert_rel_close(out, matmul_reference(a, b, bias=bias), tolerance(torch.float16))
    want = [padding.pad_copy2_kernel] + [padding.pad_copy_kernel] * (2 if with_bias else 1)
    assert launched == want


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("plan", ["a", "b", "ab"])
def test_auto_restrides_operands_whose_rows_straddle_lines(layout, plan, device, monkeypatch):
    """Where auto restrides (forced here; on a GPU the cost model decides), the operands it names are copied
    into buffers of the same shape and layout whose rows start 128 bytes apart, the others read as given, and
    the product (with a bias and an activation) is written straight into the poisoned output."""
    from tilegemm.ops.matmul import dispatch
    from tilegemm.core.replay import cache
    replay = cache("matmul")

    M, N, K = 19, 24, 40  # 16-byte aligned rows (K, N multiples of 8), not 128-byte ones
    dtype = torch.float16
    a, b = _laid_out(M, N, K, layout, dtype, device)
    replay.clear()  # on a GPU an earlier plan's call would replay, copies and all, past the spies
    seen = _spy_on_copies(monkeypatch)
    monkeypatch.setattr(dispatch, "_restrides", lambda p, a, b: plan)
    bias = torch.randn(N, dtype=dtype, device=device)
    out = tilegemm.matmul(a, b, bias=bias, activation="relu")
    assert_rel_close(out, matmul_reference(a, b, bias=bias, activation="relu"), tolerance(dtype))
    assert out.is_contiguous() and out.shape == (M, N)
    assert [slot for slot, _, _ in seen] == list(plan)
    for _, t, got in seen:
        assert got.shape == t.shape and torch.equal(got, t)
        assert (got.stride(0) == 1) == (t.stride(0) == 1 and t.stride(1) != 1), "the layout is kept"
        assert max(got.stride()) * got.element_size() % 128 == 0, "rows start 128 bytes apart"
        assert got.data_ptr() % 128 == 0 or not got.is_cuda  # (the CPU allocator aligns to 64 bytes)


def test_restriding_is_priced_by_the_cost_model(monkeypatch):
    """Large products copy an operand whose rows straddle 128-byte lines, B (N-major in NN) sooner than A;
    small products, rows on whole lines and batches do not (132 SMs, H100-class rates)."""
    from tilegemm.ops.matmul import dispatch, padding
    from tilegemm.ops.matmul.problem import make_problems

    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr("tilegemm.ops.matmul.cost.device_rates", lambda p: (132, 989.0, 3350.0))

    def empty(rows, cols, offset=0):  # rows x cols fp16 starting `offset` elements past a 128-byte boundary
        flat = torch.empty(rows * cols + 64 + offset, dtype=torch.float16)
        start = (-flat.data_ptr() % 128) // 2 + offset
        return flat[start: start + rows * cols].view(rows, cols)

    def plan(M, N, K, a=None, b=None):
        a = empty(M, K) if a is None else a
        b = empty(K, N) if b is None else b
        p = make_problems(a, b, torch.empty(M, N, dtype=torch.float16), None, None, 1.0, 0.0, "none", "ieee",
                          False)[0]
        return padding.restride_plan(p, a, b)

    assert plan(6744, 11288, 21480) == "ab"
    assert plan(3032, 8872, 1928) == "ab"
    assert plan(4096, 2056, 4104) == "b"  # A's copy costs more than a narrow N loses on its rows
    assert plan(6720, 11264, 21504) == ""  # rows on whole lines
    assert plan(576, 2448, 1048) == ""  # microseconds: a copy costs what it could win
    assert plan(6744, 11288, 21504, b=empty(21504, 11328)[:, :11288]) == ""  # 128-byte rows, sliced
    assert plan(6720, 11264, 21504, b=empty(21504, 11264, offset=8)) == "b"  # whole lines, the first not
    batched = torch.empty(2, 3032, 1928, dtype=torch.float16)
    p = make_problems(batched, torch.empty(1928, 8872, dtype=torch.float16),
                      torch.empty(2, 3032, 8872, dtype=torch.float16), None, None, 1.0, 0.0, "none", "ieee", False)[0]
    assert dispatch._restrides(p, batched, torch.empty(1928, 8872, dtype=torch.float16)) == ""


def test_padding_is_priced_by_the_cost_model(monkeypatch):
    """Large misaligned products with a long K pad; short-K ones, small ones and aligned ones do not (132 SMs,
    the GPU's configs, as on an H100/H200)."""
    from tilegemm.ops.matmul import configs, dispatch, padding, split_k
    from tilegemm.ops.matmul.problem import make_problems

    for module in (dispatch, configs, split_k):
        monkeypatch.setattr(module, "interpreting", lambda: False)
    monkeypatch.setattr("tilegemm.core.hardware.sm_count", lambda device: 132)
    monkeypatch.setattr(split_k, "sm_count", lambda device: 132)

    def pads(M, N, K, dtype=torch.float16):
        a = torch.empty(M, K, dtype=dtype)
        b = torch.empty(K, N, dtype=dtype)
        p = make_problems(a, b, torch.empty(M, N, dtype=dtype), None, None, 1.0, 0.0, "none",
                          "tf32" if dtype == torch.float32 else "ieee", False)[0]
        return dispatch._pads(p, a, b)

    assert pads(1723, 449, 15855) and pads(4000, 4001, 4003) and pads(593, 69, 25089)
    assert not pads(4000, 4000, 4000)  # aligned
    # Short K: a few steps a program, whose waits on misaligned loads cost less than the copies. Measured on the
    # H200 (benchmarks/results/2026-11-24-h200/cdd76fc/, f36febd/): fp16 10129x572x106 17.6 us direct, 29.8 as
    # the twin; 74x16779x6317 409 direct, 184 as the twin; tf32 146x8038x334 19.2 against 39.9, 142x473x409 9.8
    # against 17.7 (a tf32 load carries twice an fp16 one's bytes: its direct kernels lose less).
    assert not pads(10129, 572, 106) and pads(74, 16779, 6317)
    assert not pads(146, 8038, 334, torch.float32) and not pads(142, 473, 409, torch.float32)
    assert pads(641, 7731, 5689, torch.float32)
    assert not pads(5, 23, 37)  # a few microseconds: four more launches would cost more than they win
    out = torch.empty(4, 6)
    assert not padding.can_pad(torch.empty(3, 4, 5), torch.empty(5, 6), None, None, out)  # batched
    assert not padding.can_pad(torch.empty(4, 10)[:, ::2], torch.empty(5, 6), None, None, out)  # no unit stride
    assert not padding.can_pad(torch.empty(4, 5), torch.empty(5, 6), None, torch.empty(12)[::2], out)

def test_the_aligned_twin_rounds_n_to_16_bytes_of_the_output_too():
    # an fp32 product written in fp16: N to 8 elements (16 bytes of fp16), M and K to 4 (16 bytes of fp32); a TMA
    # store writes whole 16-byte units (persistent_tma.why_not refuses rows that end inside one)
    from tilegemm.ops.matmul.padding import twin_shape

    assert twin_shape(5, 11, 7, 4) == (8, 12, 8)
    assert twin_shape(5, 11, 7, 4, 2) == (8, 16, 8)
    assert twin_shape(5, 11, 7, 2, 2) == (8, 16, 8)
    assert twin_shape(5, 11, 7, 2, 4) == (8, 16, 8)
