"""The grouped kernels compiled offline for sm_90 (no GPU: Triton ships ptxas), for a few problems each; prints the
tensor-core and memory instructions each one's PTX holds, as JSON on the last line."""
import collections, contextlib, io, json, os, re, subprocess, tempfile
import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import tilegemm
from tilegemm.ops.grouped import configs, dequant, int4, tiled, tma
from tilegemm.ops.grouped.problem import GroupedInt4Problem, make_problem

captured = []
tiled.launch = int4.launch = tma.launch = dequant.launch = lambda kernel, grid, args, kwargs, **kw: captured.append((kernel, args, kwargs))
# the GPU's configs
tiled.interpreting = int4.interpreting = configs.interpreting = tma.interpreting = lambda: False
configs.sm_count = tma.sm_count = lambda device: 132  # an H200's, so decode problems get the K split they get there
tma.why_not_tma = lambda: None  # (no GPU here: the kernel is compiled for the H200's sm_90)


CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "SWAP", "ONE_GROUP", "B_NK", "STAGES", "TAIL_SPLIT")
configs_of = {}  # each compiled problem's launch config
ptx_of, log_of = {}, {}


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


def compile_last(name):
    kernel, args, kwargs = captured[-1]
    configs_of[name] = {k: kwargs[k] for k in CONFIG_KEYS if k in kwargs}
    kw = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    sig, ce, at = specialized_signature(kernel, args, kw)
    log = io.StringIO()
    with contextlib.redirect_stdout(log), knobs.nvidia.scope():
        knobs.nvidia.dump_ptxas_log = True  # the report of Triton's ptxas -v: spilled_bytes reads it
        ptx = triton.compile(ASTSource(kernel, sig, ce, at), target=GPUTarget("cuda", 90, 32),
                             options=dict(num_warps=kwargs["num_warps"], num_stages=kwargs["num_stages"])).asm["ptx"]
    ptx_of[name], log_of[name] = ptx, log.getvalue()
    return dict(collections.Counter(re.findall(r"\b(wgmma\.mma_async\S*|mma\.sync\S*|cp\.async\.c[ag]\S*|"
                                               r"cp\.async\.bulk\.tensor\S*|ld\.global\S*|st\.global\S*|"
                                               r"atom\.\S*)", ptx)))


def grouped(name, layout, dtype, M, N, K, G, precision="ieee", gated=False, b_t=True):
    e = lambda *s: torch.empty(*s, dtype=dtype)  # noqa: E731
    offs = torch.empty(G, dtype=torch.int32)
    if layout == "2d3d":
        a, b, out = e(M, K), (e(G, 2 * N if gated else N, K).transpose(1, 2) if b_t else e(G, K, N)), e(M, N)
    elif layout == "2d2d":
        a, b, out = e(K, M).T, e(K, N), e(G, M, N)
    else:
        a, b, out, offs = e(G, M, K), e(G, K, N), e(G, M, N), None
    p = make_problem(layout, G, a, b, offs, None, out, precision, "silu" if gated else "none", gated)
    tiled.run(p)
    return compile_last(name)


PROBLEMS = (
    ("2d3d_bf16", "2d3d", torch.bfloat16, 8192, 4096, 4096, 8),
    ("2d3d_fp16_decode", "2d3d", torch.float16, 16, 1536, 2048, 128, "ieee", False, False),
    ("2d3d_bf16_gated", "2d3d", torch.bfloat16, 4096, 768, 2048, 128, "ieee", True),
    ("2d2d_bf16", "2d2d", torch.bfloat16, 4096, 1536, 32768, 128),
    ("3d3d_tf32", "3d3d", torch.float32, 512, 512, 512, 8, "tf32"),
    # 16-bit decode: one token to 2 of Mixtral-8x7B's experts (down projection): K split
    ("2d3d_bf16_decode_split", "2d3d", torch.bfloat16, 2, 4096, 14336, 8),
)
results = {problem[0]: grouped(*problem) for problem in PROBLEMS}


