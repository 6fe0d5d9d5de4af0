import os, json, torch, triton, triton.testing
os.environ["TILEGEMM_TUNING_CACHE"] = "0"
from tilegemm import tuning
from tilegemm.ops.matmul import split_k
from tilegemm.ops.matmul.problem import make_problems
real = triton.testing.do_bench
log = []
def logged(fn, **kw):
    t = real(fn, **kw); log.append((kw.get("rep"), t)); return t
triton.testing.do_bench = logged
M, N, K = 128, 4096, 4096
a = torch.randn(M, K, device="cuda", dtype=torch.float16); b = torch.randn(K, N, device="cuda", dtype=torch.float16)
out = torch.empty(M, N, device="cuda", dtype=torch.float16)
p = make_problems(a, b, out, None, None, 1.0, 0.0, "none", "ieee", False)[0]
cands = split_k.configs(p)
for trial in range(3):
    tuning._memory.clear(); log.clear()
    k = tuning.key("split_k", M, N, K, torch.float16, torch.float16, "NN")
    tuning._loaded_for = "x"  # keep memory empty (no shipped file)
    tuning._loaded_for = "|".join(tuning._device_tag())
    cfg = tuning.lookup_or_tune(k, lambda: cands, lambda c: split_k._launch(p, c))
    short = [(i, round(t * 1e3, 1)) for i, (rep, t) in enumerate(log[:len(cands)])]
    print("trial", trial, "picked", {x: cfg[x] for x in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_stages")})
    print("  short:", sorted(short, key=lambda x: x[1])[:6])
    print("  long:", [round(t * 1e3, 1) for rep, t in log[len(cands):]])
print([(i, {x: c[x] for x in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_stages")}) for i, c in enumerate(cands)])
