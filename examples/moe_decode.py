"""Greedy decoding of a mixture-of-experts model (transformers' Qwen3-MoE or Mixtral, random weights) with its
experts on tilegemm, in 16 bits and in 4 bits, against transformers' own grouped_mm experts.

    python examples/moe_decode.py                    # GPU: Qwen3-30B-A3B shapes, as many of its 48 layers as fit
    python examples/moe_decode.py --arch mixtral --layers 8 --batches 1 --modes compile
    python examples/moe_decode.py --tiny             # a tiny config, eager (CI: on the CPU under Triton's interpreter)

The model is built from its transformers config (``tilegemm.models.moe.build``) in bf16 (the tiny one in fp16) and
a 4-bit copy made with ``tilegemm.nn.quantize_`` (every Linear but lm_head, and the experts; g128), whose weights,
dequantized, are written back into the 16-bit model so that all three compute the same product. Three rows: the
16-bit model on ``experts_implementation="grouped_mm"`` (transformers' fastest built-in at these sizes), the same
model on ``"tilegemm"``, and the 4-bit copy (on ``"tilegemm"``). Printed for each batch and mode (the decode step
eager, replayed from a CUDA graph, or compiled by ``torch.compile`` and replayed): the prompt's prefill time and
the greedy loop's decode tokens/s, with the ratio to grouped_mm; then the agreement: every layer's experts against
grouped_mm's on the same inputs, the last position's logits, and where the greedy tokens first differ (random
weights leave near-ties in the routing and the logits, so they may part after a few steps).
``tilegemm bench --op grouped --model qwen3_moe`` (and ``--op grouped_w4a16``) times one decode step the same way.
Needs ``pip install tilegemm[models]`` (transformers >= 5, which has the experts interface).
"""

from __future__ import annotations

import argparse
import sys

import tilegemm  # first: it settles Triton's backend (compiler or interpreter) before triton is imported

import torch

