"""GPU-only checks (`pytest -m gpu` on the GPU machine): bf16, tf32, larger shapes, 64-bit indexing."""

from __future__ import annotations

import pytest
import torch

import tilegemm
from tilegemm.ops.matmul.reference import matmul_reference, relative_error, tolerance

from conftest import assert_rel_close, kernels, mm

pytestmark = pytest.mark.gpu
RUNGS = kernels("matmul")  # every registered kernel, then "auto"


@pytest.mark.parametrize("kernel", RUNGS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("shape", [(1, 4096, 4096), (257, 1000, 513), (2048, 2048, 2048), (4095, 129, 3000)],
                         ids=lambda s: "x".join(map(str, s)))
def test_large_shapes(kernel, dtype, layout, shape):
    M, N, K = shape
    a = torch.randn(K, M, device="cuda", dtype=dtype).mT if layout[0] == "T" else torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(N, K, device="cuda", dtype=dtype).mT if layout[1] == "T" else torch.randn(K, N, device="cuda", dtype=dtype)
    out = mm(a, b, kernel=kernel)
    assert_rel_close(out, matmul_reference(a, b), tolerance(dtype))


@pytest.mark.parametrize("kernel", RUNGS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn], ids=["fp16", "fp8"])
@pytest.mark.parametrize("M,N", [(257, 1000), (1000, 257), (33, 95)])
def test_odd_sizes_along_an_aligned_unit_stride(kernel, dtype, M, N):
    """A contiguous along M and B along N with 16-byte aligned leading dimensions but odd M / N: a tile
    that wraps past the last row must not be read as one contiguous run (a misaligned vector load)."""
    K, per = 520, 16 // dtype.itemsize
    ld = lambda n: -(-(n + 1) // per) * per  # noqa: E731  (a multiple of 16 bytes, past n)
    make = lambda *s: torch.randn(*s, device="cuda").to(dtype)  # noqa: E731
    a = make(K, ld(M))[:, :M].mT  # [M, K], strides (1, ld(M))
    b = make(K, ld(N))[:, :N]  # [K, N], strides (ld(N), 1)
    out_dtype = torch.float16
    out = mm(a, b, kernel=kernel, out_dtype=out_dtype)
    assert_rel_close(out.float(), matmul_reference(a, b).float(), tolerance(dtype, out_dtype=out_dtype))
    torch.cuda.synchronize()


@pytest.mark.parametrize("kernel", RUNGS)
@pytest.mark.parametrize("activation", tilegemm.ACTIVATIONS)
def test_bf16_epilogue(kernel, activation):
    a = torch.randn(3, 300, 200, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(200, 170, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(170, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(300, 170, device="cuda", dtype=torch.bfloat16)
    kw = dict(bias=bias, c=c, alpha=0.5, beta=2.0, activation=activation)
    out = mm(a, b, kernel=kernel, **kw)
    assert_rel_close(out, matmul_reference(a, b, **kw), tolerance(torch.bfloat16))


@pytest.mark.parametrize("kernel", RUNGS)
def test_fp32_ieee_and_tf32(kernel):
    a = torch.randn(777, 1025, device="cuda")
    b = torch.randn(1025, 333, device="cuda")
    ref = matmul_reference(a, b)
    ieee = mm(a, b, kernel=kernel, precision="ieee")
    tf32 = mm(a, b, kernel=kernel, precision="tf32")
    assert relative_error(ieee, ref) < 1e-5
    err = relative_error(tf32, ref)
    assert 1e-5 < err < tolerance(torch.float32, "tf32"), "tf32 should be looser than IEEE but within bound"


def test_large_batch_beyond_grid_limit():
    a = torch.randn(70000, 4, 8, device="cuda", dtype=torch.float16)
    b = torch.randn(70000, 8, 4, device="cuda", dtype=torch.float16)
    out = tilegemm.matmul(a, b, kernel="grouped")
    assert_rel_close(out, matmul_reference(a, b), tolerance(torch.float16))


def test_offsets_past_int32():
    # A has 2^31 + 2^20 elements: offsets past 2^31 need 64-bit index arithmetic.
    M, K, N = 65536 + 32, 32768, 16
    a = torch.randn(M, K, device="cuda", dtype=torch.float16)
    b = torch.randn(K, N, device="cuda", dtype=torch.float16)
    out = tilegemm.matmul(a, b, kernel="grouped")
    for rows in (slice(0, 256), slice(M - 256, M)):
        assert_rel_close(out[rows], matmul_reference(a[rows], b), tolerance(torch.float16))


def test_cuda_graph_capture():
    a = torch.randn(512, 512, device="cuda", dtype=torch.float16)
    b = torch.randn(512, 512, device="cuda", dtype=torch.float16)
    tilegemm.matmul(a, b, kernel="grouped")  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tilegemm.matmul(a, b, kernel="grouped")
    a.copy_(torch.randn_like(a))
    graph.replay()
    torch.cuda.synchronize()
    assert_rel_close(out, matmul_reference(a, b), tolerance(torch.float16))


def test_torch_compile_inductor():
    def f(x, w):
        return torch.relu(tilegemm.matmul(x, w, activation="gelu")) + 1.0

    x = torch.randn(256, 512, device="cuda", dtype=torch.float16)
    w = torch.randn(512, 128, device="cuda", dtype=torch.float16)
    out = torch.compile(f, fullgraph=True)(x, w)
    ref = torch.relu(matmul_reference(x, w, activation="gelu")) + 1.0
    assert_rel_close(out, ref, tolerance(torch.float16))


def test_import_does_not_touch_cuda_on_a_gpu_machine():
    import subprocess
    import sys

    code = "import torch, tilegemm, sys; print(torch.cuda.is_initialized(), 'triton' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "False False", done.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8, torch.bool])
def test_copy_on_gpu(dtype):
    x = (torch.randn(3, 1000, 1001, device="cuda") * 100).to(dtype)
    assert torch.equal(tilegemm.copy(x), x)
    assert torch.equal(tilegemm.copy(x.transpose(0, 2)), x.transpose(0, 2))


def test_copy_past_int32_elements():
    x = torch.empty(2**31 + 1000, dtype=torch.uint8, device="cuda").random_()
    out = tilegemm.copy(x)
    assert torch.equal(out[-4096:], x[-4096:]) and torch.equal(out[:4096], x[:4096])


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.float16])
def test_grey_on_gpu(dtype):
    img = torch.randint(0, 256, (2, 3, 1080, 1920), device="cuda", dtype=torch.uint8)
    img = img if dtype == torch.uint8 else img.to(dtype) / 255
    f = img.float()
    ref = 0.2989 * f[:, 0] + 0.5870 * f[:, 1] + 0.1140 * f[:, 2]
    ref = (ref + 0.5).clamp(0, 255).to(torch.uint8) if dtype == torch.uint8 else ref.to(dtype)
    out = tilegemm.rgb_to_grey(img)
    atol = 1 if dtype == torch.uint8 else 1e-3
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=atol)
    torch.testing.assert_close(tilegemm.rgb_to_grey(img[..., ::2]), ref[..., ::2], rtol=1e-3, atol=atol)


def test_replayed_launches_compute_with_the_new_tensors():
    from tilegemm.core.replay import cache
    replay = cache("matmul")

    replay.clear()
    shapes = [(96, 80, 64), (1, 4096, 512), (300, 200, 1000), (2048, 2048, 2048)]
    kernels = ("grouped", "auto", "persistent_tma")
    for M, N, K in shapes:
        for kernel in kernels:
            for trial in range(3):  # the first call records, later ones replay
                a = torch.randn(M, K, device="cuda", dtype=torch.float16)
                b = torch.randn(N, K, device="cuda", dtype=torch.float16).mT
                out = mm(a, b, kernel=kernel)
                assert_rel_close(out, matmul_reference(a, b), tolerance(torch.float16))
    # Every (shape, kernel) is recorded once, whatever its launch passes (pointers or host descriptors).
    assert replay.count() == len(shapes) * len(kernels), "plain repeated calls should be replayed"


@pytest.mark.parametrize("kernel", ["auto", "split_k", "persistent_tma", "gluon_f16"])
def test_calls_with_bias_and_activation_replay_with_the_new_bias(kernel):
    """nn.Linear's call (a bias, maybe an activation) takes the fast path too: each replay must read its own
    bias, apply the recorded activation, and a call with another activation or without bias is another key."""
    from tilegemm.core.replay import cache
    replay = cache("matmul")

    replay.clear()
    M, N, K = (8, 1024, 2048) if kernel == "split_k" else (512, 384, 256)
    for act in ("none", "gelu", None):
        for trial in range(3):
            a = torch.randn(M, K, device="cuda", dtype=torch.float16)
            b = torch.randn(N, K, device="cuda", dtype=torch.float16).mT
            bias = None if act is None else torch.randn(N, device="cuda", dtype=torch.float16) * (trial + 1)
            out = mm(a, b, bias=bias, activation=act, kernel=kernel)
            ref = matmul_reference(a, b, bias=bias, activation=None if act == "none" else act)
            assert_rel_close(out, ref, tolerance(torch.float16))
    assert replay.count() == 3, "one record per (bias, activation) key, replayed afterwards"
    # a bias that is itself a slice of a: aliases are in the key, so this is yet another key, right too
    a = torch.randn(M, K, device="cuda", dtype=torch.float16)
    b = torch.randn(K, N, device="cuda", dtype=torch.float16)
    bias = a.view(-1)[:N]
    for _ in range(2):
        assert_rel_close(mm(a, b, bias=bias, kernel=kernel), matmul_reference(a, b, bias=bias), tolerance(torch.float16))


def test_a_bias_of_another_dtype_is_refused_after_a_replayed_call():
    """The fast path serves only keys recorded from checked calls: a bias or out_dtype of another dtype is
    another key, so such a call reaches the checks, even right after the same shapes were replayed."""
    from tilegemm.core.replay import cache
    replay = cache("matmul")

    replay.clear()
    a = torch.randn(64, 128, device="cuda", dtype=torch.float16)
    b = torch.randn(128, 96, device="cuda", dtype=torch.float16)
    bias = torch.randn(96, device="cuda", dtype=torch.float16)
    for _ in range(3):
        assert_rel_close(tilegemm.matmul(a, b, bias=bias), matmul_reference(a, b, bias=bias), tolerance(torch.float16))
    assert replay.count() == 1
    with pytest.raises(TypeError, match="bias has dtype bf16; expected the operands' fp16$"):
        tilegemm.matmul(a, b, bias=bias.bfloat16())
    with pytest.raises(TypeError, match="bias has dtype bf16; expected the operands' fp16 or the output's, fp32"):
        tilegemm.matmul(a, b, bias=bias.bfloat16(), out_dtype=torch.float32)
    for _ in range(2):  # the output's dtype: taken, and recorded under its own key
        out = tilegemm.matmul(a, b, bias=bias.float(), out_dtype=torch.float32)
        assert_rel_close(out, matmul_reference(a, b, bias=bias), tolerance(torch.float16, out_dtype=torch.float32))
    assert replay.count() == 2


def test_fp8_calls_with_scales_replay_with_the_new_scales():
    from tilegemm.core.replay import cache
    replay = cache("matmul")

    replay.clear()
    e4m3 = torch.float8_e4m3fn
    for kernel in ("auto", "persistent_tma", "autotuned"):
        for out_dtype in (None, torch.float32):
            for fast in (False, True):
                for trial in range(3):  # the first call records, later ones replay with new data and scales
                    a = torch.randn(256, 512, device="cuda").to(e4m3)
                    b = torch.randn(384, 512, device="cuda").to(e4m3).mT
                    scale_a = torch.rand(256, device="cuda") + 0.5  # per row
                    scale_b = torch.tensor(0.25 * (trial + 1), device="cuda")
                    out = mm(a, b, kernel=kernel, scale_a=scale_a, scale_b=scale_b,
                                          out_dtype=out_dtype, fast_accum=fast)
                    assert out.dtype == (out_dtype or torch.bfloat16)
                    ref = (a.double() * scale_a.double()[:, None]) @ b.double() * scale_b.item()
                    bound = tolerance(e4m3, out_dtype=out_dtype or torch.bfloat16, fast_accum=fast)
                    assert_rel_close(out, ref, bound)
    assert replay.count() >= 6, "fp8 calls with scales should be replayed"


def test_replay_keys_separate_what_triton_specializes():
    from tilegemm.core.replay import cache
    replay = cache("matmul")

    replay.clear()
    a = torch.randn(64, 64, device="cuda")
    b = torch.randn(64, 64, device="cuda")
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert relative_error(tilegemm.matmul(a, b), matmul_reference(a, b)) < 1e-5
        torch.set_float32_matmul_precision("high")
        tilegemm.matmul(a, b)
        assert 1e-5 < relative_error(tilegemm.matmul(a, b), matmul_reference(a, b)) < 1e-2
    finally:
        torch.set_float32_matmul_precision(old)
    # a misaligned view and a transposed one are other keys
    base = torch.randn(64 * 64 + 1, device="cuda")
    a_off = base[1:].view(64, 64)
    assert_rel_close(tilegemm.matmul(a_off, b, precision="ieee"), matmul_reference(a_off, b), 1e-5)
    assert_rel_close(tilegemm.matmul(a.t(), b, precision="ieee"), matmul_reference(a.t(), b), 1e-5)
    assert_rel_close(tilegemm.matmul(a, a, precision="ieee"), matmul_reference(a, a), 1e-5)  # aliased
    assert_rel_close(tilegemm.matmul(a, b, alpha=3.0, precision="ieee"), matmul_reference(a, b, alpha=3.0), 1e-5)


def test_calls_whose_tensors_alias_replay_only_for_calls_that_alias_the_same_way():
    """x @ x.mT and one scale tensor passed as both scales are replayed (they were launched afresh every
    time, 115-135 us of host time for an fp8 call); a later call of the same shapes that does not alias
    must not take the aliased launch's slots."""
    from tilegemm.core.replay import cache
    replay = cache("matmul")

    replay.clear()
    for trial in range(3):
        x = torch.randn(256, 512, device="cuda", dtype=torch.float16)
        assert_rel_close(tilegemm.matmul(x, x.mT), matmul_reference(x, x.mT), tolerance(torch.float16))
    assert replay.count() == 1, "x @ x.mT should be replayed"
    x, y = (torch.randn(256, 512, device="cuda", dtype=torch.float16) for _ in range(2))
    assert_rel_close(tilegemm.matmul(x, y.mT), matmul_reference(x, y.mT), tolerance(torch.float16))
    assert replay.count() == 2, "not aliased: another key"

    replay.clear()
    e4m3 = torch.float8_e4m3fn
    for fast in (False, True):
        for trial in range(3):
            a = torch.randn(256, 512, device="cuda").to(e4m3)
            b = torch.randn(384, 512, device="cuda").to(e4m3).mT
            one = torch.tensor([0.5 * (trial + 1)], device="cuda")
            out = tilegemm.matmul(a, b, scale_a=one, scale_b=one, fast_accum=fast)
            ref = a.double() @ b.double() * one.item() ** 2
            assert_rel_close(out, ref, tolerance(e4m3, out_dtype=torch.bfloat16, fast_accum=fast))
        scale_a, scale_b = torch.tensor([2.0], device="cuda"), torch.tensor([0.25], device="cuda")
        out = tilegemm.matmul(a, b, scale_a=scale_a, scale_b=scale_b, fast_accum=fast)
        assert_rel_close(out, a.double() @ b.double() * 0.5, tolerance(e4m3, out_dtype=torch.bfloat16,
                                                                          fast_accum=fast))
    assert replay.count() == 4, "one shared scale and two scales are recorded apart"


def test_replayed_copy_and_grey():
    for _ in range(3):
        x = torch.randn(1000, 37, device="cuda")
        assert torch.equal(tilegemm.copy(x), x)
        img = torch.randint(0, 256, (3, 64, 80), device="cuda", dtype=torch.uint8)
        f = img.float()
        ref = (0.2989 * f[0] + 0.5870 * f[1] + 0.1140 * f[2] + 0.5).to(torch.uint8)
        torch.testing.assert_close(tilegemm.rgb_to_grey(img), ref, rtol=0, atol=1)


def test_split_k_is_exact_on_the_shapes_that_raced():
    # 16xNxK with K slices reduced by atomics: once wrong by up to 22% without a barrier.
    for N, K in ((4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192)):
        a = torch.randn(16, K, device="cuda", dtype=torch.float16)
        b = torch.randn(K, N, device="cuda", dtype=torch.float16)
        ref = matmul_reference(a, b)
        for _ in range(5):
            assert_rel_close(tilegemm.matmul(a, b, kernel="split_k"), ref, tolerance(torch.float16))


@pytest.mark.parametrize("slices", [False, True, "apart"], ids=["atomic", "slices", "apart"])
def test_split_k_reductions_are_exact_and_slices_deterministic(slices, monkeypatch):
    from tilegemm.ops.matmul import split_k
    from tilegemm.ops.matmul.problem import make_problems

    if slices == "apart":  # the planes added by the second launch
        monkeypatch.setattr("tilegemm.ops.matmul.split_reduce.APART_BYTES", 0)
        slices = True

    for M, N, K, split in ((1, 4096, 4096, 4), (16, 1000, 3000, 3), (128, 4096, 4096, 8), (100, 257, 2049, 2)):
        a = torch.randn(M, K, device="cuda", dtype=torch.float16)
        b = torch.randn(K, N, device="cuda", dtype=torch.float16)
        ref = matmul_reference(a, b)
        cfg = dict(BLOCK_M=16 if M <= 16 else 64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4,
                   SPLIT_K=split, SLICES=slices)
        outs = []
        for _ in range(4):
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float16)
            split_k.run(make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0], cfg)
            assert_rel_close(out, ref, tolerance(torch.float16))
            outs.append(out)
        if slices:  # the planes are added in slice order, whichever program came last
            assert all(torch.equal(outs[0], o) for o in outs[1:])
    for ws, count in split_k.workspaces().values():
        assert not count.any(), "split_k must leave its counters at zero"


