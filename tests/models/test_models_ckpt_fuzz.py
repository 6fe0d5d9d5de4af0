"""A randomized sweep of checkpoint loading: combinations of architecture, format (GPTQ v1/v2, AWQ,
compressed-tensors), group size (one that leaves a partial group too), sym/asym, act-order, shards, tied
embeddings, a quantized lm_head, modules left 16-bit, GPTQModel's ``dynamic`` overrides and compressed-tensors'
config groups, the dtype asked for and the one config.json names, hidden sizes that are multiples of 32 but
not of 128, and (compressed-tensors) a quantized lm_head of 259 outputs, drawn from a fixed seed. Each case is written by the tests' own writer (ckpt_writer.py), loaded, and
compared with a plain-torch model holding the writer's dequantized weights, or, where the combination is not
supported, refused with an error naming the cause.

``TILEGEMM_CKPT_FUZZ_CASES`` (default 24) and ``TILEGEMM_CKPT_FUZZ_SEED`` (default 1) draw more or other cases."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is optional (pip install 'tilegemm[models]')")
pytest.importorskip("safetensors", reason="safetensors is optional (pip install 'tilegemm[models]')")
if getattr(pytest.importorskip("transformers.integrations.moe"), "ALL_EXPERTS_FUNCTIONS", None) is None:
    pytest.skip("this transformers has no experts interface (transformers >= 5)", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
import ckpt_writer as cw  # noqa: E402
from cpu_threads import one_cpu_thread  # noqa: E402,F401 (autouse: torch on one CPU thread)

from tilegemm.models import from_pretrained  # noqa: E402
from tilegemm.models.pretrained import dequantized_copy  # noqa: E402
from tilegemm.nn import Int4Linear, load_quantized_  # noqa: E402
from tilegemm.nn.fuse import FusedProjections, ProjectionPart  # noqa: E402
import tilegemm.nn.moe as moe  # noqa: E402
from tilegemm.ops.w4a16 import dequantize  # noqa: E402

CASES = int(os.environ.get("TILEGEMM_CKPT_FUZZ_CASES", "24"))
SEED = int(os.environ.get("TILEGEMM_CKPT_FUZZ_SEED", "1"))  # (a draw with a partial group)
IDS = torch.tensor([[3, 17, 200, 5]])
# Relative logits error against the fp32 model of the same weights: fp16 activations through two layers (7e-4 seen
# by the dense tests); a bf16 load is checked through its dequantized copy in fp32 (the interpreter's bf16 dot is
# not bf16's) against the reference's weights rounded to bf16 too (rounding alone flips a MoE router's choice: 4e-2),
# which leaves the scales' and the products' roundings (3e-3 seen); a MoE model's fp16 reference runs in fp16
TOL = {torch.float16: 4e-3, torch.bfloat16: 1e-2}
DENSE = ("llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt_neox", "olmo2")
MOE = ("qwen3_moe", "mixtral")
HEAD_DIM = ("qwen3", "gemma2", "gemma3_text", "qwen3_moe", "mixtral")  # configs whose head_dim is a setting


@dataclasses.dataclass
class Case:
    arch: str
    hidden: int
    width: int  # experts' intermediate size (MoE), else 0
    method: str  # gptq | awq | compressed-tensors
    v2: bool
    sym: bool
    act_order: bool
    group: int
    shard_bytes: int
    tie: bool
    lm_head: bool  # stored quantized
    not_convert: tuple  # Linear leaf names left 16-bit (modules_to_not_convert / ignore)
    dynamic: dict | None  # GPTQ: leaf -> overrides, or "-" for a "-:" pattern; compressed-tensors: leaf -> group
    dtype: object  # torch dtype or "auto"
    config_dtype: str | None  # config.json's dtype
    into_model: bool  # load_quantized_ into a model built by the caller
    # how the files say it: config.json's key for its dtype ("dtype" or the older "torch_dtype"); where the settings
    # are ("config": quantization_config, "old": an older quantizer's own file or compressed-tensors'
    # compression_config); a tied output layer's copy stored too (AutoGPTQ); "dynamic" keys without "+:"
    dtype_key: str = "dtype"
    settings_in: str = "config"
    store_tied: bool = False
    plain_keys: bool = False
    model_dtype: object = None  # into_model: the dtype the caller built the model in
    fuse: bool = False  # from_pretrained(..., fuse_projections=True): act-order absorbed, projections joined
    mixtral_names: bool = False  # Mixtral's experts stored as the hub has them (block_sparse_moe, w1/w3/w2)
    vocab: int = 256  # 259: an output layer whose width is not a multiple of 8


    def name(self) -> str:
        return (f"{self.arch}-h{self.hidden}-{self.method}{'-v2' if self.v2 else ''}-"
                f"{'sym' if self.sym else 'asym'}{'-act' if self.act_order else ''}-g{self.group}"
                f"{'-shards' if self.shard_bytes < 2**20 else ''}{'-tied' if self.tie else ''}"
                f"{'-qhead' if self.lm_head else ''}{'-skip' + '+'.join(self.not_convert) if self.not_convert else ''}"
                f"{'-dyn' if self.dynamic else ''}-{self.dtype if isinstance(self.dtype, str) else str(self.dtype)[6:]}"
                f"-cfg{self.config_dtype}{'-into' + str(self.model_dtype)[6:] if self.into_model else ''}"
                f"{'-' + self.dtype_key if self.dtype_key != 'dtype' else ''}"
                f"{'-oldsettings' if self.settings_in != 'config' else ''}{'-storetied' if self.store_tied else ''}"
                f"{'-fused' if self.fuse else ''}{'-hubnames' if self.mixtral_names else ''}"
                f"{'-vocab' + str(self.vocab) if self.vocab != 256 else ''}")


def _config(c: Case):
    # one decoder layer: the settings drawn apply to every layer alike, and each layer of a forward under the
    # interpreter costs as much as the first
    common = dict(vocab_size=c.vocab, hidden_size=c.hidden, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=c.tie)
    if c.arch in HEAD_DIM:
        common["head_dim"] = c.hidden // 4
    if c.arch == "qwen3_moe":
        return transformers.AutoConfig.for_model(
            c.arch, intermediate_size=2 * c.hidden, moe_intermediate_size=c.width, num_experts=3,
            num_experts_per_tok=2, decoder_sparse_step=1, **common)
    if c.arch == "mixtral":
        return transformers.AutoConfig.for_model(c.arch, intermediate_size=c.width, num_local_experts=3,
                                                 num_experts_per_tok=2, **common)
    extra = dict(pad_token_id=0) if c.arch == "phi3" else dict(sliding_window=16) if c.arch == "gemma3_text" else {}
    return transformers.AutoConfig.for_model(c.arch, intermediate_size=2 * c.hidden, **common, **extra)


def _ks(c: Case) -> set:
    """The input widths of the Linears a case quantizes."""
    return {c.hidden, 2 * c.hidden} | ({c.width} if c.width else set())


def _fits(group: int, ks) -> bool:
    return group == -1 or all(k < group or k % group == 0 for k in ks)


def _loads(group: int, ks) -> bool:
    """Whether layers of ``ks`` inputs stored in groups of ``group`` load: whole groups, or a partial last group
    whose ``gcd(K, group)`` is a group size the kernels take."""
    return all(_fits(group, [k]) or math.gcd(k, group) in (32, 64, 128, 256) for k in ks)


LEAVES = {  # Linear leaf names a case may leave 16-bit or override, by architecture (experts aside)
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
    "qwen3_moe": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mixtral": ("q_proj", "k_proj", "v_proj", "o_proj"),
}
DEFAULT_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def draw(rng: random.Random) -> Case:
    arch = rng.choice(DENSE + MOE)
    hidden = rng.choice([32, 64, 96, 128, 160])
    width = rng.choice([32, 64]) if arch in MOE else 0
    method = rng.choice(["gptq", "gptq", "awq", "compressed-tensors"])
    sym = method != "awq" and rng.random() < 0.5
    act_order = method != "awq" and rng.random() < 0.35
    ks = {hidden, 2 * hidden} | ({width} if width else set())
    fitting = [g for g in (32, 64, 128, 256, -1) if _fits(g, ks)]
    partial = [g for g in (64, 128) if not _fits(g, ks)]
    group = rng.choice(partial) if partial and rng.random() < 0.2 else rng.choice(fitting)
    leaves = LEAVES.get(arch, DEFAULT_LEAVES)
    not_convert = tuple(rng.sample(leaves, rng.choice([0, 0, 1, 2])))
    mixtral_names = arch == "mixtral" and rng.random() < 0.5
    # an override may name the experts' projections too (an expert's gate and up: one input order, as GPTQ makes)
    expert_leaves = (("w1", "w3", "w2") if mixtral_names else ("gate_proj", "up_proj", "down_proj")) \
        if arch in MOE else ()
    dynamic = None
    if method == "gptq" and rng.random() < 0.3:
        leaf = rng.choice([x for x in leaves if x not in not_convert] + list(expert_leaves))
        over = {}
        if rng.random() < 0.7:
            over["group_size"] = rng.choice([g for g in (32, 64, 128, -1) if g != group])
        if rng.random() < 0.5:
            over["sym"] = not sym
        if arch not in MOE and rng.random() < 0.3:
            over["desc_act"] = not act_order
        dynamic = {leaf: over}
        if rng.random() < 0.4:  # one more leaf left 16-bit by a "-:" pattern alone
            rest = [x for x in leaves if x not in not_convert and x != leaf]
            dynamic[rng.choice(rest)] = "-"
    elif method == "compressed-tensors" and rng.random() < 0.3:
        leaf = rng.choice([x for x in leaves if x not in not_convert] + list(expert_leaves))
        dynamic = {leaf: rng.choice([g for g in (32, 64, 128, -1) if g != group])}
    dtype = rng.choice([torch.float16] * 3 + [torch.bfloat16] * 2 + ["auto"] * 3 + [torch.float32])
    tie, lm_head, into = rng.random() < 0.4, rng.random() < 0.25, rng.random() < 0.25
    return Case(arch, hidden, width, method, method == "gptq" and rng.random() < 0.5, sym, act_order, group,
                rng.choice([2**30, 2**30, 30_000]), tie, lm_head, not_convert, dynamic,
                dtype, rng.choice(["float16", "bfloat16", "float32", None]), into,
                dtype_key=rng.choice(["dtype", "torch_dtype"]), settings_in=rng.choice(["config"] * 3 + ["old"]),
                store_tied=tie and not lm_head and rng.random() < 0.5, plain_keys=rng.random() < 0.5,
                model_dtype=rng.choice([torch.float16, torch.bfloat16, torch.float32]) if into else None,
                fuse=not into and rng.random() < 0.25, mixtral_names=mixtral_names)


def _drawn():
    rng = random.Random(SEED)
    cases = [draw(rng) for _ in range(CASES)]
    # a side draw, so that the main sequence (every other setting) stays as committed: about half the
    # compressed-tensors cases store a quantized lm_head of 259 outputs (pack-quantized takes any output width)
    side = random.Random(f"odd-vocab-{SEED}")
    for c in cases:
        if c.method == "compressed-tensors" and side.random() < 0.5:
            c.vocab, c.lm_head, c.store_tied = 259, True, False
    return cases


def _module_settings(c: Case, source):
    """The writer's per-Linear settings (a dict for group_size_of) and the config's per-module entries."""
    if not c.dynamic:
        return None, {}
    overrides = {leaf: over for leaf, over in c.dynamic.items() if over != "-"}

    def own(name):
        leaf = name.rpartition(".")[2]
        if c.method == "gptq" and leaf in overrides:
            o = overrides[leaf]
            return dict(group_size=o.get("group_size", c.group), sym=o.get("sym", c.sym),
                        act_order=o.get("desc_act", c.act_order))
        if c.method == "compressed-tensors" and leaf in overrides:
            return dict(group_size=overrides[leaf])
        return dict(group_size=c.group)

    return own, overrides


def _effective(c: Case, name: str) -> dict:
    """Group, sym and act-order a Linear ``name`` is stored with."""
    leaf = name.rpartition(".")[2]
    out = dict(group_size=c.group, sym=c.sym, act_order=c.act_order)
    if c.dynamic and leaf in c.dynamic and c.dynamic[leaf] != "-":
        o = c.dynamic[leaf]
        if c.method == "gptq":
            out.update(group_size=o.get("group_size", c.group), sym=o.get("sym", c.sym),
                       act_order=o.get("desc_act", c.act_order))
        else:
            out["group_size"] = o
    return out


def _left_16_bit(c: Case, source) -> list:
    """The Linears of ``source`` a case leaves 16-bit."""
    skipped = set(c.not_convert) | {leaf for leaf, o in (c.dynamic or {}).items() if o == "-"}
    not_convert = [n for n, m in source.named_modules() if isinstance(m, torch.nn.Linear)
                   and n.rpartition(".")[2] in skipped]
    if c.arch in MOE:  # the router: quantizers leave it 16-bit
        not_convert += [n for n, m in source.named_modules() if n.endswith(".mlp.gate")]
    return not_convert


def write(c: Case, path):
    config = _config(c)
    source = cw.random_model(config)
    not_convert = _left_16_bit(c, source)
    own, _ = _module_settings(c, source)
    quant_extra = {}
    if c.method == "gptq" and c.dynamic:
        dyn = {}
        for leaf, o in c.dynamic.items():
            if o == "-":
                dyn[rf"-:.*\.{leaf}$"] = {}
            else:
                dyn[("" if c.plain_keys else "+:") + rf".*\.{leaf}$"] = dict(o)
        quant_extra["dynamic"] = dyn
    if c.method != "compressed-tensors":
        # modules_to_not_convert names the leaves; a "-:" pattern alone says its own
        quant_extra["modules_to_not_convert"] = list(c.not_convert) + (
            [".mlp.gate"[1:]] if c.arch in MOE else []) or None
    reference = cw.write_model(path, source, c.method, c.group, c.sym, c.act_order, c.v2, c.shard_bytes,
                               not_convert=not_convert, group_size_of=own, quant_extra=quant_extra,
                               quantize_lm_head=c.lm_head, store_tied=c.store_tied, mixtral_names=c.mixtral_names)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    cfg[c.dtype_key] = c.config_dtype
    q = cfg["quantization_config"]
    if c.method == "compressed-tensors":
        q["ignore"] = ([] if c.lm_head else ["lm_head"]) + [f"re:.*[.]{leaf}$" for leaf in c.not_convert] + (
            ["re:.*[.]mlp[.]gate$"] if c.arch in MOE else [])
        if c.dynamic:
            group0 = q["config_groups"]["group_0"]
            for i, (leaf, g) in enumerate(c.dynamic.items()):
                w = dict(group0["weights"], strategy="channel" if g == -1 else "group",
                         group_size=None if g == -1 else g)
                q["config_groups"][f"group_{i + 1}"] = dict(group0, targets=[f"re:.*[.]{leaf}$"], weights=w)
    if c.settings_in == "old":  # where quantizers wrote their settings before config.json held them
        del cfg["quantization_config"]
        if c.method == "compressed-tensors":
            cfg["compression_config"] = dict(q, quant_method="sparseml")
        elif c.method == "awq":  # AutoAWQ's quant_config.json and its keys
            (path / "quant_config.json").write_text(json.dumps(dict(
                zero_point=True, q_group_size=c.group, w_bit=4, version="GEMM",
                modules_to_not_convert=q["modules_to_not_convert"])))
        else:  # AutoGPTQ's / GPTQModel's quantize_config.json
            (path / "quantize_config.json").write_text(json.dumps({k: v for k, v in q.items() if k != "quant_method"}))
    (path / "config.json").write_text(json.dumps(cfg))
    ref_config = _config(c)
    if c.lm_head and c.tie:  # a quantized output layer is its own
        ref_config.tie_word_embeddings = False
    return config, ref_config, source, reference, not_convert


def expected_refusal(c: Case, source, not_convert) -> str | None:
    """A regex of the error an unsupported case must raise, or None where it must load."""
    if c.dtype == torch.float32:
        return r"dtype must be torch\.float16, torch\.bfloat16 or 'auto'"
    quantized = cw.linear_names(source, c.lm_head, not_convert)
    for n in quantized:
        m = source.get_submodule(n)
        if c.method in ("gptq", "awq") and m.out_features % 8:  # their zeros (AWQ: and weight) packed along N
            return rf"{re.escape(n)}: \[out, in\] = \[{m.out_features}, \d+\]: out_features \d+ is not a multiple of 8"
    for n in quantized:
        m = source.get_submodule(n)
        K = m.in_features
        g = _effective(c, n)["group_size"]
        if not _loads(g, [K]):
            return rf"{re.escape(n)}: in_features {K} is not divisible by group_size {g}: its last group is partial"
    if c.width:
        names = ("w1", "w3", "w2") if c.mixtral_names else ("gate_proj", "up_proj", "down_proj")
        for leaf, K in zip(names, (c.hidden, c.hidden, c.width)):
            g = _effective(c, f"experts.0.{leaf}")["group_size"]
            if not _loads(g, [K]):
                return rf"\[out, in\] = \[\d+, {K}\]: in_features {K} is not divisible by group_size {g}"
    return None


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def run_case(c: Case, tmp_path):
    path = tmp_path / "ckpt"
    config, ref_config, source, reference, not_convert = write(c, path)
    refusal = expected_refusal(c, source, not_convert)
    if c.into_model:  # "auto" stands for none: the model's own 16-bit dtype, else fp16
        want_dtype = c.dtype if c.dtype != "auto" else c.model_dtype if c.model_dtype != torch.float32 else \
            torch.float16
    else:
        want_dtype = c.dtype if c.dtype != "auto" else (torch.bfloat16 if c.config_dtype == "bfloat16" else
                                                        torch.float16)

    def load():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing of a checkpoint that loads whole is skipped
            warnings.filterwarnings("ignore", message=".*interpreter.*")
            if c.into_model:
                model = transformers.AutoModelForCausalLM.from_config(_config(c)).to(c.model_dtype).eval()
                return load_quantized_(model, path, dtype=None if c.dtype == "auto" else c.dtype, device="cpu")
            return from_pretrained(path, dtype=c.dtype, device="cpu", fuse_projections=c.fuse)

    if refusal is not None:
        with pytest.raises((ValueError, TypeError), match=refusal):
            load()
        return "refused"
    model = load()
    # every Linear the checkpoint stores quantized is an Int4Linear computing exactly the writer's weight
    quantized = set(cw.linear_names(source, c.lm_head, not_convert))
    int4 = {n: m for n, m in model.named_modules() if isinstance(m, (Int4Linear, ProjectionPart))
            and not isinstance(m, FusedProjections)}  # (a joined product: its parts are the stored layers)
    assert set(int4) == quantized, (sorted(set(int4) ^ quantized))
    for n, m in int4.items():
        e = _effective(c, n)
        w4 = m.weight if isinstance(m, ProjectionPart) else m
        assert w4.scales.dtype == want_dtype, (n, w4.scales.dtype)
        if c.fuse:  # (act-order absorbed: rows and inputs reordered)
            continue
        got = m.dequantize().float()
        want = reference[f"{n}.weight"].float()
        if want_dtype == torch.float16:
            assert torch.equal(got, want), n
        else:  # scales and the product rounded to bf16
            assert torch.allclose(got, want, rtol=2**-7, atol=1e-6), n
        K = m.in_features
        one = e["group_size"] == -1 or K <= e["group_size"]
        # (whole groups: gcd = group_size; a partial last group: groups of the gcd)
        assert m.scales.shape[0] == (1 if one else K // math.gcd(K, e["group_size"])), (n, m.scales.shape)
        assert (m.perm is not None and m.perm.numel() == K) == (e["act_order"] and not one), n
    for n in not_convert:
        if n in dict(source.named_modules()) and isinstance(source.get_submodule(n), torch.nn.Linear):
            assert not isinstance(model.get_submodule(n), Int4Linear), n
    out = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    assert emb.weight.dtype == want_dtype
    if c.tie and not c.lm_head:
        assert out.weight is emb.weight
    if c.lm_head:
        assert isinstance(out, (Int4Linear, ProjectionPart)) and not model.config.tie_word_embeddings
    # (a MoE router's choice flips with the activations' rounding alone: its reference runs in the load's dtype)
    ref = cw.reference_model(ref_config, reference, dtype=want_dtype if want_dtype == torch.bfloat16
                             or c.arch in MOE else torch.float32)
    if want_dtype == torch.bfloat16:
        ref = ref.float()
    if c.arch in MOE:
        ref.set_experts_implementation("eager")
        blocks = [n for n, b in model.named_buffers() if n.endswith("_qweight")]
        assert len(blocks) == 2 * len(model.model.layers), blocks  # gate/up and down of every block
        for i, layer in enumerate(model.model.layers):  # the stacked experts are the writer's
            for w in ("gate_up_proj", "down_proj"):
                got = dequantize(moe._int4(layer.mlp.experts, w)).float()
                want = reference[f"model.layers.{i}.mlp.experts.{w}"].float()
                assert torch.equal(got, want) if want_dtype == torch.float16 else \
                    torch.allclose(got, want, rtol=2**-7, atol=1e-6), (i, w)
    with torch.no_grad():
        want = ref(input_ids=IDS).logits.float()
        if want_dtype == torch.float16:
            got = model(input_ids=IDS).logits.float()
        else:
            dense = dequantized_copy(model).float()
            if c.arch in MOE:
                dense.set_experts_implementation("eager")
            got = dense(input_ids=IDS).logits.float()
    err = _rel(got, want)
    assert err < TOL[want_dtype], f"logits rel. error {err:.2e}"
    return "loaded"


DRAWN = _drawn()


@pytest.mark.parametrize("case", DRAWN, ids=[f"{i}-{c.name()}" for i, c in enumerate(DRAWN)])
def test_drawn_checkpoint_loads_or_is_refused(tmp_path, case):
    run_case(case, tmp_path)


def test_the_draw_covers_both_outcomes():
    # the committed draw exercises loads and refusals, formats and architectures alike (not a sweep of one)
    if CASES < 24:
        pytest.skip("a short draw")
    methods = {c.method for c in DRAWN}
    assert methods == {"gptq", "awq", "compressed-tensors"}, methods
    assert len({c.arch for c in DRAWN}) >= 6
    assert any(c.dtype == torch.float32 for c in DRAWN) and any(c.dtype != torch.float32 for c in DRAWN)
    # a group size leaving a partial last group (its gcd with K a group size the kernels take), loaded
    refusals = []
    for c in DRAWN:
        with torch.device("meta"):
            source = transformers.AutoModelForCausalLM.from_config(_config(c))
        refusals.append(expected_refusal(c, source, _left_16_bit(c, source)))
    assert any(r is None and not _fits(c.group, _ks(c)) for c, r in zip(DRAWN, refusals))
    assert sum(r is None for r in refusals) >= len(DRAWN) // 2  # most load
