"""The MoE model entries (``tilegemm bench --op grouped|grouped_w4a16 --model qwen3_moe|mixtral``) on tiny configs
under the interpreter: every row checked against the baseline's logits, the 4-bit twin computing what the 16-bit
model holding its dequantized weights computes, and a wrong twin caught."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tilegemm.bench.base import bench_op  # noqa: E402
from tilegemm.bench.runner import run_bench  # noqa: E402


def _rows(result):
    return {(r.shape, r.kernel): r for r in result.rows}


@pytest.fixture
def ieee_fp32():
    """fp32 products in full precision on both sides: on the GPU, tf32 would leave about 1e-3 between them."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


@pytest.fixture
def one_layer(monkeypatch):
    """The tiny models with one decoder layer, where a test's point is not what the layers pass on."""
    from tilegemm.models import moe

    monkeypatch.setattr(moe, "TINY_LAYERS", 1)


@pytest.fixture(scope="module")
def int4_entry():
    """(op, result) of the 4-bit entry's first tiny case with rows auto and fused, one layer: run once (the
    interpreter takes seconds a forward), read by the tests of either row."""
    from tilegemm.models import moe

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "TINY_LAYERS", 1)
        op = bench_op("grouped_w4a16").model_bench("qwen3_moe")
        op.check_kernel("fused")
        result = run_bench(op, op.cases("tiny")[:1], op.default_dtype(), ["auto", "fused"], rep_ms=1, warmup_ms=0)
    return op, result


# The tiny sweep's cases differ in batch and mode, which both models take alike: each case runs on one of them (the
# interpreter takes seconds a case): the prefill on qwen3_moe and the batch-2 decode step on mixtral here, the
# batch-1 step in the 4-bit entry's tests (int4_entry), bf16's batch 2 on qwen3_moe below.
@pytest.mark.parametrize("arch, run", [("qwen3_moe", ["b1 prefill 16"]), ("mixtral", ["b2 eager"])])
def test_the_16_bit_entry_checks_every_row(arch, run, ieee_fp32, one_layer):
    # one layer each (the interpreter takes seconds a layer); the bf16 test below checks every layer of two
    op = bench_op("grouped").model_bench(arch)
    cases = op.cases("tiny")
    assert [c.label for c in cases] == ["b1 eager", "b2 eager", "b1 prefill 16"]
    for c in cases:  # tokens a call: the batch for a decode step, its prompt tokens for a prefill
        assert op.work(c, "fp32", {}) == c.dims["batch"] * (16 if c.dims["mode"] == "prefill" else 1)
    cases = [c for c in cases if c.label in run]
    result = run_bench(op, cases, "fp32", ["auto"], rep_ms=1, warmup_ms=0)  # (the interpreter's default)
    rows = _rows(result)
    assert len(rows) == 3 * len(run)  # baseline, second baseline, auto
    for r in rows.values():
        assert r.status == "ok", r
    for c in cases:
        auto = rows[(c.label, "auto")]
        assert auto.rel_err < 1e-4, auto  # fp32: the implementations differ in summation order only
    assert "grouped_mm" in result.meta["model_description"]
    # every layer's experts checked on the baseline's inputs, and how much the experts move the logits recorded
    dims = rows[(cases[0].label, "auto")].dims
    assert dims["experts_rel_err"] < 1e-4 and 0 < dims["experts_share"] < 1, dims


def test_bf16_decode_rows_step_on_the_same_token():
    # in bf16 the rows' own prefills may end in different argmax tokens (a near-tie); every row decodes the
    # baseline's token, so their logits compare (they were 0.9-1.3 apart, reported wrong)
    # (batch 2 in two layers, where the rows' own tokens differ; batch 1 decodes the same way)
    op = bench_op("grouped").model_bench("qwen3_moe")
    cases = [c for c in op.cases("tiny") if c.dims["mode"] != "prefill" and c.dims["batch"] == 2]
    assert len(cases) == 1
    result = run_bench(op, cases, "bf16", ["auto"], rep_ms=1, warmup_ms=0)
    for r in _rows(result).values():
        assert r.status == "ok" and (r.rel_err is None or r.rel_err < 5e-2), r
    # every layer's experts checked on the baseline's inputs, in the tiny model's two layers
    dims = result.rows[0].dims
    assert dims["layers"] == 2 and dims["experts_rel_err"] < op.EXPERTS_TOLERANCE["bf16"], dims


def test_the_int4_twin_is_what_the_16_bit_model_holds(device):
    from tilegemm.models import moe
    from tilegemm.nn import Int4Linear
    from tilegemm.nn.moe import _int4
    from tilegemm.ops.w4a16.format import dequantize

    torch.manual_seed(0)
    model = moe.build("qwen3_moe", tiny=True, layers=1, dtype=torch.float16, device=device)
    twin = moe.int4_twin(model, moe.TINY_GROUP)
    linears = {n: type(m) for n, m in twin.named_modules() if isinstance(m, (torch.nn.Linear, Int4Linear))}
    assert linears["lm_head"] is torch.nn.Linear
    assert all(t is Int4Linear for n, t in linears.items() if n != "lm_head") and len(linears) > 1
    for m16, m4 in zip(moe.experts_blocks(model), moe.experts_blocks(twin)):
        for name in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(m16, name), dequantize(_int4(m4, name)))
            assert name not in m4._parameters  # the 16-bit experts are not in the copy
    assert twin.config._experts_implementation == "tilegemm"
    ids = torch.randint(0, 256, (2, 5), device=device)
    with torch.no_grad():
        moe.set_experts(model, "grouped_mm")
        a = model(input_ids=ids).logits.float()
        b = twin(input_ids=ids).logits.float()
    assert ((a - b).norm() / a.norm()).item() < 5e-3


