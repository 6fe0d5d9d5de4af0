"""Shared by the conv2d explorations: a variant's GPU time from CUDA graphs once its output is checked, and the
table line of each variant against a baseline."""

from __future__ import annotations


def checked_graph_us(fn, want, tolerance: float = 2e-3, rep: int = 30) -> dict:
    """``{"us": fn's GPU time}`` (``triton.testing.do_bench_cudagraph``: no host time) once ``fn()`` is within
    ``tolerance`` of ``want`` (relative Frobenius norm, fp32); else ``{"error": why}``. Exploration: a failing
    variant is recorded, never ranked."""
    import torch
    import triton.testing as tt

    try:
        out = fn()
        torch.cuda.synchronize()
        err = ((out.float() - want).norm() / want.norm()).item()
        if not err < tolerance:
            return dict(error=f"rel err {err:.2e}")
        return dict(us=tt.do_bench_cudagraph(fn, rep=rep) * 1e3)
    except Exception as e:  # noqa: BLE001 - exploration: record and go on
        return dict(error=f"{type(e).__name__}: {str(e)[:160]}")


def print_variants(variants: dict, moved: int | None = None, base: str = "cuDNN", width: int = 10) -> None:
    """One line a variant: its time, its ratio to ``base``'s and (given the bytes ``moved``) its DRAM rate."""
    ref = variants[base].get("us")
    for label, v in variants.items():
        if "us" not in v:
            print(f"  {label:{width}s} {v['error']}")
            continue
        rate = f" {moved / v['us'] / 1e6:5.2f} TB/s" if moved else ""
        ratio = f" {ref / v['us']:5.2f}x" if ref else ""
        print(f"  {label:{width}s} {v['us']:8.1f} us{ratio}{rate}")


def pointwise_case(N: int, C: int, H: int, K: int):
    """A C -> K 1x1 layer over N x H x H pixels (fp16, channels-last, on the GPU): (x, w, its fp32 output, the
    bytes in and out, and the GEMM view: x as [N*H*H, C], w as [C, K], the output as [N*H*H, K])."""
    import torch
    import torch.nn.functional as F

    cl = torch.channels_last
    x = torch.randn(N, C, H, H, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    w = (torch.randn(K, C, 1, 1, device="cuda") / C**0.5).half().contiguous(memory_format=cl)
    ref = F.conv2d(x.float(), w.float())
    moved = (x.numel() + ref.numel()) * 2
    return (x, w, ref, moved, x.permute(0, 2, 3, 1).reshape(-1, C), w.reshape(K, C).t(),
            ref.permute(0, 2, 3, 1).reshape(-1, K))


def depthwise_case(dims):
    """A depthwise layer ``dims`` = (N, C, H, W, R, stride, dilation), padded to keep its size at stride 1 (fp16,
    channels-last, on the GPU): (x, w, its fp32 output, the bytes in and out, the padding, its ConvProblem)."""
    import torch
    import torch.nn.functional as F
    from tilegemm.ops.conv2d.problem import ConvProblem, geometry_of

    N, C, H, W, R, s, d = dims
    cl = torch.channels_last
    pad = d * (R - 1) // 2
    x = torch.randn(N, C, H, W, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    w = (torch.randn(C, 1, R, R, device="cuda") * 0.3).half()
    ref = F.conv2d(x.float(), w.float(), None, s, pad, d, C)
    g = geometry_of(x.shape, w.shape, [s, s], [pad] * 4, [d, d], C)
    problem = ConvProblem(x, w, None, g, torch.float16, cl, "none", "ieee", False)
    return x, w, ref, (x.numel() + ref.numel()) * 2, pad, problem
