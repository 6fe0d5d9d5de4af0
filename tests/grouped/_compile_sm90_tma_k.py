"""Kernel ``tma_k`` compiled offline for sm_90 (no GPU: Triton ships ptxas) at the configs it ships, for the MoE
backward's dB (a the transposed tokens, b the output gradient); prints the PTX's tensor-core and memory
instructions, its spills and its launch config, as JSON on the last line."""
import collections, contextlib, io, json, os, re, subprocess, tempfile
import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tilegemm.ops.grouped import tma_k
from tilegemm.ops.grouped.problem import make_problem

captured = []
tma_k.launch = lambda kernel, grid, args, kwargs, **kw: captured.append((kernel, args, kwargs))
tma_k.interpreting = lambda: False  # the GPU's config
tma_k.sm_count = lambda device: 132  # an H200's
tma_k.why_not_tma = lambda: None  # (no GPU here: compiled for the H200's sm_90)
tma_k.ensure_allocator = lambda: None


def spilled_bytes(ptx, log=""):
    """Bytes of spill stores and loads ptxas reports for sm_90a: in ``log`` (the report of Triton's own ptxas run),
    or from a run of ptxas here where it holds none."""
    from triton.backends.nvidia.compiler import get_ptxas

    if "Compiling entry function" in log:
        return sum(int(n) for n in re.findall(r"(\d+) bytes spill", log))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        run = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True)
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill", run.stderr))


def compiled(name, dtype, T, H, N, G, out_dtype=None, bias=False):
    e = lambda *s, dt=dtype: torch.empty(*s, dtype=dt)  # noqa: E731
    a, b = e(T, H).T, e(T, N)  # dB = grouped(A^T, dY): a [H, T] M-contiguous, b [T, N] row-major
    p = make_problem("2d2d", G, a, b, torch.empty(G, dtype=torch.int32), e(G, N) if bias else None,
                     e(G, H, N, dt=out_dtype or dtype))
    tma_k.run(p)
    kernel, args, kwargs = captured[-1]
    kw = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    sig, ce, at = specialized_signature(kernel, args, kw)
    log = io.StringIO()
    with contextlib.redirect_stdout(log), knobs.nvidia.scope():
        knobs.nvidia.dump_ptxas_log = True  # the report of Triton's ptxas -v: spilled_bytes reads it
        ptx = triton.compile(ASTSource(kernel, sig, ce, at), target=GPUTarget("cuda", 90, 32),
                             options=dict(num_warps=kwargs["num_warps"], num_stages=kwargs["num_stages"])).asm["ptx"]
    counts = dict(collections.Counter(re.findall(r"\b(wgmma\.mma_async\S*|mma\.sync\S*|cp\.async\.c[ag]\S*|"
                                                 r"cp\.async\.bulk\.tensor\S*|ld\.global\S*|st\.global\S*|"
                                                 r"tensormap\S*)", ptx)))
    counts["spilled_bytes"] = spilled_bytes(ptx, log.getvalue())
    counts["config"] = {k: kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "STAGES", "num_warps")}
    counts["grid"] = captured[-1][1][9]
    return name, counts


results = dict(compiled(*c) for c in (
    ("bf16_mixtral_gate_up", torch.bfloat16, 8192, 4096, 28672, 8),
    ("fp16_deepseek_down", torch.float16, 98304, 1408, 2048, 64),
    ("bf16_fp32_out_bias", torch.bfloat16, 8192, 2048, 1536, 128, torch.float32, True),
))
print(json.dumps(results))