def test_wave_splits_of_few_tiles_reduce_apart_and_replay():
    """Few output tiles with a long K: split into about a wave, the planes added by the second launch, and
    both launches replayed (a 1x1 convolution's weight gradient is such a product)."""
    from tilegemm.ops.matmul import split_k
    from tilegemm.core.replay import cache
    replay = cache("matmul")

    replay.clear()
    for M, N, K in ((184, 168, 14400), (64, 64, 100352), (264, 72, 4904)):
        a = torch.randn(M, K, device="cuda", dtype=torch.float16)
        b = torch.randn(K, N, device="cuda", dtype=torch.float16)
        ref = matmul_reference(a, b)
        for _ in range(3):
            assert_rel_close(tilegemm.matmul(a, b, kernel="split_k"), ref, tolerance(torch.float16))
    assert replay.count() == 3


def test_auto_pads_misaligned_products_and_replays_the_copies_with_the_product():
    from tilegemm.ops.matmul import dispatch
    from tilegemm.core.replay import cache
    replay = cache("matmul")
    from tilegemm.ops.matmul.problem import make_problems

    replay.clear()
    for M, N, K, bt in ((1723, 449, 15855, False), (341, 1913, 7641, True), (600, 601, 4003, False)):
        a = torch.randn(M, K, device="cuda", dtype=torch.float16)
        b = torch.randn(N, K, device="cuda", dtype=torch.float16).T if bt else torch.randn(K, N, device="cuda",
                                                                                           dtype=torch.float16)
        p = make_problems(a, b, torch.empty(M, N, device="cuda", dtype=torch.float16), None, None, 1.0, 0.0,
                          "none", "ieee", False)[0]
        assert dispatch._pads(p, a, b), f"{M}x{N}x{K} should be padded"
        bias = torch.randn(N, device="cuda", dtype=torch.float16)
        ref = matmul_reference(a, b, bias=bias, activation="silu")
        for _ in range(3):
            assert_rel_close(tilegemm.matmul(a, b, bias=bias, activation="silu"), ref, tolerance(torch.float16))
    assert replay.count() == 3, "each padded call (copies in, the product, the copy out) should be replayed"


