"""The MoE routing kernels against the torch ops they replace (GPU), as CUDA-graph replays:

    PYTHONPATH=src python3 tools/moe_route_probe.py [--out $OUT/moe-route-probe.json]

For pairs P = tokens x top-k from one decode token to a prefill, Qwen3-30B-A3B's routing (128 experts, top 8,
hidden 2048, bf16, experts drawn uniformly without repeats per token), microseconds of GPU time per call of:

- ``route kernel``: ``routing.route`` with its kernel forced (P up to past ``KERNEL_MAX_PAIRS``);
- ``route torch``: ``routing.route_torch`` (the sort, search, inverse permutation and row gather);
- ``combine kernel``: ``routing.combine``;
- ``combine torch``: the weights multiplied in, the rows scattered back and summed (what the experts' forward ran
  before the kernels);
- ``columns``: ``routing.group_columns`` on the sorted rows (what act-order 4-bit experts add before each product),
  against ``torch.gather`` with each row's expert's order (checked equal).

Each row is checked against the torch path first. The ratio ``torch / kernel`` above 1 means the kernel is faster;
``KERNEL_MAX_PAIRS`` should sit where the route ratio falls under 1.
"""

import argparse
import json

import torch

from tilegemm.bench.runner import graph_us_per_call
from tilegemm.ops.grouped import routing

E, K_TOP, H = 128, 8, 2048
TOKENS = (1, 4, 16, 64, 256, 1024, 2048, 4096)


def combine_torch(y, pos, w):
    T, k = w.shape
    y = y[pos.long()] * w.reshape(-1, 1).to(y.dtype)
    return y.view(T, k, -1).sum(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(7)
    for T in TOKENS:
        P = T * K_TOP
        x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.rand(T, E, device="cuda", generator=gen).argsort(1)[:, :K_TOP]
        w = torch.rand(T, K_TOP, device="cuda", generator=gen)
        saved = routing.KERNEL_MAX_PAIRS
        routing.KERNEL_MAX_PAIRS = 1 << 30
        try:
            got = routing.route(x, ids, E)
            want = routing.route_torch(x, ids, E)
            same = all(torch.equal(a, b) for a, b in zip(got, want))
            route_kernel = graph_us_per_call(lambda: routing.route(x, ids, E))
        finally:
            routing.KERNEL_MAX_PAIRS = saved
        route_torch = graph_us_per_call(lambda: routing.route_torch(x, ids, E))
        y = torch.randn(P, H, device="cuda", generator=gen).to(torch.bfloat16)
        pos = want[2]
        err = (routing.combine(y, pos, w).float() - combine_torch(y, pos, w).float()).abs().max().item()
        combine_kernel = graph_us_per_call(lambda: routing.combine(y, pos, w))
        combine_ref = graph_us_per_call(lambda: combine_torch(y, pos, w))
        xs, offs = want[0], want[1]
        perm = torch.rand(E, H, device="cuda", generator=gen).argsort(1)
        expert = torch.searchsorted(offs, torch.arange(P, device="cuda", dtype=torch.int32), right=True).clamp(max=E - 1)
        gather = lambda: torch.gather(xs, 1, perm[expert])  # noqa: E731
        columns_same = torch.equal(routing.columns(xs, offs, perm), gather())
        columns_kernel = graph_us_per_call(lambda: routing.columns(xs, offs, perm))
        columns_ref = graph_us_per_call(gather)
        rows.append(dict(tokens=T, pairs=P, route_same=same, combine_max_abs_diff=err, columns_same=columns_same,
                         route_kernel_us=route_kernel, route_torch_us=route_torch,
                         combine_kernel_us=combine_kernel, combine_torch_us=combine_ref,
                         columns_kernel_us=columns_kernel, columns_torch_us=columns_ref))
    header = dict(experts=E, top_k=K_TOP, hidden=H, dtype="bf16", kernel_max_pairs=routing.KERNEL_MAX_PAIRS,
                  device=torch.cuda.get_device_name())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(header=header, rows=rows), f, indent=1)
    print(f"{'tokens':>6s} {'pairs':>6s} {'route k':>8s} {'torch':>8s} {'comb k':>8s} {'torch':>8s} {'cols k':>8s} "
          f"{'gather':>8s}  checks")
    for r in rows:
        print(f"{r['tokens']:6d} {r['pairs']:6d} {r['route_kernel_us']:8.1f} {r['route_torch_us']:8.1f} "
              f"{r['combine_kernel_us']:8.1f} {r['combine_torch_us']:8.1f} {r['columns_kernel_us']:8.1f} "
              f"{r['columns_torch_us']:8.1f}  route {'same' if r['route_same'] else 'DIFFERENT'}, combine diff "
              f"{r['combine_max_abs_diff']:.1e}, columns {'same' if r['columns_same'] else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