from tilegemm.models import moe
from tilegemm.models.llama import Decoder, greedy


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny config, eager (no GPU: the interpreter)")
    parser.add_argument("--arch", choices=sorted(moe.ARCHS), default="qwen3_moe",
                        help="qwen3_moe: Qwen3-30B-A3B's shapes (default); mixtral: Mixtral-8x7B's")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: as many as fit; --tiny 2)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512; --tiny 8)")
    parser.add_argument("--new", type=int, default=None, help="generated tokens (default 128; --tiny 4)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16; --tiny 1,2)")
    parser.add_argument("--modes", default=None, help="eager,graph,compile (GPU default: graph,compile; CPU: eager)")
    args = parser.parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("needs transformers: pip install 'tilegemm[models]'", file=sys.stderr)
        return 2
    from tilegemm.core.runtime import interpreting

    device = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
    if device == "cpu" and not args.tiny:
        print("no CUDA GPU: use --tiny", file=sys.stderr)
        return 2
    described = {"eager": "eager PyTorch", "graph": "decode step replayed from a CUDA graph",
                 "compile": "decode step compiled by torch.compile, replayed from a CUDA graph"}
    modes = (args.modes or ("eager" if device == "cpu" else "graph,compile")).split(",")
    unknown = [m for m in modes if m not in described]
    if unknown:
        print(f"unknown mode(s) {unknown}: choose from {', '.join(described)}", file=sys.stderr)
        return 2
    if device == "cpu" and modes != ["eager"]:
        print(f"mode(s) {[m for m in modes if m != 'eager']} need a CUDA GPU: on the CPU only eager runs",
              file=sys.stderr)
        return 2
    prompt_len = args.prompt or (8 if args.tiny else 512)
    new_tokens = args.new or (4 if args.tiny else 128)
    batches = [int(b) for b in (args.batches or ("1,2" if args.tiny else "1,16")).split(",")]
    group = moe.TINY_GROUP if args.tiny else moe.GROUP
    dtype = torch.float16 if args.tiny else torch.bfloat16
    layers = args.layers if args.tiny else moe.layers_that_fit(args.arch, args.layers, int4=True)
    torch.manual_seed(0)

    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu (Triton interpreter)'}")
    try:
        model = moe.build(args.arch, tiny=args.tiny, layers=layers, device=device, dtype=dtype)
    except RuntimeError as err:  # a transformers without the experts interface
        print(err, file=sys.stderr)
        return 2
    cfg = model.config
    _, _, full, title, _ = moe.arch_of(args.arch)
    shapes = cfg.to_dict()
    print(f"model: {type(model).__name__} ({'tiny' if args.tiny else title + ' shapes'}), hidden {cfg.hidden_size}, "
          f"{moe.experts_count(shapes)} experts of {moe.expert_width(shapes)}, top {cfg.num_experts_per_tok}, "
          f"{cfg.num_hidden_layers} layers{'' if args.tiny else f' of {full}'}, random {dtype} weights")
    qmodel = moe.int4_twin(model, group)  # the 16-bit model now holds the 4-bit weights dequantized
    bytes16 = sum(p.numel() * p.element_size() for p in model.parameters())
    bytes4 = sum(t.numel() * t.element_size() for t in [*qmodel.parameters(), *qmodel.buffers()])
    print(f"weights: 16-bit {bytes16 / 2**30:.2f} GiB; 4-bit (g{group}; lm_head and embedding 16-bit, the decode "
          f"kernel's fragment layouts included) {bytes4 / 2**30:.2f} GiB")
    rows = (("grouped_mm", model, "grouped_mm"), ("tilegemm", model, "tilegemm"), ("tilegemm 4-bit", qmodel, "tilegemm"))

    print(f"greedy decode: {prompt_len}-token prompt, {new_tokens} new tokens, static KV cache; modes: "
          + ", ".join(described[m] for m in modes))
    for batch in batches:
        prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=device)
        for mode in modes:
            line, tps = [f"batch {batch:3d} {mode:7s}:"], {}
            for name, m, impl in rows:
                moe.set_experts(m, impl)  # read by every eager forward (the prefill), frozen in a graph
                dec = Decoder(m, batch, prompt_len + new_tokens, device, graph=mode == "graph",
                              compiled=mode == "compile")
                if device == "cuda":
                    dec.run(prompt, min(4, new_tokens))  # warm-up: compiles, the graph, cuBLAS handles
                pre, secs, _ = dec.run(prompt, new_tokens)
                tps[name] = batch * (new_tokens - 1) / secs
                ratio = "" if name == "grouped_mm" else f" ({tps[name] / tps['grouped_mm']:.2f}x)"
                line.append(f"{name} prefill {pre * 1e3:7.1f} ms, {tps[name]:8.1f} tok/s{ratio}")
                del dec
                if mode == "compile":
                    torch._dynamo.reset()  # each row compiles its own step: keep within dynamo's recompile limit
            print("  ".join(line), flush=True)

    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), device=device)
    use = {"ref": "grouped_mm", "model": "tilegemm"}
    err16 = moe.experts_agreement(model, model, ids, lambda m, which: moe.set_experts(m, use[which]))
    err4 = moe.experts_agreement(model, qmodel, ids, lambda m, which: moe.set_experts(m, use[which]))
    print(f"experts against grouped_mm's on the same inputs, the worst layer: 16-bit {err16:.2e}, 4-bit {err4:.2e} "
          f"(relative error)")
    with torch.no_grad():
        moe.set_experts(model, "grouped_mm")
        ref = model(input_ids=ids).logits[:, -1].float()
        _, _, t_ref = greedy(model, ids, new_tokens, device)
        for name, m, impl in rows[1:]:
            moe.set_experts(m, impl)
            logits = m(input_ids=ids).logits[:, -1].float()
            _, _, toks = greedy(m, ids, new_tokens, device)
            diff = (toks != t_ref).nonzero()
            first = int(diff[0, 1]) if len(diff) else None
            print(f"{name} vs grouped_mm: last-position logits rel. error "
                  f"{((logits - ref).norm() / ref.norm()).item():.2e}, greedy tokens "
                  + ("identical" if first is None else f"first differ at step {first}") + f" (of {new_tokens})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