def test_padded_calls_timed_then_replayed_give_each_calls_product(tmp_path, monkeypatch):
    """A call that times candidates (here inside the aligned twin) is not kept as a replay: its recording held
    launches that are not the call's (or none of the product's), and a replay of it returned an older
    product. Each call, timed or replayed, must give its own inputs' product."""
    from tilegemm.core import tuning
    from tilegemm.core.replay import cache
    replay = cache("matmul")

    monkeypatch.setenv("TILEGEMM_CACHE_DIR", str(tmp_path))
    replay.clear()
    M, N, K = 300, 301, 1001
    with tuning.timing():
        for _ in range(2):
            a = torch.randn(M, K, device="cuda", dtype=torch.float16)
            b = torch.randn(K, N, device="cuda", dtype=torch.float16)
            assert_rel_close(tilegemm.matmul(a, b), matmul_reference(a, b), tolerance(torch.float16))
    for _ in range(3):
        a = torch.randn(M, K, device="cuda", dtype=torch.float16)
        b = torch.randn(K, N, device="cuda", dtype=torch.float16)
        assert_rel_close(tilegemm.matmul(a, b), matmul_reference(a, b), tolerance(torch.float16))
    tuning.forget()


def test_split_k_replays_on_its_stream_and_launches_afresh_on_another():
    from tilegemm.core.replay import cache
    replay = cache("matmul")

    replay.clear()
    a = torch.randn(16, 4096, device="cuda", dtype=torch.float16)
    b = torch.randn(4096, 1024, device="cuda", dtype=torch.float16)
    ref = matmul_reference(a, b)
    for _ in range(3):
        assert_rel_close(tilegemm.matmul(a, b, kernel="split_k"), ref, tolerance(torch.float16))
    assert replay.count() == 1, "split_k calls should be replayed"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outs = [tilegemm.matmul(a, b, kernel="split_k") for _ in range(3)]
    torch.cuda.current_stream().wait_stream(side)
    for out in outs:
        assert_rel_close(out, ref, tolerance(torch.float16))


