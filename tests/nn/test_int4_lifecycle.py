"""Int4Linear and quantize_ through a model's life: state dicts that do or do not fit, dtype conversions, shared
and hooked layers, autocast, 4-bit experts under .float()/.half(). Layers that run kernels go to the ``device``
fixture's device: the CPU under the interpreter, the GPU otherwise."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from conftest import assert_rel_close
from tilegemm.core.runtime import interpreting
from tilegemm.nn import Int4Linear


def _ref(layer: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    y = x.double() @ layer.dequantize().double().T
    return y if layer.bias is None else y + layer.bias.double()


# --- Int4Linear.load_state_dict -------------------------------------------------------------------------------


def test_state_dict_of_another_shape_is_refused_naming_keys_and_shapes(device):
    dst = Int4Linear.from_linear(nn.Linear(64, 16, dtype=torch.float16), group_size=32).to(device)
    src = Int4Linear.from_linear(nn.Linear(64, 32, dtype=torch.float16), group_size=32)
    x = torch.randn(3, 64, dtype=torch.float16, device=device)
    before = dst(x).clone()
    kept = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"qweight \[8, 32\].*Int4Linear\(in_features=64, out_features=16") as err:
        dst.load_state_dict(src.state_dict())
    assert "size mismatch for qweight" in str(err.value) and "[8, 16]" in str(err.value)
    # the layer keeps its shapes and still computes what it did
    assert {k: tuple(v.shape) for k, v in dst.state_dict().items()} == {k: tuple(v.shape) for k, v in kept.items()}
    assert torch.equal(dst(x), before)


@pytest.mark.parametrize("assign", [False, True])
def test_state_dict_parts_of_other_layouts_load_as_a_copy_makes_them(assign, device):
    # assign=True puts the dict's own tensors in place: strided words, int64 or uint32 words and an int32 order
    # are made what the kernels read (a copying load converted them; assigned, every forward after failed)
    src = Int4Linear.from_linear(nn.Linear(128, 48, dtype=torch.float16), group_size=64)
    sd = src.state_dict()
    sd["perm"] = torch.randperm(128)
    src.load_state_dict(sd)
    x = torch.randn(3, 128, dtype=torch.float16, device=device)
    want = src.to(device)(x)
    words = sd["qweight"]
    for qweight, perm in ((words.T.contiguous().T, sd["perm"].int()), (words.long() & 0xFFFFFFFF, sd["perm"]),
                          (words.view(torch.uint32), sd["perm"])):
        dst = Int4Linear(128, 48, group_size=64, dtype=torch.float16)
        dst.load_state_dict({**sd, "qweight": qweight, "perm": perm}, assign=assign)
        assert dst.qweight.dtype == torch.int32 and dst.qweight.is_contiguous() and dst.perm.dtype == torch.int64
        assert torch.equal(dst.to(device)(x), want)
    # a dict cast whole (.half() over it) brings packed words as floats: refused, the layer keeps its weight
    dst = Int4Linear.from_linear(nn.Linear(128, 48, dtype=torch.float16), group_size=64).to(device)
    before = dst(x).clone()
    with pytest.raises(RuntimeError, match=r"qweight must be int32 \(eight 4-bit values a word\), got fp16"):
        dst.load_state_dict({k: v.half() for k, v in sd.items()}, assign=assign)
    assert torch.equal(dst(x), before)


@pytest.mark.parametrize("groups", [3, 5])
def test_state_dict_whose_groups_do_not_split_k_is_refused(groups):
    dst = Int4Linear(128, 16, group_size=32)
    sd = dst.state_dict()
    sd["scales"] = torch.ones(groups, 16, dtype=torch.float16)
    sd["zeros"] = torch.ones(groups, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=rf"{groups} groups do not split in_features = 128"):
        dst.load_state_dict(sd)
    assert dst.scales.shape == (4, 16) and dst.group_size == 32


def test_state_dict_value_that_is_not_a_tensor_is_named():
    # torch's load names it, where reading its shape raised AttributeError
    dst = Int4Linear(64, 16, group_size=32)
    sd = dst.state_dict()
    sd["qweight"] = sd["qweight"].tolist()
    with pytest.raises(RuntimeError, match='named "qweight", expected torch.Tensor or Tensor-like object'):
        dst.load_state_dict(sd)
    assert dst.qweight.shape == (8, 16) and dst.group_size == 32


@pytest.mark.parametrize("built_group", [32, 128])
def test_state_dict_keeps_the_module_scale_dtype(built_group, device):
    # a bf16 state dict into an fp16 module: its scales stay fp16 whatever group size the module was built with
    src = Int4Linear.from_linear(nn.Linear(128, 16, dtype=torch.bfloat16), group_size=32).to(device)
    dst = Int4Linear(128, 16, group_size=built_group, dtype=torch.float16, device=device)
    dst.load_state_dict(src.state_dict())
    assert dst.scales.dtype == dst.zeros.dtype == torch.float16 and dst.group_size == 32
    x = torch.randn(2, 128, dtype=torch.float16, device=device)
    y = dst(x)
    assert y.dtype == torch.float16
    assert_rel_close(y, _ref(dst, x), 2e-3)
    assert_rel_close(y, _ref(src, x), 2e-2)  # the same weight, its scales rounded to fp16


@pytest.mark.parametrize("saved_group", [-1, 128])
def test_one_group_state_dict_round_trip_keeps_the_group_size(saved_group):
    """A layer of one group over all of K = 128 holds the same tensors whether made with group size -1 or 128:
    its state dict's metadata records which (kept by torch.save), so a load into a layer built with another group
    size gives the saved one back, as the saved-format loader gives it from the saved config's group sizes."""
    import io

    from tilegemm.models.pretrained import _saved_weight

    src = nn.Sequential(Int4Linear.from_linear(nn.Linear(128, 16, dtype=torch.float16), group_size=saved_group))
    assert src[0].group_size == saved_group and src[0].scales.shape[0] == 1
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    for state in (src.state_dict(), torch.load(buf)):
        for built in (32, -1, 128):
            dst = nn.Sequential(Int4Linear(128, 16, group_size=built))
            dst.load_state_dict(state)
            assert dst[0].group_size == saved_group, (built, dst[0].group_size)
            assert torch.equal(dst[0].dequantize(), src[0].dequantize())
    sd = src[0].state_dict()
    assert _saved_weight(sd["qweight"], sd["scales"], sd["zeros"], sd["perm"], (16, 128),
                         (saved_group,)).group_size == saved_group
    # without the metadata (a safetensors file): the layer as built says which; built otherwise, the default the
    # saved-format loader takes where the config lists neither (K, a group size the kernels take)
    plain = {k: v.clone() for k, v in sd.items()}
    for built, want in ((-1, -1), (128, 128), (32, 128)):
        dst = Int4Linear(128, 16, group_size=built)
        dst.load_state_dict(plain)
        assert dst.group_size == want
    assert _saved_weight(sd["qweight"], sd["scales"], sd["zeros"], sd["perm"], (16, 128)).group_size == 128


