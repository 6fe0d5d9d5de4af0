import torch, triton, triton.testing, tilegemm, statistics, time
from tilegemm.ops.matmul import op
for dt in (torch.float16, torch.bfloat16):
    for s in (1024, 2048, 4096):
        a = torch.randn(s, s, device="cuda", dtype=dt); b = torch.randn(s, s, device="cuda", dtype=dt)
        for k in ("auto", "persistent_tma", "autotuned"):
            n0 = len(op._replays.entries)
            for _ in range(3): tilegemm.matmul(a, b, kernel=k)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(200): tilegemm.matmul(a, b, kernel=k)
            host = (time.perf_counter() - t) / 200 * 1e6
            torch.cuda.synchronize()
            print(dt, s, k, "new replay entries", len(op._replays.entries) - n0, f"host {host:.1f} us/call (incl. queueing)")
        fns = {"cublas": lambda: torch.matmul(a, b), "auto": lambda: tilegemm.matmul(a, b),
               "pt": lambda: tilegemm.matmul(a, b, kernel="persistent_tma")}
        ms = {k: statistics.median([triton.testing.do_bench(f, warmup=10, rep=50) for _ in range(3)]) for k, f in fns.items()}
        print("   ", {k: round(ms["cublas"] / v, 3) for k, v in ms.items()})
