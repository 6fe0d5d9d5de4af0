"""Tensor-parallel decode: a 4-bit checkpoint loaded split over torchrun's GPUs, greedy decode timed at batch 1 and 16,
against the same script on one GPU and against the fp16 model split the same way (docs/parallel.md).

    python tools/write_w4_checkpoint.py --out /tmp/llama3-8b-gptq                        # Llama-3-8B shapes, random
    python tools/tp_decode.py --checkpoint /tmp/llama3-8b-gptq --fp16 --out one.json      # one GPU (no torchrun)
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --standalone --nproc-per-node 2 tools/tp_decode.py --checkpoint /tmp/llama3-8b-gptq --fp16 --check \\
        --out tp2.json
    torchrun --standalone --nproc-per-node 2 tools/tp_decode.py --checkpoint DIR --new 4    # CPU: a smoke run

Each rank loads only its shards (``tilegemm.models.from_pretrained(..., device_mesh=mesh)``). ``--fp16``: also the
same architecture in fp16 (random weights: a timing baseline), split with the same plan (torch's styles, cuBLAS).
``--check``: the split model's logits of a prompt against the unsplit model's (rank 0 loads it too). The static KV
cache holds each rank's heads. Rank 0 prints a line per (model, batch, mode) and writes them to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time

import tilegemm  # noqa: F401 (first: it settles Triton's backend before triton is imported)

import torch
import torch.distributed as dist

from tilegemm.models.llama import Decoder

MODES = {"eager": "eager PyTorch", "graph": "decode step replayed from a CUDA graph",
         "compile": "decode step compiled by torch.compile, replayed from a CUDA graph"}


@contextlib.contextmanager
def local_heads(model, world: int):
    """The model's config with each rank's head counts while a decoder allocates its static KV cache."""
    config = model.config
    local = copy.copy(config)
    local.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    local.num_attention_heads = config.num_attention_heads // world
    local.num_key_value_heads = config.num_key_value_heads // world
    model.config = local
    try:
        yield
    finally:
        model.config = config


def fp16_model(config, device, mesh):
    """The checkpoint's architecture in fp16 with random weights, split with the same plan (nn.Linear: torch's
    styles, cuBLAS through DTensor)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(old)
    if mesh is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        from tilegemm.parallel import ColwiseParallel, RowwiseParallel, resolve_plan

        plan = {name: ColwiseParallel() if split == "out" else RowwiseParallel()
                for name, split in resolve_plan(model, "auto").items()}
        parallelize_module(model, mesh, plan)
    return model.eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a 4-bit GPTQ/AWQ checkpoint directory")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--new", type=int, default=128, help="generated tokens")
    parser.add_argument("--modes", default=None, help="eager,graph,compile (GPU default: graph,compile; CPU: eager)")
    parser.add_argument("--fp16", action="store_true", help="also the fp16 model split the same way")
    parser.add_argument("--check", action="store_true", help="logits against the unsplit int4 model (rank 0)")
    parser.add_argument("--out", default=None, help="JSON file for rank 0's results")
    args = parser.parse_args(argv)

    gpu = torch.cuda.is_available()
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("nccl" if gpu else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    mesh = None
    if distributed:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
    modes = (args.modes or ("graph,compile" if gpu else "eager")).split(",")
    if any(m not in MODES for m in modes) or (not gpu and modes != ["eager"]):
        print(f"--modes: choose from {', '.join(MODES)} (the CPU: eager)", file=sys.stderr)
        return 2

    from tilegemm.models import from_pretrained

    t0 = time.perf_counter()
    qmodel = from_pretrained(args.checkpoint, device=device, device_mesh=mesh)
    load_s = time.perf_counter() - t0
    cfg = qmodel.config
    held = sum(t.numel() * t.element_size() for t in [*qmodel.parameters(), *qmodel.buffers()])
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    log(f"torch {torch.__version__}, {world} rank(s), {torch.cuda.get_device_name() if gpu else 'cpu'}; "
        f"{args.checkpoint}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, heads "
        f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} KV; loaded in {load_s:.1f} s, rank 0 holds "
        f"{held / 2**30:.2f} GiB")
    models = [("int4", qmodel)]
    if args.fp16:
        models.append(("fp16", fp16_model(cfg, device, mesh)))

    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        torch.manual_seed(0)  # the same prompt on every rank
        prompt = torch.randint(0, cfg.vocab_size, (batch, args.prompt), device=device)
        for name, model in models:
            for mode in modes:
                with local_heads(model, world):
                    dec = Decoder(model, batch, args.prompt + args.new, device, graph=mode == "graph",
                                  compiled=mode == "compile")
                if gpu:
                    dec.run(prompt, 4)  # warm-up: compiles, cuBLAS and NCCL set-up, the graph
                pre, secs, _ = dec.run(prompt, args.new)
                tok_s = batch * (args.new - 1) / secs
                rows.append(dict(world=world, model=name, batch=batch, mode=mode, tok_s=tok_s,
                                 prefill_ms=pre * 1e3, prompt=args.prompt, new=args.new))
                log(f"{world} rank(s) {name} batch {batch:3d} {mode:7s}: prefill {pre * 1e3:8.1f} ms, "
                    f"decode {tok_s:9.1f} tok/s")
                del dec

    check = None
    if args.check:
        torch.manual_seed(1)
        ids = torch.randint(0, cfg.vocab_size, (1, 32), device=device)
        with torch.no_grad():
            split = qmodel(input_ids=ids).logits.float()
        if rank == 0:
            whole = from_pretrained(args.checkpoint, device=device)
            with torch.no_grad():
                ref = whole(input_ids=ids).logits.float()
            check = dict(rel_err=float((split - ref).norm() / ref.norm()),
                         argmax_agree=float((split.argmax(-1) == ref.argmax(-1)).float().mean()))
            log(f"logits against the unsplit model: rel. error {check['rel_err']:.2e}, argmax agrees at "
                f"{check['argmax_agree'] * 100:.1f}% of positions")
            del whole
        if distributed:
            dist.barrier()
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(dict(checkpoint=args.checkpoint, world=world, torch=torch.__version__,
                           device=torch.cuda.get_device_name() if gpu else "cpu", load_s=load_s,
                           rank0_bytes=held, rows=rows, check=check), f, indent=1)
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