# --- quantize_: shared layers, hooks, training flag, DTensors -------------------------------------------------


def test_quantize_gives_a_shared_linear_one_int4_layer_under_every_name(device):
    from tilegemm.nn import quantize_

    shared = nn.Linear(64, 64, dtype=torch.float16, device=device)

    class TwoNames(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = shared
            self.b = shared  # the same layer twice under one parent

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    model = nn.ModuleDict(dict(block1=nn.Sequential(shared, nn.ReLU()), block2=nn.Sequential(shared, nn.ReLU()),
                               twice=TwoNames()))
    quantize_(model, group_size=32)
    layers = [model.block1[0], model.block2[0], model.twice.a, model.twice.b]
    assert all(isinstance(m, Int4Linear) for m in layers) and all(m is layers[0] for m in layers)
    assert model.tilegemm_skipped == []
    x = torch.randn(3, 64, dtype=torch.float16, device=device)
    q = layers[0]
    ref = torch.relu(_ref(q, x)).to(torch.float16)
    assert_rel_close(model.twice(x), _ref(q, ref), 3e-3)


def test_quantize_notes_a_plain_models_tied_output_layer_it_unties():
    # a plain model tying its output layer to its embedding by assignment: the 4-bit layer holds its own copy,
    # which a note says (a transformers model's config records it instead); a filter that declines keeps the tie
    from tilegemm.nn import quantize_
    from tilegemm.nn.convert import ConversionNote

    def build():
        model = nn.ModuleDict(dict(emb=nn.Embedding(100, 64), body=nn.Linear(64, 64), head=nn.Linear(64, 100)))
        model.head.weight = model.emb.weight
        return model.half()

    model = build()
    with pytest.warns(ConversionNote, match=r"untied 1 layer.*head \(shared with emb\.weight\)"):
        quantize_(model, group_size=32)
    assert isinstance(model.head, Int4Linear) and model.tilegemm_untied == [("head", "emb.weight")]
    assert model.tilegemm_skipped == [] and isinstance(model.emb.weight, nn.Parameter)
    kept = quantize_(build(), group_size=32, filter=lambda name, m: name != "head", warn=False)
    assert kept.tilegemm_untied == [] and kept.head.weight is kept.emb.weight
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = quantize_(build(), group_size=32, warn=False)  # warn=False silences the note, the list stays
    assert quiet.tilegemm_untied == [("head", "emb.weight")]


def test_quantize_keeps_hooks_and_the_training_flag(device):
    from tilegemm.nn import quantize_

    seen = []
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)).half().eval().to(device)
    model[0].register_forward_pre_hook(lambda m, args: seen.append(("pre", type(m).__name__)))
    handle = model[0].register_forward_hook(lambda m, args, out: out * 2)  # a hook that changes the output
    model[2].train()  # one layer in training mode, the rest in eval
    quantize_(model, group_size=32)
    assert isinstance(model[0], Int4Linear) and isinstance(model[2], Int4Linear)
    assert [m.training for m in model] == [False, False, True]
    x = torch.randn(2, 64, dtype=torch.float16, device=device)
    h = torch.relu(2 * _ref(model[0], x)).to(torch.float16)
    assert_rel_close(model(x), _ref(model[2], h), 3e-3)
    assert seen == [("pre", "Int4Linear")]
    handle.remove()  # the caller's handle still removes it
    h = torch.relu(_ref(model[0], x)).to(torch.float16)
    assert_rel_close(model(x), _ref(model[2], h), 3e-3)


