"""Diagnosis on the GPU (not a test): do residue-class products replay through ``kernel="split_k"`` and ``auto``
alike? For a few small-M products with misaligned B: replays added, do_bench medians (three), host time per
call (back to back, no sync) and cuBLAS's time, each kernel name twice. (On the H100 one explore run read
9x2049x30001 at 143 us through ``kernel="split_k"`` and 66 us through ``auto``: ``2026-11-25-h100/5590f6a/``.)

    PYTHONPATH=src python3 research/diagnose_residue_replay.py
"""
import torch, triton.testing as tt, tilegemm
from tilegemm.ops.matmul import replay, residue
import time
def host_us(fn, n=200):
    fn(); torch.cuda.synchronize(); t=time.perf_counter()
    for _ in range(n): fn()
    t1=time.perf_counter(); torch.cuda.synchronize(); return (t1-t)/n*1e6
for layout, M, N, K in (("NN", 9, 2049, 30001), ("NN", 6, 5661, 26729), ("NT", 16, 11008, 4095)):
    a = torch.randn(M, K, device="cuda", dtype=torch.float16)
    b = torch.randn(K, N, device="cuda", dtype=torch.float16) if layout == "NN" else torch.randn(N, K, device="cuda", dtype=torch.float16).T
    for kern in ("split_k", "auto", "split_k", "auto"):
        before = replay.count()
        fn = lambda: tilegemm.matmul(a, b, kernel=kern)
        fn(); fn()
        ms = [tt.do_bench(fn, warmup=5, rep=30) * 1e3 for _ in range(3)]
        print(layout, M, N, K, kern, "replays", replay.count() - before, "us", [round(x, 1) for x in ms], "host", round(host_us(fn), 1),
              "cublas", round(tt.do_bench(lambda: torch.matmul(a, b), rep=30) * 1e3, 1), flush=True)
