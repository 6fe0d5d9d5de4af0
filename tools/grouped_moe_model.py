"""(GPU) A transformers MoE model, random weights, on each experts implementation: forward times of a prefill and
of decode-sized batches (eager launches and CUDA graphs), tilegemm's 4-bit experts, and logits against eager.

    PYTHONPATH=src python3 tools/grouped_moe_model.py --model qwen3 --layers 4 --out out/moe-model-qwen3.json

"Decode" here is one forward of [batch, 1] tokens without a KV cache: the experts' work of a decode step (the
attention over a cache is the same for every implementation). Ratios are against the fastest of transformers'
built-in implementations that ran (batched_mm, grouped_mm; eager for reference).
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import tilegemm  # first: it settles Triton's backend before triton is imported
import tilegemm.nn.moe as moe
import torch
import transformers
import triton.testing

MODELS = {
    "qwen3": lambda layers: transformers.Qwen3MoeConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        decoder_sparse_step=1, max_position_embeddings=4096),
    "mixtral": lambda layers: transformers.MixtralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096),
}
BUILT_IN = ("batched_mm", "grouped_mm")
DEVICE = "cuda"


def set_implementation(model, impl: str) -> None:
    """``model.set_experts_implementation(impl)``, or, where this transformers lacks it, the configs' field."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(impl)
        return
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = impl


def timed(fn, graph: bool) -> float | str:
    """Median ms of ``fn()``, launched eagerly or replayed as a CUDA graph; a string where it cannot run."""
    if DEVICE == "cpu":  # --smoke: one call's wall clock, no graphs
        t = time.perf_counter()
        fn()
        return "no CUDA graphs on the CPU" if graph else (time.perf_counter() - t) * 1e3
    try:
        fn()
        torch.cuda.synchronize()
        if not graph:
            return triton.testing.do_bench(fn, warmup=50, rep=300)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            fn()
        return triton.testing.do_bench(g.replay, warmup=50, rep=300)
    except Exception as exc:  # noqa: BLE001 - an implementation that cannot run a case is reported, not fatal
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--out", default="moe-model.json")
    ap.add_argument("--smoke", action="store_true", help="a tiny config on the CPU (checks this script, times nothing)")
    args = ap.parse_args()
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
        MODELS["qwen3"] = lambda layers: transformers.Qwen3MoeConfig(
            vocab_size=32000, hidden_size=32, intermediate_size=64, moe_intermediate_size=128, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2)
        args.model, args.prefill, args.dtype = "qwen3", 8, "fp32"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    assert moe.register_experts(), "this transformers has no experts interface"
    torch.manual_seed(0)
    cfg = MODELS[args.model](args.layers)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), experts_implementation="eager")
    model = model.to(DEVICE, dtype).eval()
    cases = [("prefill", torch.randint(0, 32000, (1, args.prefill), device=DEVICE))]
    cases += [(f"decode_b{b}", torch.randint(0, 32000, (int(b), 1), device=DEVICE)) for b in args.batches.split(",")]
    rows, reference = [], {}
    impls = ["eager", *BUILT_IN, "tilegemm"]
    with torch.no_grad():
        for impl in impls + ["tilegemm_int4"]:
            if impl == "tilegemm_int4":
                done = tilegemm.nn.quantize_experts_(model, group_size=128)
                print(f"4-bit experts in {len(done)} blocks")
                if not done:
                    break
            else:
                set_implementation(model, impl)
            for name, ids in cases:
                fwd = lambda: model(ids).logits  # noqa: E731
                try:
                    logits = fwd().float()
                except Exception as exc:  # noqa: BLE001
                    rows.append(dict(impl=impl, case=name, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                    continue
                if impl == "eager":
                    reference[name] = logits
                err = ((logits - reference[name]).norm() / reference[name].norm()).item() if name in reference else None
                row = dict(impl=impl, case=name, rel_err_vs_eager=err, ms=timed(fwd, False),
                           ms_graph=timed(fwd, True) if name != "prefill" else None)
                rows.append(row)
                print(json.dumps(row))
    # ratios against the fastest built-in implementation, per case and timing
    for key in ("ms", "ms_graph"):
        for name, _ in cases:
            best = [r[key] for r in rows
                    if r["case"] == name and r["impl"] in BUILT_IN and isinstance(r.get(key), float)]
            for r in rows:
                if r["case"] == name and best and isinstance(r.get(key), float):
                    r[f"ratio_{key}"] = min(best) / r[key]
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else None
    meta = dict(model=args.model, layers=args.layers, dtype=args.dtype, gpu=gpu,
                torch=torch.__version__, transformers=transformers.__version__, time=time.strftime("%FT%T"))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    for r in rows:
        print(f"{r['impl']:>14} {r['case']:>12}  ms {r.get('ms')!s:>22.22}  graph {r.get('ms_graph')!s:>22.22}  "
              f"x{r.get('ratio_ms', 0):.2f} / x{r.get('ratio_ms_graph', 0) or 0:.2f}  "
              f"err {r.get('rel_err_vs_eager')}")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