def test_quantize_keeps_a_linear_whose_forward_was_replaced_on_the_instance():
    # an Int4Linear runs its own forward: the instance's (accelerate's hooks, a patch) would be dropped silently
    from tilegemm.nn import quantize_

    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8)).half()
    original = model[0].forward
    model[0].forward = lambda x: original(x) * 0
    quantize_(model, group_size=32, warn=False)
    assert type(model[0]) is nn.Linear and isinstance(model[1], Int4Linear)
    assert "replaced on the instance" in dict(model.tilegemm_skipped)["0"]


def test_quantize_refuses_dtensor_weights_before_changing_anything():
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from tilegemm.nn import quantize_

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)).half()
        model[2].weight = nn.Parameter(distribute_tensor(model[2].weight.detach(), mesh, [Replicate()]))
        with pytest.raises(TypeError, match=r"2's weight is a DTensor .* quantize before parallelizing"):
            quantize_(model, group_size=32)
        assert type(model[0]) is nn.Linear  # nothing swapped
        with pytest.raises(TypeError, match="DTensor"):
            Int4Linear.from_linear(model[2], group_size=32)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("poison", ["nan", "overflow"])
def test_quantize_refused_at_a_later_layer_leaves_the_model_as_it_was(poison):
    # a weight the 4-bit format cannot hold (NaN; a group whose scale passes fp16's range) is met layer by layer:
    # the layers before it were swapped already, and the config was left without its quantization_config
    import transformers

    from tilegemm.nn import quantize_

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[3, 5] = float("nan") if poison == "nan" else 1e6
        model.model.layers[0].mlp.up_proj.weight[3, 6] = 0.0 if poison == "nan" else -1e6
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"quantize_: model\.layers\.0\.mlp\.up_proj: "):
        quantize_(model, group_size=32, warn=False)
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert getattr(model.config, "quantization_config", None) is None and not hasattr(model, "tilegemm_skipped")


