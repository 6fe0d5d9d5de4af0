"""Greedy decoding of a Llama-architecture model with 4-bit weights (``tilegemm.nn.quantize_``), random weights.

    python examples/llama_decode.py                  # GPU: Llama-3-8B shapes, as many layers as fit (<= 32)
    python examples/llama_decode.py --arch qwen2     # GPU: Qwen2-7B shapes (a second architecture)
    python examples/llama_decode.py --layers 8 --prompt 512 --new 128 --batches 1,16
    python examples/llama_decode.py --tiny           # a tiny config, eager (CI: on the CPU under Triton's interpreter)
    python examples/llama_decode.py --checkpoint DIR # a 4-bit GPTQ/AWQ checkpoint directory (from_pretrained)
    python examples/llama_decode.py --fuse           # q/k/v and gate/up joined (absorb_act_order_, fuse_projections_)

Builds ``transformers.LlamaForCausalLM`` from a ``LlamaConfig`` (hidden 4096, intermediate 14336, 32 heads, 8 KV
heads, vocab 128256), in fp16 with random weights; a copy gets ``tilegemm.nn.quantize_`` (g128, every Linear
but lm_head). Prints, for batch 1 and 16: prefill time of the prompt and decode tokens/s of the greedy loop
(a static KV cache; the decode step run eagerly, replayed from a CUDA graph, or compiled by ``torch.compile`` and
replayed from a CUDA graph, ``--modes``) for the fp16 model
and the int4 one, and their ratio; then the logits' agreement of the int4 model with the same model dequantized to fp16 (relative error of the
last position's logits, share of positions whose argmax agrees, and the step where the greedy tokens first
differ). Needs ``pip install tilegemm[models]`` (transformers). The model and the decoder are
``tilegemm.models.llama``'s; ``tilegemm bench --op w4a16 --model llama`` times one decode step of the same pair.

``--checkpoint DIR`` loads the int4 model from a quantized checkpoint directory instead
(``tilegemm.models.from_pretrained``; any architecture transformers knows) and compares it with the same model in
fp16 holding its dequantized weights (``tilegemm.models.pretrained.dequantized_copy``).
``tools/write_w4_checkpoint.py`` writes a random one at Llama-3-8B's shapes.
"""

from __future__ import annotations

import argparse
import sys

import tilegemm  # first: it settles Triton's backend (compiler or interpreter) before triton is imported

import torch

