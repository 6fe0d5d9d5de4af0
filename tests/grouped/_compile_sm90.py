"""The grouped kernels compiled offline for sm_90 (no GPU: Triton ships ptxas), for a few problems each; prints the
tensor-core and memory instructions each one's PTX holds, as JSON on the last line."""
import collections, json, re
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import tilegemm
from tilegemm.ops.grouped import configs, int4, tiled
from tilegemm.ops.grouped.problem import GroupedInt4Problem, make_problem

captured = []
tiled.launch = int4.launch = lambda kernel, grid, args, kwargs, **kw: captured.append((kernel, args, kwargs))
tiled.interpreting = int4.interpreting = configs.interpreting = lambda: False  # the GPU's configs


def signature(kernel, args, kwargs):
    sig, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in kwargs:
            sig[name], constexprs[(i,)] = "constexpr", kwargs[name]
            continue
        v = args[i]
        if isinstance(v, torch.Tensor):
            sig[name] = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32",
                         torch.int32: "*i32"}[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif v == 1:
            sig[name], constexprs[(i,)] = "constexpr", 1
        else:
            sig[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, constexprs, attrs


def compile_last():
    kernel, args, kwargs = captured[-1]
    kw = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    sig, ce, at = signature(kernel, args, kw)
    ptx = triton.compile(ASTSource(kernel, sig, ce, at), target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=kwargs["num_warps"], num_stages=kwargs["num_stages"])).asm["ptx"]
    return dict(collections.Counter(re.findall(r"\b(wgmma\.mma_async\S*|mma\.sync\S*|cp\.async\.c[ag]\S*)", ptx)))


def grouped(layout, dtype, M, N, K, G, precision="ieee", gated=False, b_t=True):
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
    return compile_last()


results = {
    "2d3d_bf16": grouped("2d3d", torch.bfloat16, 8192, 4096, 4096, 8),
    "2d3d_fp16_decode": grouped("2d3d", torch.float16, 16, 1536, 2048, 128, b_t=False),
    "2d3d_bf16_gated": grouped("2d3d", torch.bfloat16, 4096, 768, 2048, 128, gated=True),
    "2d2d_bf16": grouped("2d2d", torch.bfloat16, 4096, 1536, 32768, 128),
    "3d3d_tf32": grouped("3d3d", torch.float32, 512, 512, 512, 8, precision="tf32"),
}
E, N, K = 8, 2 * 1024, 1024
p = GroupedInt4Problem(torch.empty(64, K, dtype=torch.float16), torch.empty(E, K // 8, N, dtype=torch.int32),
                       torch.empty(E, K // 128, N, dtype=torch.float16), torch.empty(E, K // 128, N, dtype=torch.float16),
                       torch.empty(E, dtype=torch.int32), None, torch.empty(64, N // 2, dtype=torch.float16), E, 64,
                       N // 2, K, 128, "silu", True)
int4.run(p)
results["int4_fp16_gated"] = compile_last()
print(json.dumps(results))