def int4_experts(name, dtype, M, N, K, E, group=128, gated=False, config=None):
    width = 2 * N if gated else N
    p = GroupedInt4Problem(torch.empty(M, K, dtype=dtype), torch.empty(E, K // 8, width, dtype=torch.int32),
                           torch.empty(E, K // group, width, dtype=dtype), torch.empty(E, K // group, width, dtype=dtype),
                           torch.empty(E, dtype=torch.int32), None, torch.empty(M, N, dtype=dtype), E, M, N, K, group,
                           "silu" if gated else "none", gated)
    int4.run(p, config)
    return compile_last(name)


for name, args, kw in (
    ("int4_fp16_gated", (torch.float16, 64, 1024, 1024, 8), dict(gated=True)),
    # Mixtral-8x7B's down projection: one token (2 experts of 1 row: SWAP, K split), and 16384 tokens (128-row tiles)
    ("int4_fp16_decode", (torch.float16, 2, 4096, 14336, 8), {}),
    ("int4_bf16_decode", (torch.bfloat16, 2, 4096, 14336, 8), {}),
    ("int4_bf16_prefill", (torch.bfloat16, 16384, 4096, 14336, 8), {}),
    # groups of 32 under 64-K steps: each K row's scales gathered
    ("int4_fp16_group_rows", (torch.float16, 256, 512, 1024, 8), dict(group=32, config=dict(
        BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3))),
):
    results[name] = int4_experts(name, *args, **kw)


def tma_experts(name, dtype, M, N, K, G, b_nk, gated=False, bias=False):
    e = lambda *s: torch.empty(*s, dtype=dtype)  # noqa: E731
    width = 2 * N if gated else N
    b = e(G, width, K).transpose(1, 2) if b_nk else e(G, K, width)
    p = make_problem("2d3d", G, e(M, K), b, torch.empty(G, dtype=torch.int32), e(G, width) if bias else None,
                     e(M, N), "ieee", "silu" if gated else "none", gated)
    tma.run(p)
    counts = compile_last(name)
    counts["spilled_bytes"] = spilled_bytes(ptx_of[name], log_of[name])
    return counts


# kernel tma, the configs it ships: Mixtral's prefill (b as torch lays out experts, and row-major), gated
for name, args, kw in (
    ("tma_bf16_b_nk", (torch.bfloat16, 32768, 4096, 14336, 8, True), {}),
    ("tma_fp16_b_kn", (torch.float16, 32768, 14336, 4096, 8, False), {}),
    ("tma_bf16_gated", (torch.bfloat16, 32768, 768, 2048, 128, True), dict(gated=True, bias=True)),
    ("tma_bf16_bias", (torch.bfloat16, 32768, 4096, 14336, 8, True), dict(bias=True)),
    ("tma_fp16_gated_b_kn", (torch.float16, 32768, 768, 2048, 128, False), dict(gated=True)),
    # Mixtral at 512 tokens (128 rows an expert): the 64-row tile on one warp group
    ("tma_bf16_half_tile", (torch.bfloat16, 1024, 4096, 14336, 8, True), {}),
):
    results[name] = tma_experts(name, *args, **kw)
# its tail split (a candidate, configs.TMA_TAIL_SPLIT): Mixtral's down projection at 4096 and 512 tokens
configs.TMA_TAIL_SPLIT = 4
for name, args in (("tma_bf16_tail_split", (torch.bfloat16, 8192, 4096, 14336, 8, True)),
                   ("tma_fp16_half_tile_tail_split", (torch.float16, 1024, 4096, 14336, 8, True))):
    results[name] = tma_experts(name, *args)
configs.TMA_TAIL_SPLIT = 1


# kernel dequant_grouped's pass: Mixtral's gate/up weight, a whole and a slice of the gated rows
for name, dtype, n_lo, columns in (("dequant_pass_fp16", torch.float16, 0, 14336),
                                    ("dequant_pass_bf16_slice", torch.bfloat16, 256, 4096)):
    E, N, K = 8, 14336, 4096
    p = GroupedInt4Problem(torch.empty(1, K, dtype=dtype), torch.empty(E, K // 8, 2 * N, dtype=torch.int32),
                           torch.empty(E, K // 128, 2 * N, dtype=dtype), torch.empty(E, K // 128, 2 * N, dtype=dtype),
                           torch.empty(E, dtype=torch.int32), None, torch.empty(1, N, dtype=dtype), E, 1, N, K, 128,
                           "silu", True)
    dequant.dequantize_experts(p, torch.empty(E, 2 * columns, K, dtype=dtype), n_lo, columns)
    captured[-1][2].setdefault("num_stages", 1)  # (no loop to pipeline)
    results[name] = compile_last(name)
results["configs"] = configs_of
print(json.dumps(results))