from tilegemm.models.llama import (ARCHS, Decoder, agreement, build, dequantized_copy_into, greedy, layers_that_fit,
                                   quantized_copy)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help="tiny config, eager unless --modes (no GPU: the interpreter), no timing claims")
    parser.add_argument("--arch", choices=("llama", "qwen2"), default="llama",
                        help="llama: Llama-3-8B's shapes (default); qwen2: Qwen2-7B's, from transformers' Qwen2Config")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: as many as fit)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512; --tiny 8)")
    parser.add_argument("--new", type=int, default=None, help="generated tokens (default 128; --tiny 4)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16; --tiny 1,2)")
    parser.add_argument("--group-size", type=int, default=None, help="quantization group (default 128; --tiny 32)")
    parser.add_argument("--modes", default=None,
                        help="eager,graph,compile (GPU default: all three; the CPU: eager)")
    parser.add_argument("--checkpoint", metavar="DIR", default=None,
                        help="load the int4 model from this GPTQ/AWQ checkpoint directory (from_pretrained)")
    parser.add_argument("--fuse", action="store_true",
                        help="join the int4 model's q/k/v and gate/up projections (tilegemm.nn.absorb_act_order_, "
                             "fuse_projections_)")
    args = parser.parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("needs transformers: pip install 'tilegemm[models]'", file=sys.stderr)
        return 2
    from tilegemm.core.runtime import interpreting

    # tilegemm's kernels run where it compiles them: the GPU when there is one, else Triton's interpreter on the CPU
    device = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
    if device == "cpu" and not args.tiny:
        print("no CUDA GPU: use --tiny", file=sys.stderr)
        return 2
    prompt_len = args.prompt or (8 if args.tiny else 512)
    new_tokens = args.new or (4 if args.tiny else 128)
    batches = [int(b) for b in (args.batches or ("1,2" if args.tiny else "1,16")).split(",")]
    group = args.group_size or (32 if args.tiny else 128)
    if device == "cuda" and not args.checkpoint and not args.tiny:
        args.layers = layers_that_fit(args.layers, args.arch)
    torch.manual_seed(0)

    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu (Triton interpreter)'}")
    if args.checkpoint:
        from tilegemm.models import from_pretrained
        from tilegemm.models.pretrained import dequantized_copy

        try:
            qmodel = from_pretrained(args.checkpoint, device=device)
        except (OSError, TypeError, ValueError) as err:
            print(f"--checkpoint: {err}", file=sys.stderr)
            return 2
        model = dequantized_copy(qmodel)  # the fp16 model of the same weights; the rest shared, not copied
        cfg = model.config
        print(f"model: {', '.join(cfg.architectures or [cfg.model_type])} from {args.checkpoint} "
              f"({qmodel.config.quantization_config.get('converted_from')}), hidden {cfg.hidden_size}, intermediate "
              f"{cfg.intermediate_size}, heads {cfg.num_attention_heads}/{cfg.num_key_value_heads} KV, vocab "
              f"{cfg.vocab_size}, {cfg.num_hidden_layers} layers; fp16: its int4 weights dequantized")
        group = qmodel.config.quantization_config.get("group_size")
    else:
        model = build(tiny=args.tiny, layers=args.layers, device=device, arch=args.arch)
        cfg = model.config
        full = ARCHS[args.arch][2]
        print(f"model: {type(model).__name__}, hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, heads "
              f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} KV, vocab {cfg.vocab_size}, "
              f"{cfg.num_hidden_layers} layers"
              f"{'' if args.tiny or cfg.num_hidden_layers == full else f' (of {full}: what fits)'}, random fp16 weights")
        qmodel = quantized_copy(model, group)
    from tilegemm.nn import Int4Linear, absorb_act_order_, fuse_projections_

    n_int4 = sum(isinstance(m, Int4Linear) for m in qmodel.modules())
    if args.fuse:
        fuse_projections_(absorb_act_order_(qmodel))
        print(f"fuse_projections_: {len(qmodel.tilegemm_fused)} groups joined (q/k/v, gate/up)")
    fp16_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # shared tensors counted once
    int4_bytes = sum(t.numel() * t.element_size() for t in list(qmodel.parameters()) + list(qmodel.buffers()))
    print(f"weights: fp16 {fp16_bytes / 2**30:.2f} GiB, int4 ({n_int4} Linears, g{group}; lm_head, embedding fp16) "
          f"{int4_bytes / 2**30:.2f} GiB")

    described = {"eager": "eager PyTorch", "graph": "decode step replayed from a CUDA graph",
                 "compile": "decode step compiled by torch.compile, replayed from a CUDA graph"}
    modes = ["eager"] if device == "cpu" or args.tiny else ["eager", "graph", "compile"]
    if args.modes:
        modes = args.modes.split(",")
    unknown = [m for m in modes if m not in described]
    if unknown:
        print(f"unknown mode(s) {unknown}: choose from {', '.join(described)}", file=sys.stderr)
        return 2
    if device == "cpu" and modes != ["eager"]:
        print(f"mode(s) {[m for m in modes if m != 'eager']} need a CUDA GPU: on the CPU only eager runs",
              file=sys.stderr)
        return 2
    print(f"greedy decode: {prompt_len}-token prompt, {new_tokens} new tokens, static KV cache; modes: "
          + ", ".join(described[m] for m in modes))
    results = []
    for batch in batches:
        prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=device)
        for mode in modes:
            line = [f"batch {batch:3d} {mode:7s}:"]
            tps = {}
            for name, m in (("fp16", model), ("int4", qmodel)):
                dec = Decoder(m, batch, prompt_len + new_tokens, device, graph=mode == "graph",
                              compiled=mode == "compile")
                if device == "cuda":
                    # warm-up (compiles, replays recorded, cuBLAS handles, the graph) within the cache it was made for
                    dec.run(prompt, min(4, new_tokens))
                pre, secs, _ = dec.run(prompt, new_tokens)
                tps[name] = batch * (new_tokens - 1) / secs
                line.append(f"{name} prefill {pre * 1e3:8.1f} ms, decode {tps[name]:9.1f} tok/s")
                del dec
                if mode == "compile":
                    torch._dynamo.reset()  # each row compiles its own step: keep within dynamo's recompile limit
            line.append(f"int4/fp16 {tps['int4'] / tps['fp16']:.2f}x")
            results.append(dict(batch=batch, mode=mode, **{f"{k}_tok_s": v for k, v in tps.items()}))
            print("  ".join(line), flush=True)

    # Agreement with the same weights dequantized to fp16 (the fp16 model's Linears overwritten in place; a
    # checkpoint's fp16 model holds them already).
    if not args.checkpoint:
        dequantized_copy_into(model, qmodel)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), device=device)
    agree = agreement(qmodel, model, prompt)
    _, _, t_q = greedy(qmodel, prompt, new_tokens, device)
    _, _, t_r = greedy(model, prompt, new_tokens, device)
    diff = (t_q != t_r).nonzero()
    first = int(diff[0, 1]) if len(diff) else None
    print(f"int4 vs fp16-dequantized: last-position logits rel. error {agree['rel_err_last']:.2e}, argmax agrees "
          f"at {agree['argmax_agree'] * 100:.1f}% of prompt positions, greedy tokens "
          + ("identical" if first is None else f"first differ at step {first}") + f" (of {new_tokens})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