def test_replays_call_triton_launch_hooks():
    from triton import knobs

    a = torch.randn(64, 64, device="cuda", dtype=torch.float16)
    b = torch.randn(64, 64, device="cuda", dtype=torch.float16)
    tilegemm.matmul(a, b, kernel="grouped")  # recorded
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731 (a LazyDict)
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        out = tilegemm.matmul(a, b, kernel="grouped")  # replayed, through Triton's path for the hook
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen and "matmul" in seen[0]
    assert_rel_close(out, matmul_reference(a, b), tolerance(torch.float16))


def test_tensors_on_another_gpu_than_the_current_one():
    """Triton launches on the current device: tilegemm makes the tensors' device current for the call."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (ran on the 2-GPU machine kind)")
    other = torch.device("cuda", 1)
    a = torch.randn(300, 200, device=other, dtype=torch.float16)
    b = torch.randn(200, 176, device=other, dtype=torch.float16)
    ref = matmul_reference(a, b)
    for current in (0, 1, 0):  # a replay recorded with one device current must not launch with another
        with torch.cuda.device(current):
            for kernel in RUNGS:
                for _ in range(2):  # the second call takes the replay path
                    out = mm(a, b, kernel=kernel)
                    assert out.device == other
                    torch.cuda.synchronize(other)
                    assert_rel_close(out, ref, tolerance(torch.float16))
            x = torch.randn(1000, 33, device=other).mT
            assert torch.equal(tilegemm.copy(x), x)
            img = torch.rand(2, 3, 64, 48, device=other)
            grey = tilegemm.rgb_to_grey(img)
            want = 0.2989 * img[:, 0] + 0.5870 * img[:, 1] + 0.1140 * img[:, 2]
            assert grey.device == other and torch.allclose(grey, want, atol=1e-5)
    assert torch.cuda.current_device() == 0


def test_a_replay_on_another_thread_has_an_allocator():
    """A kernel that makes its TMA descriptors on the device (``gluon_tf32``) needs Triton's allocator, which
    Triton keeps per thread: a replay recorded on this thread and made on a fresh one (a server's pool, autograd's
    backward thread) sets one there first."""
    import threading

    a, b = (torch.randn(1024, 1024, device="cuda") for _ in range(2))
    tilegemm.matmul(a, b, kernel="gluon_tf32", precision="tf32")  # recorded here
    a2, b2 = (torch.randn(1024, 1024, device="cuda") for _ in range(2))
    results = []

    def other():
        try:
            results.append(tilegemm.matmul(a2, b2, kernel="gluon_tf32", precision="tf32"))
        except Exception as exc:  # noqa: BLE001 - reported below
            results.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    (out,) = results
    assert isinstance(out, torch.Tensor), out
    assert_rel_close(out, matmul_reference(a2, b2), tolerance(torch.float32, "tf32"))
