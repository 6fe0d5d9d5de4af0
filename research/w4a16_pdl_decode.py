"""Does programmatic dependent launch (PDL) pay end to end, with Inductor's kernels launched that way too (GPU)?

``frag_wgmma`` up to ``configs.FRAG_WGMMA_PDL_MAX_M`` rows is launched as a dependent (``PDL``: its first weight
words and scales copied before ``griddepcontrol.wait``); act-order's gather lets it in at once. Inductor can
launch its own Triton kernels the same way (``torch._inductor.config.triton.enable_pdl``): each waits for the
kernel ahead before its first dependent load and lets the next one in after its loads. Between two products of a
compiled decode step there are only Inductor's kernels (norms, rotary, SiLU x up), attention and the cache
writes, so with both on a product's weight stream may start under the tail of the kernel ahead.

    PYTHONPATH=src:research python3 research/w4a16_pdl_decode.py --out $OUT/pdl-decode.json [--layers 8]

1. ``decode``: Llama-3-8B's shapes (``--layers`` decoder layers), the compiled decode step at position 512 replayed
   from a CUDA graph, fp16 and int4 (g128, every Linear but lm_head), at batch 1 and 16; Inductor's PDL off / on;
   tilegemm's PDL 0 (off) / 1 (next kernel let in at the start) / 2 (after the K loop). The int4 logits are
   compared bit for bit across tilegemm's modes, and each against the fp16 model's.
2. ``products``: act-order and natural-order weights (5120 x 5120, 4096 x 11008) at M = 1, 4, 16, 32, eight
   distinct weights back to back with an elementwise op between, as CUDA graphs, tilegemm's PDL 0 / 2; the
   outputs compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from tilegemm import w4a16
from tilegemm.core import replay
from tilegemm.ops.w4a16 import configs


def set_pdl(mode: int) -> None:
    configs.FRAG_WGMMA_PDL = mode
    configs.FRAG_WGMMA_PDL_CALLS = "all"
    replay.clear()


def time_graph(g: torch.cuda.CUDAGraph, replays: int, rounds: int) -> float:
    """ms a replay, median of ``rounds``."""
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / replays)
    return statistics.median(times)


def decode(args, report) -> None:
    from tilegemm.models import llama

    torch.manual_seed(0)
    fp16 = llama.build(layers=args.layers, device="cuda")
    int4 = llama.quantized_copy(fp16, llama.LLAMA3_8B_GROUP)
    llama.dequantized_copy_into(fp16, int4)
    P = 512
    report["inductor_has_pdl"] = hasattr(torch._inductor.config.triton, "enable_pdl")
    for batch in args.batches:
        prompt = torch.randint(0, fp16.config.vocab_size, (batch, P), generator=torch.Generator().manual_seed(0)).cuda()
        for ind in (False, True) if report["inductor_has_pdl"] and args.inductor_pdl else (False,):
            torch._dynamo.reset()
            with torch._inductor.config.patch({"triton.enable_pdl": ind}):
                row = dict(batch=batch, inductor_pdl=ind, layers=args.layers)
                ref = llama.Decoder(fp16, batch, P + 1, "cuda", graph=True, compiled=True, repeat=True)
                ref.prefill(prompt)
                set_pdl(0)
                ref.capture()
                row["fp16_ms"] = time_graph(ref.cuda_graph, args.replays, args.rounds)
                want = ref.next_logits().float().clone()
                row["fp16_equal_replays"] = torch.equal(ref.next_logits().float(), want)  # is the fp16 step repeatable?
                dec = llama.Decoder(int4, batch, P + 1, "cuda", graph=True, compiled=True, repeat=True)
                dec.prefill(prompt)
                dec.ids.copy_(ref.ids)
                outs = []
                for i, mode in enumerate(args.modes):
                    set_pdl(mode)
                    dec.capture()
                    row[f"int4_pdl{mode}_ms" + ("" if i == args.modes.index(mode) else f"_{i}")] = \
                        time_graph(dec.cuda_graph, args.replays, args.rounds)
                    outs.append((mode, dec.next_logits().float().clone()))
                    outs.append((mode, dec.next_logits().float().clone()))  # a second replay of the same graph
                row["int4_equal"] = [[m, torch.equal(outs[0][1], o)] for m, o in outs]
                row["int4_equal_across_modes"] = all(e for _, e in row["int4_equal"])
                row["int4_vs_fp16_rel"] = ((outs[0][1] - want).norm() / want.norm()).item()
                for mode in dict.fromkeys(args.modes):
                    row[f"ratio_pdl{mode}"] = row["fp16_ms"] / row[f"int4_pdl{mode}_ms"]
                del ref, dec
                torch.cuda.empty_cache()
            report["decode"].append(row)
            print(json.dumps(row), flush=True)
    set_pdl(2)


def products(args, report) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    for N, K in ((5120, 5120), (4096, 11008)):
        for act in (False, True):
            ws = []
            for i in range(8):
                w = torch.randn(N, K, device="cuda", dtype=torch.float16, generator=gen) * K ** -0.5
                q = w4a16.quantize(w, group_size=128)
                if act:  # a random act-order: the same weight with its inputs in a random order
                    perm = torch.randperm(K, device="cuda", generator=gen)
                    q = w4a16.quantize(w[:, perm], group_size=128)
                    q = w4a16.Int4Weight(q.qweight, q.scales, q.zeros, q.group_size, q.shape, perm=perm)
                ws.append(q)
            for M in (1, 4, 16, 32):
                x = torch.randn(M, K, device="cuda", dtype=torch.float16, generator=gen)
                row = dict(N=N, K=K, M=M, act_order=act)
                outs = {}
                for mode in (0, 2):
                    set_pdl(mode)

                    def run():
                        acc = None
                        for w in ws:
                            y = w4a16.matmul(x * 0.5, w)
                            acc = y if acc is None else acc + y
                        run.out = acc
                    for _ in range(2):
                        run()
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        run()
                    row[f"pdl{mode}_us"] = 1e3 * time_graph(g, args.replays, args.rounds) / len(ws)
                    g.replay()
                    torch.cuda.synchronize()
                    outs[mode] = run.out.clone()
                row["equal"] = torch.equal(outs[0], outs[2])
                row["gain"] = row["pdl0_us"] / row["pdl2_us"]
                report["products"].append(row)
                print(json.dumps(row), flush=True)
    set_pdl(2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parts", default="products,decode")
    ap.add_argument("--batches", default="1,16", type=lambda s: [int(b) for b in s.split(",")])
    ap.add_argument("--modes", default="0,1,2", type=lambda s: [int(m) for m in s.split(",")],
                    help="tilegemm's PDL modes, in order (a mode twice: is the step the same again?)")
    ap.add_argument("--no-inductor-pdl", dest="inductor_pdl", action="store_false")
    args = ap.parse_args()
    report = dict(commit=os.environ.get("TILEGEMM_GIT_COMMIT", ""), device=torch.cuda.get_device_name(),
                  decode=[], products=[])
    try:
        for part in args.parts.split(","):
            {"decode": decode, "products": products}[part](args, report)
    finally:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    ok = all(r["equal"] for r in report["products"]) and all(r["int4_equal_across_modes"] for r in report["decode"])
    print("checks", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
