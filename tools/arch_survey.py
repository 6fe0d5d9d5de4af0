"""Every architecture AutoModelForCausalLM knows, loaded from a tiny 4-bit checkpoint (CPU, no GPU needed).

For each model type of transformers' causal-LM mapping: a tiny config (the type's defaults with small sizes where
the config has such fields), random fp32 weights, a GPTQ or AWQ checkpoint written by the tests' own writer
(``tests/models/ckpt_writer.py``, independent of tilegemm's packers), ``tilegemm.models.from_pretrained`` on it,
and the logits compared with the plain model of the dequantized weights. A line a type: ``ok``, ``build``
(transformers could not build or run the tiny model: not ours), ``load`` (tilegemm refused or failed: the error),
``logits`` (loaded but wrong). Run with TILEGEMM_INTERPRET=1 TRITON_INTERPRET=1 on a CPU machine:

    python3 tools/arch_survey.py [--types llama,gpt2] [--method gptq|awq|compressed-tensors|mixed] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
import ckpt_writer as cw  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
             moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
             shared_expert_intermediate_size=64, n_layer=2, n_head=4, n_embd=64, d_model=64, n_positions=128,
             num_layers=2, num_heads=4, ffn_dim=128, d_ff=128, n_inner=128, kv_lora_rank=32, q_lora_rank=32,
             qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1,
             first_k_dense_replace=1, sliding_window=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             rotary_dim=16, partial_rotary_factor=0.5, decoder_start_token_id=0, decoder_layers=2, encoder_layers=2,
             decoder_ffn_dim=128, encoder_ffn_dim=128, decoder_attention_heads=4, encoder_attention_heads=4)
# tried in turn where transformers cannot build or run the tiny model of the one before (MLA attention wants as
# many key/value heads as query heads; some types derive head_dim themselves)
RETRY = (("num_key_value_heads", "head_dim"), ("num_key_value_heads", "head_dim", "sliding_window", "rotary_dim",
                                                "partial_rotary_factor", "first_k_dense_replace"))
MAX_PARAMS = 20_000_000
IDS = torch.tensor([[3, 17, 100, 5, 96, 42]])


def tiny_config(model_type: str, without=()):
    import transformers

    cls = transformers.models.auto.configuration_auto.CONFIG_MAPPING[model_type]
    known = cls().to_dict()
    aliases = getattr(cls, "attribute_map", {}) or {}
    kw = {}
    for k, v in SMALL.items():
        if k in without:
            continue
        name = k if k in known else aliases.get(k)
        if name in known and not isinstance(known[name], dict):
            kw[name] = v
    for name, sub in known.items():  # sub-configs (text_config, vision_config, ...): their sizes made small too
        if isinstance(sub, dict) and name.endswith("_config") and "model_type" in sub:
            kw[name] = _per_layer({**sub, **{k: v for k, v in SMALL.items() if k in sub and k not in without
                                             and not isinstance(sub[k], dict)}})
    return cls(**_per_layer({**known, **kw}, only=kw))


def _per_layer(values: dict, only=None) -> dict:
    """Per-layer lists (layer_types, mlp_layer_types, ...) cut to the layer count set; ``only``: the keys given
    (the rest left to the config's defaults), plus the lists cut."""
    layers = values.get("num_hidden_layers")
    out = dict(values if only is None else only)
    for k, v in values.items():
        if isinstance(layers, int) and k.endswith("layer_types") and isinstance(v, list) and len(v) > layers:
            kinds = list(dict.fromkeys(v))  # each kind once where the layers allow: a hybrid model keeps both
            out[k] = (kinds + v)[:layers] if len(kinds) <= layers else v[:layers]
    return out


@contextlib.contextmanager
def _topk_recorded():
    """The indices of every ``torch.topk`` the block runs (routers' expert choices), in call order."""
    picked, plain, method = [], torch.topk, torch.Tensor.topk

    def record(fn):
        def topk(*args, **kw):
            out = fn(*args, **kw)
            picked.append(out[1].detach().cpu())
            return out
        return topk

    torch.topk, torch.Tensor.topk = record(plain), record(method)
    try:
        yield picked
    finally:
        torch.topk, torch.Tensor.topk = plain, method


def _flipped(got: list, want: list) -> bool:
    """Whether two runs' top-k choices differ, call for call (runs that call top-k differently often, as
    tilegemm's Llama-4 block does, are not compared)."""
    return len(got) == len(want) and any(a.shape != b.shape or not torch.equal(a.sort(-1).values, b.sort(-1).values)
                                         for a, b in zip(got, want))


def _against(source, make, key: str) -> dict:
    """The model ``make()`` builds from ``source`` (tilegemm's 16-bit kernels; fp32 here, exact under the
    interpreter) against ``source`` on the same input, under ``key``: "ok", "logits", "routing" (a router's
    near-tie decided the other way), "none" (nothing of tilegemm's in it) or the error."""
    try:
        model = make()
        swapped = sum(type(m).__module__.startswith("tilegemm") for m in model.modules())
        with torch.no_grad(), _topk_recorded() as a:
            got = model.eval()(input_ids=IDS, use_cache=False).logits
        with torch.no_grad(), _topk_recorded() as b:
            want = source(input_ids=IDS, use_cache=False).logits
    except Exception as e:  # noqa: BLE001
        return {key: f"error {type(e).__name__}: {str(e)[:300]}"}
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    status = "routing" if _flipped(a, b) else ("ok" if err < 1e-4 else "logits")
    return {key: status, f"{key}_err": err, f"{key}_modules": swapped}


def _experts_16_bit(config, source) -> dict:
    """Where the model has experts on transformers' interface: the same weights built with
    ``experts_implementation="tilegemm"`` (the 16-bit grouped kernels) against the eager experts."""
    import transformers
    import tilegemm.nn.moe as moe

    if not moe.register_experts() or not any(t for _, _, t in moe._stacked_experts(source)):
        return {}

    def make():
        model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="tilegemm").float()
        model.load_state_dict(source.state_dict())
        return model

    return _against(source, make, "experts16")


