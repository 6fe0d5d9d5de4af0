"""Write a 4-bit checkpoint directory with random weights at Llama-3-8B's shapes (or a tiny config), with the tests'
checkpoint writer (tests/models/ckpt_writer.py, independent of tilegemm's packers), for loading with
``tilegemm.models.from_pretrained`` on the GPU.

    python tools/write_w4_checkpoint.py --out /tmp/llama3-8b-gptq                 # GPTQ v1, g128, symmetric, 32 layers
    python tools/write_w4_checkpoint.py --out DIR --layers 8 --act-order --v2     # act-order, format v2
    python tools/write_w4_checkpoint.py --out DIR --method awq                    # AWQ (gemm)
    python tools/write_w4_checkpoint.py --out DIR --method compressed-tensors     # llm-compressor W4A16
    python tools/write_w4_checkpoint.py --out DIR --tiny                          # a tiny Llama (seconds, any machine)
    python tools/write_w4_checkpoint.py --out DIR --arch qwen2                    # Qwen2-7B's shapes (q/k/v biases)

Then: ``tilegemm bench --op w4a16 --model llama --checkpoint DIR`` or
``python examples/llama_decode.py --checkpoint DIR``. The quantized values, scales and zeros are drawn directly (no
float weight is quantized), on the GPU where there is one (``--device``); 32 layers are about 5.7 GB on disk
(shards of ``--shard-gb``). Embeddings and lm_head: fp16 normal(0, 0.02); norms: ones.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models"))

import ckpt_writer as cw  # noqa: E402


# Qwen2-7B's shapes (its q, k and v projections have biases).
QWEN2_7B = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=False)
QWEN2_7B_LAYERS = 28
# The projections that read one input: with act-order they share one order, as GPTQ writes them.
SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the checkpoint directory to write (created)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --tiny 2)")
    p.add_argument("--tiny", action="store_true", help="tilegemm.models.llama's tiny config instead of Llama-3-8B's")
    p.add_argument("--arch", choices=("llama", "qwen2"), default="llama",
                   help="llama: Llama-3-8B's shapes (default); qwen2: Qwen2-7B's (28 layers)")
    p.add_argument("--method", choices=("gptq", "awq", "compressed-tensors"), default="gptq")
    p.add_argument("--group-size", type=int, default=None, help="default 128 (--tiny 32)")
    p.add_argument("--asym", action="store_true", help="asymmetric zeros (default symmetric, zero 8; AWQ: always)")
    p.add_argument("--act-order", action="store_true", help="GPTQ desc_act: g_idx a random permutation of groups")
    p.add_argument("--v2", action="store_true", help="GPTQ checkpoint_format gptq_v2 (zeros stored without - 1)")
    p.add_argument("--shard-gb", type=float, default=4.0, help="shard size (default 4 GB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="where the random values are drawn and packed (default: cuda if "
                                                  "there is one; the files are the same size either way)")
    args = p.parse_args(argv)
    if os.path.exists(args.out) and os.listdir(args.out):
        print(f"{args.out} exists and is not empty", file=sys.stderr)
        return 2

    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from tilegemm.models import llama

    if args.arch == "qwen2":
        shapes, full, cls = QWEN2_7B, QWEN2_7B_LAYERS, Qwen2Config
    else:
        shapes, full, cls = llama.LLAMA3_8B, llama.LLAMA3_8B_LAYERS, LlamaConfig
    if args.tiny:
        shapes, full = llama.TINY, llama.TINY_LAYERS
    layers = args.layers or full
    group = args.group_size or (llama.TINY_GROUP if args.tiny else 128)
    sym = not args.asym and args.method != "awq"
    config = cls(**shapes, num_hidden_layers=layers, torch_dtype="float16")
    with torch.device("meta"):  # names and shapes only
        meta = AutoModelForCausalLM.from_config(config)
    quantized = set(cw.linear_names(meta))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    writer = cw.Writer(args.out, int(args.shard_gb * 2**30))
    orders = {}  # act-order: q/k/v and gate/up read one input each, and GPTQ's order follows the input: one order
    t0 = time.time()
    for name, param in meta.named_parameters():
        module, _, leaf = name.rpartition(".")
        if module in quantized and leaf == "weight":
            N, K = param.shape
            parent, _, leaf_module = module.rpartition(".")
            shared = SHARED_INPUT.get(leaf_module, leaf_module)
            order = orders.setdefault((parent, shared), torch.randperm(K, generator=gen, device=device)) \
                if args.act_order else None
            for part, t in cw.random_linear(N, K, args.method, group, sym, args.act_order, args.v2, gen,
                                            order=order).items():
                writer.add(f"{module}.{part}", t.cpu())
        elif name.endswith("norm.weight"):
            writer.add(name, torch.ones(param.shape, dtype=torch.float16))
        else:
            writer.add(name, (torch.randn(param.shape, generator=gen, device=device) * 0.02).half().cpu())
        if name.endswith("input_layernorm.weight") or name == "lm_head.weight":  # a layer done
            print(f"{time.time() - t0:6.0f} s  {name.rpartition('.input_layernorm')[0] or name}", flush=True)
    cfg = config.to_dict()
    cfg["architectures"] = [type(meta).__name__]  # as save_pretrained writes it
    cfg["quantization_config"] = cw.quantization_config(args.method, group, sym, args.act_order, args.v2)
    writer.close(cfg)
    print(f"wrote {args.out}: {layers} layers, {len(quantized)} quantized Linears ({args.method}, g{group}"
          f"{', act-order' if args.act_order else ''}{', v2' if args.v2 else ''}), {writer.total / 2**30:.2f} GiB in "
          f"{len(writer.parts)} file(s), {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