# --- Int4Linear's forward: dtypes and autocast ------------------------------------------------------------------


@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("module_dtype", [torch.float32, torch.float16])
def test_int4_linear_runs_in_the_autocast_dtype(module_dtype, cast, device):
    q = Int4Linear.from_linear(nn.Linear(64, 16, dtype=module_dtype), group_size=32).to(device)
    x = torch.randn(3, 64, device=device)  # fp32, as autocast regions get it
    with torch.autocast(device, dtype=cast):
        y = q(x)
    assert y.dtype == cast
    assert_rel_close(y, _ref(q, x.to(cast)), 1.5e-2)


@pytest.mark.parametrize("scales, cast", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_int4_linear_under_autocast_to_the_other_dtype_compiles_and_exports(scales, cast, device):
    # the scales converted for the call were checked by a branch on their values, which a traced graph has not:
    # torch.compile(fullgraph=True) and torch.export failed ("data-dependent branching")
    q = Int4Linear.from_linear(nn.Linear(64, 16, dtype=scales), group_size=32).to(device)

    class Cast(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = q

        def forward(self, x):
            with torch.autocast(device, dtype=cast):
                return self.q(x)

    x = torch.randn(3, 64, device=device)
    want = Cast()(x)
    assert want.dtype == cast
    got = torch.compile(Cast(), fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.export.export(Cast(), (x,)).module()(x), want)


@pytest.mark.parametrize("module_dtype,x_dtype", [(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                                  (torch.float16, torch.bfloat16)])
def test_int4_linear_names_its_dtypes_when_the_input_has_another(module_dtype, x_dtype):
    q = Int4Linear.from_linear(nn.Linear(64, 16, dtype=module_dtype), group_size=32)
    with pytest.raises(TypeError, match=r"Int4Linear\(in_features=64, out_features=16\) is a module of dtype "
                                        rf"{'fp32' if module_dtype == torch.float32 else 'fp16'} .* input of "
                                        rf"dtype {'fp16' if x_dtype == torch.float16 else 'bf16'}"):
        q(torch.randn(2, 64, dtype=x_dtype))



@pytest.mark.parametrize("bias", [True, False])
def test_a_float64_module_runs_torchs_product_of_its_weight(bias, device):
    # .double() (for gradcheck, as with tilegemm.nn.Linear): no kernel takes float64, which was a TypeError naming
    # w4a16.matmul; torch's product of the dequantized weight, in float64, with its gradients
    q = Int4Linear.from_linear(nn.Linear(64, 16, bias=bias, dtype=torch.float16), group_size=32).to(device)
    want = _ref(q, torch.ones(1, 64, dtype=torch.float64, device=device))
    q.double()
    assert q.qweight.dtype == torch.int32 and q.scales.dtype == torch.float16
    x = torch.randn(2, 3, 64, dtype=torch.float64, device=device, requires_grad=True)
    y = q(x)
    assert y.dtype == torch.float64 and y.shape == (2, 3, 16)
    torch.testing.assert_close(y, _ref(q, x.detach()), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(q(torch.ones(1, 64, dtype=torch.float64, device=device)), want)
    assert torch.autograd.gradcheck(q, (x[:1, :1],))
    with torch.autocast(device, dtype=torch.bfloat16):  # float64 is left as autocast leaves it for torch's Linear
        assert q(x).dtype == torch.float64

# --- dtype conversions of the module: the packed parts stay as the kernels read them ----------------------------


def _moe_block_4bit(device):
    """A quantized transformers-4.x-style MoE model (test_moe_legacy's) on ``device``: 4-bit stacked experts."""
    import warnings

    from test_moe_legacy import Model

    from tilegemm.nn import quantize_

    model = Model(H=32, I=64, E=4, k=2).half().to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_(model, group_size=32)


def _parts(module: nn.Module) -> dict:
    return {n: t.clone() for n, t in module.named_buffers()}


@pytest.mark.parametrize("make", ["linear", "experts"])
@pytest.mark.parametrize("cast", ["type-fp16", "type-fp32", "float8"])
def test_casts_leave_the_packed_parts_and_scales_as_they_were(make, cast, device):
    # Module.type(dtype) casts every buffer (it rounded the int32 packed words to floats), and a cast to a float
    # the kernels do not read (float8) round-tripped the scales through it: the 4-bit parts keep their values
    if make == "linear":
        model = nn.Sequential(Int4Linear.from_linear(nn.Linear(64, 16, bias=False, dtype=torch.float16),
                                                     group_size=32)).to(device)
        x = torch.randn(3, 64, dtype=torch.float16, device=device)
    else:
        model = _moe_block_4bit(device)
        model.inp.bias = None  # (a 16-bit bias would round through float8: that one is torch's to convert)
        x = torch.randn(1, 3, 16, dtype=torch.float16, device=device)
    before, y = _parts(model), model(x)
    if cast == "float8":
        model.to(torch.float8_e4m3fn)
    else:
        model.type(torch.float16 if cast == "type-fp16" else torch.float32)
    after = _parts(model)
    assert {n: (t.dtype, t.shape) for n, t in after.items()} == {n: (t.dtype, t.shape) for n, t in before.items()}
    assert all(torch.equal(after[n], before[n]) for n in before)
    model.half()
    if make == "linear":
        assert torch.equal(model(x), y)
    else:  # (the 16-bit router and input layer went through fp32 or float8 too)
        assert_rel_close(model(x), y.double(), 0.1 if cast == "float8" else 1e-3)


@pytest.mark.parametrize("make", ["linear", "experts"])
def test_half_refuses_bf16_scales_past_fp16s_range(make, device):
    # .half() rounded them to inf (NaN outputs), where Int4Weight.half() refuses them
    if make == "linear":
        lin = nn.Linear(64, 16, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.mul_(1e7)
        module = Int4Linear.from_linear(lin, group_size=32).to(device)
        match = r"Int4Linear\(in_features=64, .*dtype=torch.bfloat16\): its bf16 4-bit scales hold values past fp16"
    else:
        module = _moe_block_4bit(device).to(torch.bfloat16).layers[0]
        with torch.no_grad():
            module.tilegemm_down_proj_scales[0, 0] = 1e6
        match = "SparseMoeBlock: its bf16 4-bit scales hold values past fp16's range"
    before = _parts(module)
    bias = module.bias.detach().clone() if make == "linear" else None
    with pytest.raises(ValueError, match=match):
        module.half()
    after = _parts(module)
    assert all(after[n].dtype == before[n].dtype and torch.equal(after[n], before[n]) for n in before)
    if make == "linear":  # the bias too: a bf16 bias beside fp16 scales refused every input
        assert module.bias.dtype == torch.bfloat16 and torch.equal(module.bias, bias)
        assert module(torch.randn(2, 64, device=device, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("make", ["linear", "experts"])
def test_half_refuses_bf16_scales_that_make_weights_past_fp16s_range(make, device):
    # the scales fit fp16 but 8 and more steps of them do not: dequantize gave inf, the mma kernel NaN
    if make == "linear":
        lin = nn.Linear(64, 16, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.mul_(1e6)
        module = Int4Linear.from_linear(lin, group_size=32).to(device)
        scales = module.scales
    else:
        module = _moe_block_4bit(device).to(torch.bfloat16).layers[0]
        with torch.no_grad():
            module.tilegemm_down_proj_scales[0, 0] = 1e4
        scales = module.tilegemm_down_proj_scales
    assert bool(torch.isfinite(scales.half()).all())
    before = _parts(module)
    with pytest.raises(ValueError, match="or make weights past it"):
        module.half()
    after = _parts(module)
    assert all(after[n].dtype == before[n].dtype and torch.equal(after[n], before[n]) for n in before)


def test_state_dict_whose_scales_overflow_the_module_dtype_is_refused(device):
    # a bf16 state dict into an fp16 layer: converted, its weights became inf (NaN outputs); the layer keeps its own
    lin = nn.Linear(64, 16, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.mul_(1e6)
    src = Int4Linear.from_linear(lin, group_size=32)
    for assign in (False, True):
        dst = Int4Linear.from_linear(nn.Linear(64, 16, bias=False, dtype=torch.float16), group_size=32).to(device)
        x = torch.randn(3, 64, dtype=torch.float16, device=device)
        before, kept = dst(x), _parts(dst)
        with pytest.raises(RuntimeError, match=r"scales bf16\) holds values past fp16's range.*\.to\(torch.bfloat16\)"):
            dst.load_state_dict(src.state_dict(), assign=assign)
        assert all(torch.equal(t, kept[n]) for n, t in _parts(dst).items())
        assert torch.equal(dst(x), before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("where", ["cpu", "meta"])
def test_assigned_state_dict_keeps_the_module_dtypes(dtype, where, device):
    # load_state_dict(assign=True) of a bf16 state dict: the scales were made the layer's, the bias stayed bf16,
    # and the next forward refused the layer's own bias
    src = Int4Linear.from_linear(nn.Linear(64, 16, dtype=torch.bfloat16), group_size=32).to(device)
    dst = Int4Linear(64, 16, group_size=32, dtype=dtype, device=device if where == "cpu" else "meta")
    dst.load_state_dict(src.state_dict(), assign=True)
    assert dst.scales.dtype == torch.float16 and dst.bias.dtype == dtype and not dst.bias.requires_grad
    assert isinstance(dst.bias, nn.Parameter)
    x = torch.randn(3, 64, dtype=dtype, device=device)
    y = dst(x)
    assert y.dtype == dtype
    assert_rel_close(y, _ref(dst, x.half()), 2e-3)


@pytest.mark.parametrize("make", ["linear", "experts"])
def test_a_memory_format_leaves_the_fragment_layouts_dense(make, device, keep_fragments):
    # .to(memory_format=torch.channels_last) (a vision model's, whose head is 4-bit) restrided the 4-D fragment
    # layouts, which the fragment kernel reads as dense, and failed on the experts' 5-D ones
    from tilegemm.nn.moe import _int4, keep_fragments_

    if make == "linear":
        model = nn.Sequential(Int4Linear.from_linear(nn.Linear(64, 16, dtype=torch.float16), group_size=32))
        model.to(device)
        assert model[0].fweight.dim() == 4
    else:
        model = _moe_block_4bit(device)
        block = model.layers[0]
        w = _int4(block, "down_proj")
        w.fragments()  # (made where the fragment kernel runs: made here to hold them on any device)
        keep_fragments_(block, "down_proj", w)
        assert block.tilegemm_down_proj_frag_w.dim() == 5
    before = _parts(model)
    x = torch.randn(1, 64, dtype=torch.float16, device=device)  # one row: the small-batch kernel reads fragments
    y = model(x) if make == "linear" else None
    model.to(memory_format=torch.channels_last)
    after = dict(model.named_buffers())
    assert all(t.is_contiguous() and torch.equal(t, before[n]) for n, t in after.items())
    if make == "linear":
        torch.testing.assert_close(model(x), y, rtol=0, atol=0)


def test_repr_names_the_modules_dtype_and_the_scales_where_they_differ():
    fp32 = Int4Linear.from_linear(nn.Linear(64, 16), group_size=32)
    assert repr(fp32).endswith("group_size=32, dtype=torch.float32, scales=torch.float16)")
    assert repr(fp32.half()).endswith("group_size=32, dtype=torch.float16)")


@pytest.mark.skipif(not interpreting(), reason="calls the layer on the CPU, where the interpreter runs it; on a "
                    "Hopper GPU tests/nn/test_int4_fragments_gpu.py follows the layout through real moves")
def test_the_fragment_layout_is_kept_only_where_its_kernel_runs(monkeypatch):
    # On the CPU (and a GPU before Hopper) no call reads the layout: none is made, the 4-bit memory is the parts'.
    from tilegemm.ops.w4a16 import dispatch

    lin = nn.Linear(256, 48).half()
    layer = Int4Linear.from_linear(lin, group_size=64)
    assert layer.fweight.numel() == 0 and layer.fzs.numel() == 0 and layer.fweight is not layer.fzs
    assert layer.weight._frag is None
    x = torch.randn(3, 256, dtype=torch.float16)
    out = layer(x)
    assert_rel_close(out.float(), x.float() @ layer.dequantize().float().T + lin.bias.float(), 2e-3)
    # Moved where it runs (a device the policy keeps it on), the layout is made then, not at a first call (a model
    # compiled next traces no packing); moved where it does not, it is dropped.
    kept = {"on": True}
    monkeypatch.setattr(dispatch, "keeps_fragments", lambda group_k, device, K: kept["on"])
    layer.cpu()
    assert layer.fweight.numel() and layer.weight._frag is not None
    made = layer.weight._frag
    fresh = Int4Linear.from_linear(lin, group_size=64).weight
    assert all(torch.equal(a, b) for a, b in zip(made, fresh.fragments()))
    assert torch.equal(layer(x), out)
    kept["on"] = False
    layer.cpu()
    assert layer.fweight.numel() == 0 and layer.weight._frag is None
    assert torch.equal(layer(x), out)


@pytest.mark.skipif(not interpreting(), reason="calls the layer on the CPU, where the interpreter runs it; on a "
                    "Hopper GPU tests/nn/test_int4_fragments_gpu.py follows the layout through real moves")
def test_the_layout_follows_the_device_under_a_mode_and_through_pickling(monkeypatch):
    # A move the layer cannot pack in (under a torch function mode: torch.device(...), set_default_device) and a
    # layer unpickled onto another kind of device (torch.load's map_location) leave no layout standing against the
    # device's rule: the next plain call makes it (or drops it), once.
    import pickle

    from tilegemm.ops.w4a16 import dispatch

    kept = {"on": False}
    monkeypatch.setattr(dispatch, "keeps_fragments", lambda group_k, device, K: kept["on"])
    lin = nn.Linear(256, 48).half()
    x = torch.randn(2, 256, dtype=torch.float16)
    layer = Int4Linear.from_linear(lin, group_size=64)
    saved = pickle.dumps(layer)
    out = layer(x)
    kept["on"] = True
    with torch.device("cpu"):  # (a function mode: no packing inside it)
        layer.cpu()
    assert layer.fweight.numel() == 0
    assert torch.equal(layer(x), out) and layer.fweight.numel() and layer.weight._frag is not None
    loaded = pickle.loads(saved)  # (pickled where no layout was kept)
    assert loaded.fweight.numel() and loaded.weight._frag is not None
    kept["on"] = False
    with torch.device("cpu"):
        layer.cpu()
    assert torch.equal(layer(x), out) and layer.fweight.numel() == 0
    assert pickle.loads(pickle.dumps(loaded)).fweight.numel() == 0  # (pickled with one, loaded where none is kept)


def test_to_empty_from_meta_packs_nothing_until_the_parts_are_loaded(monkeypatch):
    # to_empty gives the parts memory but no values: packing them then was a whole model's packing thrown away at
    # the load that follows
    from tilegemm.ops.w4a16 import dispatch, format

    monkeypatch.setattr(dispatch, "keeps_fragments", lambda group_k, device, K: device.type != "meta")
    packs = []
    real = format.pack_fragments
    monkeypatch.setattr(format, "pack_fragments", lambda *a, **k: packs.append(1) or real(*a, **k))
    state = Int4Linear.from_linear(nn.Linear(256, 48).half(), group_size=64).state_dict()
    packs.clear()
    layer = Int4Linear(256, 48, group_size=64, device="meta").to_empty(device="cpu")
    assert not packs and layer.fweight.numel() == 0
    layer.load_state_dict(state)
    assert len(packs) == 1 and layer.fweight.numel() and layer.weight._frag is not None