def test_the_int4_entry_runs_and_catches_a_wrong_twin(monkeypatch, one_layer, int4_entry):
    from tilegemm.models import moe

    op, result = int4_entry
    assert all(r.status == "ok" for r in result.rows), result.rows
    assert result.rows[0].dims["experts_rel_err"] < op.EXPERTS_TOLERANCE[op.default_dtype()]

    real = moe.int4_twin

    def broken(model, group_size):
        twin = real(model, group_size)
        for m in moe.experts_blocks(twin):
            m.tilegemm_down_proj_scales.zero_()  # experts that compute nothing
        return twin

    monkeypatch.setattr(moe, "int4_twin", broken)
    op = bench_op("grouped_w4a16").model_bench("qwen3_moe")
    # the prefill case: the layer check comes first whatever the case, and a prefill row runs nothing before it
    cases = [c for c in op.cases("tiny") if c.dims["mode"] == "prefill"]
    result = run_bench(op, cases, op.default_dtype(), ["auto"], rep_ms=1, warmup_ms=0)
    auto = [r for r in result.rows if r.kernel == "auto"][0]
    # the logits barely move (the experts' share of them is small at transformers' initialisation); the layer
    # check fails the row
    assert auto.status == "error" and "the experts disagree with grouped_mm's on the same inputs" in auto.message, auto
    assert auto.dims["experts_rel_err"] > 0.5


def test_the_int4_entry_fused_row(int4_entry):
    # --kernels auto,fused: the 4-bit copy with its attention's q/k/v joined, checked against the baseline's logits
    op, result = int4_entry
    kernels = [r.kernel for r in result.rows]
    assert "fused" in kernels and all(r.status == "ok" for r in result.rows), result.rows
    fused = op._built[1]["fused"][0]
    assert len(fused.tilegemm_fused) == fused.config.num_hidden_layers  # q/k/v of each layer


def test_batched_mm_bytes_and_the_layers_knob():
    from tilegemm.models import moe
    from tilegemm.models.bench import _batched_mm_bytes

    torch.manual_seed(0)
    model = moe.build("mixtral", tiny=True, dtype=torch.float16)
    s = moe.TINY_MIXTRAL
    assert _batched_mm_bytes(model, 10) == 10 * 2 * 3 * s["hidden_size"] * s["intermediate_size"] * 2
    assert moe.layers_that_fit("qwen3_moe", requested=5) == 5
    op = bench_op("grouped").model_bench("mixtral", layers=3)
    assert op.layers == 3 and op.name == "grouped:mixtral"
    with pytest.raises(ValueError, match="choose one of qwen3_moe, mixtral"):
        moe.arch_of("deepseek")


def test_the_full_size_entries_need_a_gpu():
    from tilegemm.bench.base import BenchError
    from tilegemm.core.runtime import interpreting

    op = bench_op("grouped").model_bench("qwen3_moe")
    if not interpreting():  # on a GPU they are there
        assert op.cases("decode")
        return
    with pytest.raises(BenchError, match="needs a CUDA GPU; under the interpreter run --sweep tiny"):
        op.cases("decode")


def test_a_transformers_without_the_experts_interface_is_refused(monkeypatch):
    import tilegemm.nn.moe as nn_moe
    from tilegemm.bench.base import BenchError

    monkeypatch.setattr(nn_moe, "register_experts", lambda: False)
    op = bench_op("grouped").model_bench("mixtral")
    with pytest.raises(BenchError, match=r"needs transformers' experts interface \(transformers >= 5\)"):
        op.cases("tiny")


def test_experts_agreement_does_not_hide_nan():
    # A layer whose experts return NaN must not read as agreeing (max() of floats drops a NaN).
    from tilegemm.models import moe

    torch.manual_seed(0)
    model = moe.build("qwen3_moe", tiny=True, dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 6))
    hooks = []

    def use(m, which):
        moe.set_experts(m, "grouped_mm")
        if which == "model":
            hooks.extend(b.register_forward_hook(lambda mod, args, out: torch.full_like(out, float("nan")))
                         for b in moe.experts_blocks(m))

    try:
        err = moe.experts_agreement(model, model, ids, use)
    finally:
        for h in hooks:
            h.remove()
    assert not err <= 1e-2, err


def test_layers_that_fit_counts_the_twins_fragments(monkeypatch):
    # The 4-bit twin keeps, where the decode kernel runs, the fragment layouts of its weights besides the packed
    # parts: each further layer the estimate lets in must have room for both.
    from tilegemm.models import moe
    from tilegemm.ops.w4a16.format import quantize

    w = torch.randn(1, 256, 512, dtype=torch.bfloat16)
    q = quantize(w, moe.GROUP)
    held = [q.qweight, q.scales, q.zeros, *q.fragments(gated=True)]
    ratio = sum(t.numel() * t.element_size() for t in held) / (w.numel() * w.element_size())
    per_layer = moe.layer_gib(moe.QWEN3_30B_A3B) * (1 + ratio) * 2**30  # the 16-bit layer and its 4-bit copy

    def fit(free):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (int(free), int(free)))
        return moe.layers_that_fit("qwen3_moe", int4=True)

    base = 40 * 2**30
    assert fit(base + 10 * per_layer) - fit(base) == 10


def test_the_int4_description_says_what_the_twin_is(monkeypatch):
    # The tiny model's group, whatever machine runs it, and the twin's Linears (quantize_ makes them 4-bit too).
    import tilegemm.models.bench as mb

    op = bench_op("grouped_w4a16").model_bench("qwen3_moe")
    cases = op.cases("tiny")
    monkeypatch.setattr(mb, "interpreting", lambda: False)  # a GPU running --sweep tiny
    text = op.description(cases)
    assert "group 32" in text and "Linears but lm_head are 4-bit" in text, text
