"""Open question (GPU): does a memory-bound kernel for narrow 1x1 layers (few channels in and out) beat cuDNN where
``auto``'s GEMM trails it?

A stride-1 1x1 layer of C <= 64 input and K <= 128 output channels reads 2*C and writes 2*K bytes a pixel for 2*C*K
FLOPs: a pass over memory. ``auto`` runs it as a GEMM (``gemm_1x1``: tilegemm.matmul on the ``[N*H*W, C]`` view),
whose tiles and K steps are sized for long reductions; on the zoo's 8 -> 24 at 112x112 it ran 0.26x cuDNN, the best
config of the matmul rungs 0.42x and cuBLAS 0.56x (``2026-12-08-h100/e398b859/pointwise-named.json.xz``), and
layers of 16-64 channels 0.47x-0.70x. Here one program takes ``BLOCK_P`` whole pixels (rows of C channels, C and K
compile-time constants, so that rows of 16-byte multiples load and store 16 bytes at a time), one ``tl.dot`` with the
whole weight (kept in registers across a persistent loop) and stores ``[BLOCK_P, K]``.

Times, on the zoo's such layers (batch 32, channels-last, fp16 unless ``--dtype``; spread over sizes, within
``--budget`` seconds), cuDNN's forward, ``auto``, cuBLAS's ``F.linear`` on the same product, and this kernel at
several configs, each checked against cuDNN's fp32 output, as CUDA graphs; a table of cuDNN time / the call's last.

    PYTHONPATH=src:tools python3 research/narrow_1x1.py [--budget 150] [--dtype fp16] [--out F.json]

``--smoke``: the kernel against torch on the CPU under Triton's interpreter (fp32 and fp16, a few shapes).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def narrow_1x1_kernel(x_ptr, w_ptr, out_ptr, M, tiles, C: tl.constexpr, K: tl.constexpr, CP: tl.constexpr,
                      KP: tl.constexpr, BLOCK_P: tl.constexpr):
    """``out[M, K] = x[M, C] @ w[K, C]^T``, x and out row-major and packed (row strides C and K), fp32 accumulation;
    programs loop over ``BLOCK_P``-row tiles, ``tiles`` of them, the weight loaded once a program."""
    c = tl.arange(0, CP)
    k = tl.arange(0, KP)
    wt = tl.load(w_ptr + k[None, :] * C + c[:, None], mask=(c < C)[:, None] & (k < K)[None, :], other=0.0)
    for t in range(tl.program_id(0), tiles, tl.num_programs(0)):
        rows = t * BLOCK_P + tl.arange(0, BLOCK_P)
        ok = rows < M
        x = tl.load(x_ptr + rows[:, None] * C + c[None, :], mask=ok[:, None] & (c < C)[None, :], other=0.0)
        acc = tl.dot(x, wt)
        tl.store(out_ptr + rows[:, None] * K + k[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=ok[:, None] & (k < K)[None, :])


def narrow_1x1(x: torch.Tensor, w: torch.Tensor, block_p: int = 256, waves: int = 4, num_warps: int = 4,
               sms: int = 132) -> torch.Tensor:
    """The 1x1 convolution of channels-last ``x`` [N, C, H, W] (pixels packed) by ``w`` [K, C, 1, 1], channels-last
    output; ``waves``: programs per SM of the persistent grid (0: a program a tile)."""
    N, C, H, W = x.shape
    K = w.shape[0]
    M = N * H * W
    if x.stride() != (C * H * W, 1, W * C, C):
        raise ValueError("x must be packed channels-last")
    if M * max(C, K) >= 2**31:
        raise ValueError("2^31 elements or more")
    out = torch.empty(N, K, H, W, device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    w2 = w.reshape(K, C).contiguous()
    tiles = triton.cdiv(M, block_p)
    grid = (min(tiles, waves * sms) if waves else tiles,)
    cp, kp = max(16, triton.next_power_of_2(C)), max(16, triton.next_power_of_2(K))
    narrow_1x1_kernel[grid](x, w2, out, M, tiles, C=C, K=K, CP=cp, KP=kp, BLOCK_P=block_p, num_warps=num_warps)
    return out


CONFIGS = [(128, 4, 4), (256, 4, 4), (256, 8, 8), (512, 8, 2), (256, 0, 4), (512, 0, 8)]  # (BLOCK_P, waves, warps)


def layers() -> list[dict]:
    """The zoo's stride-1 unpadded single-group 1x1 layers of at most 64 input and 128 output channels on images
    of more than one pixel, spread over sizes (every other by pixels, then the rest)."""
    from tilegemm.ops.conv2d import zoo

    out = [L for L in zoo.bench_layers() if L["R"] * L["S"] == 1 and list(L["stride"]) == [1, 1]
           and L["groups"] == 1 and list(L["padding"]) == [0, 0] and L["C"] <= 64 and L["K"] <= 128 and L["H"] > 1]
    out.sort(key=lambda L: -L["H"] * L["W"] * (L["C"] + L["K"]))
    return out[0::2] + out[1::2]


def run_layer(L: dict, batch: int, dtype: torch.dtype) -> dict:
    import tilegemm
    from conv2d_depthwise_candidates import graph_us
    from tilegemm.core.checks import relative_error

    cl = torch.channels_last
    xs = [torch.randn(batch, L["C"], L["H"], L["W"], device="cuda", dtype=dtype).contiguous(memory_format=cl)
          for _ in range(3)]
    w = (torch.randn(L["K"], L["C"], 1, 1, device="cuda", dtype=dtype) / L["C"] ** 0.5).contiguous(memory_format=cl)
    ref = F.conv2d(xs[0].float(), w.float())
    row = dict(layer=f"{L['C']}->{L['K']} @{L['H']}x{L['W']}", models=L.get("models"),
               cudnn_us=graph_us(lambda i: F.conv2d(xs[i], w), 3))
    w2 = w.reshape(L["K"], L["C"])
    calls = {"auto": lambda i: tilegemm.conv2d(xs[i], w),
             "cublas": lambda i: F.linear(xs[i].permute(0, 2, 3, 1).reshape(-1, L["C"]), w2)}
    for bp, waves, warps in CONFIGS:
        calls[f"narrow-{bp}-{waves}-{warps}"] = (lambda bp, waves, warps: lambda i: narrow_1x1(
            xs[i], w, bp, waves, warps, torch.cuda.get_device_properties(0).multi_processor_count))(bp, waves, warps)
    for name, fn in calls.items():
        try:
            got = fn(0)
            got = got.view(batch, L["H"], L["W"], L["K"]).permute(0, 3, 1, 2) if name == "cublas" else got
            err = relative_error(got.float(), ref)
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            row[name], row[f"{name}_err"] = None, f"{type(e).__name__}: {e}"[:200]
            continue
        row[f"{name}_err"] = err
        row[name] = row["cudnn_us"] / graph_us(fn, 3) if err < 1e-2 else None
    narrow = [v for k, v in row.items() if k.startswith("narrow-") and not k.endswith("_err") and v]
    row["narrow_best"] = max(narrow) if narrow else None
    return row


def smoke() -> None:
    for dtype in (torch.float32, torch.float16):
        for N, C, H, W, K in ((2, 8, 5, 7, 24), (1, 24, 3, 3, 122), (3, 64, 4, 5, 16), (1, 17, 2, 9, 33)):
            x = torch.randn(N, C, H, W, dtype=dtype).contiguous(memory_format=torch.channels_last)
            w = torch.randn(K, C, 1, 1, dtype=dtype)
            for bp, waves, warps in CONFIGS[:2]:
                got = narrow_1x1(x, w, min(bp, 64), waves, warps, sms=2)
                want = F.conv2d(x.double(), w.double())
                err = ((got.double() - want).norm() / want.norm()).item()
                assert err < (1e-5 if dtype == torch.float32 else 2e-3), (N, C, H, W, K, dtype, err)
                assert got.is_contiguous(memory_format=torch.channels_last)
    print("smoke: ok")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.smoke:
        return smoke()
    from conv2d_depthwise_candidates import geomean

    torch.backends.cudnn.benchmark = True
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    start, rows, todo = time.time(), [], layers()
    for L in todo:
        if time.time() - start > args.budget:
            break
        rows.append(run_layer(L, args.batch, dtype))
        r = rows[-1]
        print(f"{r['layer']:<18s} {r['cudnn_us']:7.1f}us  auto {r['auto'] or 0:.2f}  cublas {r['cublas'] or 0:.2f}"
              f"  narrow best {r['narrow_best'] or 0:.2f}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(dtype=args.dtype, batch=args.batch, configs=CONFIGS, rows=rows), f, indent=1)
    print(f"{len(rows)} of {len(todo)} layers; cuDNN time / the call's, geomean:")
    cols = ["auto", "cublas", "narrow_best"] + [f"narrow-{bp}-{wv}-{wp}" for bp, wv, wp in CONFIGS]
    for c in cols:
        print(f"  {c:<18s} {geomean(r.get(c) for r in rows) or 0:.3f}x  worst {min([r.get(c) or 0 for r in rows] or [0]):.2f}x")


if __name__ == "__main__":
    main()
