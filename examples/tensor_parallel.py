"""Tensor-parallel tilegemm: an MLP split over torchrun's ranks, column-parallel then row-parallel, as 16-bit
``tilegemm.nn.Linear`` layers and as 4-bit ``Int4Linear`` ones, checked against the unsharded model on every rank.

    torchrun --standalone --nproc-per-node 2 examples/tensor_parallel.py          # CPU: gloo, the interpreter
    torchrun --standalone --nproc-per-node 2 examples/tensor_parallel.py --gpu    # one GPU a rank: NCCL

docs/parallel.md explains the pieces.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import tilegemm.nn as tnn


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="NCCL, one GPU a rank (default: gloo on the CPU)")
    args = parser.parse_args(argv)
    if not dist.is_initialized():  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        problem = _cannot_start(args.gpu)
        if problem:
            print(f"tensor_parallel.py: {problem}; run it as: torchrun --standalone --nproc-per-node 2 "
                  f"examples/tensor_parallel.py{' --gpu' if args.gpu else ''}", file=sys.stderr)
            return 2
        dist.init_process_group("nccl" if args.gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if args.gpu else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(0)  # the same model and input on every rank
    hidden, inner = 128, 256  # inner / ranks must hold whole groups of 64 (the row-parallel layer's K)
    mlp = torch.nn.Sequential(torch.nn.Linear(hidden, inner), torch.nn.SiLU(), torch.nn.Linear(inner, hidden))
    mlp = mlp.to(device, torch.float16)
    x = torch.randn(4, hidden, device=device, dtype=torch.float16)
    ok = True
    for name, make in (("fp16", lambda m: tnn.convert_(m)), ("int4", lambda m: tnn.quantize_(m, group_size=64))):
        model = make(copy.deepcopy(mlp))
        with torch.no_grad():
            want = model(x)
            # "0" splits its outputs (each rank computes inner / world of them), "2" its inputs: one all-reduce
            parallelize_module(model, mesh, {"0": tnn.ColwiseParallel(), "2": tnn.RowwiseParallel()})
            got = model(x)
        err = float((got.double() - want.double()).norm() / want.double().norm())
        ok &= err < 5e-3
        if rank == 0:
            print(f"{name}: {world} ranks, layer 0 {type(model[0]).__name__} holding {_local_shape(model[0])} here, "
                  f"output rel. error {err:.1e} against the unsharded model")
    return 0 if ok else 1


def _cannot_start(gpu: bool) -> str | None:
    """Why this process cannot join a process group (None: it can)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        return f"no torchrun environment ({', '.join(missing)} not set)"
    if gpu and not (dist.is_nccl_available() and torch.cuda.is_available()):
        return "--gpu needs NCCL and a CUDA GPU, which this torch or machine lacks (without --gpu: gloo on the CPU)"
    return None


def _local_shape(module) -> list[int]:
    if isinstance(module, tnn.Int4Linear):
        return [module.out_features, module.in_features]
    return list(module.weight.to_local().shape)


if __name__ == "__main__":
    code = main()
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(code)