def _converted(source) -> dict:
    """``tilegemm.nn.convert_`` (every Linear and Conv2d it takes on tilegemm's 16-bit kernels) against the model
    as built."""
    import copy

    import tilegemm.nn

    row = _against(source, lambda: tilegemm.nn.convert_(copy.deepcopy(source), warn=False), "convert16")
    if row.get("convert16_modules") == 0:
        row["convert16"] = "none"
    return row


def survey(model_type: str, method: str, group_size: int, tmp: Path) -> dict:
    from tilegemm.models import from_pretrained
    from tilegemm.nn.convert import is_plain_linear

    row = dict(type=model_type, method=method)
    for without in ((),) + RETRY:
        try:
            config = tiny_config(model_type, without)
            with torch.device("meta"):  # sub-configs left at their full sizes (Blt's) would fill the memory
                import transformers

                params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
            if params > MAX_PARAMS:
                raise ValueError(f"{params / 1e6:.0f}M parameters with the small sizes this survey sets")
            source = cw.random_model(config)
            with torch.no_grad():
                source(input_ids=IDS, use_cache=False)
            names = cw.linear_names(source)
            break
        except Exception as e:  # noqa: BLE001 - transformers' own limits on a tiny config
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    else:
        return {**row, "status": "build", "error": error}
    if not names:
        return {**row, "status": "build", "error": "no Linear to quantize"}
    row.update(_experts_16_bit(config, source))
    row.update(_converted(source))
    path = tmp / model_type
    try:
        # GPTQ and AWQ pack zero points along the outputs: quantizers leave a Linear of N % 8 (a router) 16-bit
        # and quantizers leave alone Linears of a class of their own (routers), inputs not a multiple of 8 or of the
        # group (Mamba's dt_proj)
        keep = [n for n, m in source.named_modules() if isinstance(m, torch.nn.Linear) and n in names and (
            (m.out_features % 8 and method != "compressed-tensors") or not is_plain_linear(m)
            or m.in_features % 8 or (m.in_features > group_size and m.in_features % group_size))]
        reference = cw.write_model(path, source, method=method, group_size=group_size, sym=False, not_convert=keep)
        ref = cw.reference_model(config, reference)
    except Exception as e:  # noqa: BLE001 - the writer's own limits (say which)
        return {**row, "status": "writer", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    try:
        model = from_pretrained(path, dtype=torch.float16, device="cpu")
        with torch.no_grad(), _topk_recorded() as picked_got:
            got = model(input_ids=IDS, use_cache=False).logits.float()
        with torch.no_grad(), _topk_recorded() as picked_want:
            want = ref(input_ids=IDS, use_cache=False).logits.float()
    except Exception as e:  # noqa: BLE001
        tb = traceback.format_exc().splitlines()
        return {**row, "status": "load", "error": f"{type(e).__name__}: {str(e)[:600]}", "where": tb[-3:]}
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    from tilegemm.nn import Int4Linear

    int4 = sum(isinstance(m, Int4Linear) for m in model.modules())
    stacked = sum(1 for n, _ in model.named_buffers() if n.endswith("_qweight"))
    floor = None
    if err >= 5e-3:  # the plain model of the same weights in fp16: how far fp16 alone takes this architecture
        try:
            with torch.no_grad():
                half = cw.reference_model(config, reference, dtype=torch.float16)(input_ids=IDS, use_cache=False)
            floor = float((half.logits.float() - want).norm() / want.norm().clamp_min(1e-30))
        except Exception:  # noqa: BLE001 - an op with no fp16 CPU kernel: no floor
            pass
    if _flipped(picked_got, picked_want):
        # a router's near-tie decided the other way by 4-bit rounding (real, not a fault): the logits then differ
        return {**row, "status": "routing", "rel_err": err, "note": "a top-k router chose other experts"}
    ok = (err < 5e-3 or (floor is not None and err < 2 * floor + 5e-3)) and (int4 or stacked)
    return {**row, "status": "ok" if ok else "logits", "rel_err": err, "fp16_floor": floor, "int4_linears": int4,
            "stacked_experts": stacked, "linears": len(names)}


def _too_long(*_):
    raise TimeoutError


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="", help="comma-separated model types (default: every causal-LM type)")
    p.add_argument("--start", default="", help="begin at this model type (the types sorted by name)")
    p.add_argument("--method", default="mixed", choices=["gptq", "awq", "compressed-tensors", "mixed"])
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--json", default="")
    p.add_argument("--timeout", type=int, default=180, help="seconds a type (Mamba's reference scans are slow)")
    args = p.parse_args()
    import transformers

    types = [t for t in args.types.split(",") if t] or sorted(
        transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    types = [t for t in types if t >= args.start]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for i, t in enumerate(types):
            method = args.method if args.method != "mixed" else ("gptq", "awq", "compressed-tensors")[i % 3]
            start = time.time()
            signal.signal(signal.SIGALRM, _too_long)
            signal.alarm(args.timeout)
            try:
                row = survey(t, method, args.group_size, Path(d))
            except TimeoutError:
                row = dict(type=t, method=method, status="timeout", error=f"over {args.timeout} s")
            finally:
                signal.alarm(0)
            row["seconds"] = round(time.time() - start, 1)
            rows.append(row)
            x16 = f" experts16={row['experts16']}" if "experts16" in row else ""
            x16 += f" convert16={row['convert16']}" if "convert16" in row else ""
            print(f"{t:28s} {method:5s} {row['status']:7s} {row.get('rel_err', ''):<10.3g} "
                  f"{row.get('error', '')[:160]}{x16}" if "rel_err" in row else
                  f"{t:28s} {method:5s} {row['status']:7s} {row.get('error', '')[:160]}{x16}", flush=True)
    counts = {s: sum(r["status"] == s for r in rows)
              for s in ("ok", "routing", "build", "writer", "load", "logits", "timeout")}
    print("summary:", counts)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(transformers=transformers.__version__, rows=rows), indent=1))


if __name__ == "__main__":
    main()
