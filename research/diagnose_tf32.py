"""Diagnosis on the GPU: is a tf32 GEMM config wrong, and where? (not a test; prints a table)

The first exploration (research/explore_hopper.py) saw the pointer kernel with 128x128x32 tiles, 8 warps and
3 stages give a max error of 3% of max|C| for tf32 NN at K = 4096 and 8192, where other configs were fine.
This runs the grouped kernel with chosen configs, twice each, and reports: max and norm error against an fp64
product, the number of elements far off, and where they sit inside the 128x128 tile.

    PYTHONPATH=src python3 research/diagnose_tf32.py
"""

from __future__ import annotations

import torch

from tilegemm.core.launch import launch
from tilegemm.ops.matmul.grouped import grid, matmul_grouped_kernel
from tilegemm.ops.matmul.problem import make_problems

CONFIGS = [(128, 128, 32, 8, 3), (128, 128, 32, 4, 4), (128, 128, 32, 8, 4), (128, 256, 32, 8, 3)]
SHAPES = [(1024, 1024, 2048), (1024, 1024, 4096), (1024, 1024, 8192), (4096, 4096, 4096), (1024, 1024, 4000)]


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"{'shape':>16} {'lay':>3} {'config':>18} {'evenk':>5} {'max_err':>9} {'norm_err':>9} {'bad':>7} "
          f"{'same':>4}  where (row%128, col%128) of the worst")
    for m, n, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(k)
        a = torch.randn(m, k, device="cuda", generator=g)
        b0 = torch.randn(k, n, device="cuda", generator=g)
        ref = (a.double() @ b0.double())
        scale = ref.abs().max().item()
        # What torch's own tf32 GEMM gets, for scale.
        torch.backends.cuda.matmul.allow_tf32 = True
        t32 = (a @ b0).double()
        torch.backends.cuda.matmul.allow_tf32 = False
        print(f"{m}x{n}x{k:>5} cuBLAS tf32 max_err {(t32 - ref).abs().max().item() / scale:.2e}")
        for layout in ("NN", "NT"):
            b = b0 if layout == "NN" else b0.t().contiguous().t()
            out = torch.empty(m, n, device="cuda")
            p = make_problems(a, b, out, None, None, 1.0, 1.0, "none", "tf32", False)[0]
            for bm, bn, bk, w, s in CONFIGS:
                even = False  # EVEN_K was removed from the kernels (no gain measured)
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=s)
                flags = {**p.kernel_flags(), **cfg}
                results = []
                for _ in range(2):
                    out.fill_(float("nan"))
                    launch(matmul_grouped_kernel, grid(p), p.kernel_args(), flags)
                    torch.cuda.synchronize()
                    results.append(out.clone())
                err = (results[0].double() - ref).abs()
                max_err = err.max().item() / scale
                norm_err = (torch.linalg.vector_norm(results[0].double() - ref) / torch.linalg.vector_norm(ref)).item()
                bad = int((err > 1e-2 * scale).sum().item())
                same = torch.equal(results[0], results[1])
                where = ""
                if bad:
                    idx = torch.nonzero(err > 1e-2 * scale)[:4].tolist()
                    where = " ".join(f"({r % 128},{c % 128})" for r, c in idx)
                    rows = torch.nonzero(err > 1e-2 * scale)[:, 0]
                    cols = torch.nonzero(err > 1e-2 * scale)[:, 1]
                    where += f" rows%{bm} in {sorted(set((rows % bm).tolist()))[:8]}"
                    where += f" cols%{bn} in {sorted(set((cols % bn).tolist()))[:8]}"
                print(f"{m}x{n}x{k:>5} {layout:>3} {str((bm, bn, bk, w, s)):>18} {str(even):>5} {max_err:9.2e} "
                      f"{norm_err:9.2e} {bad:7d} {str(same):>4}  {where}", flush=True)


if __name__ == "__main__":
    main()
