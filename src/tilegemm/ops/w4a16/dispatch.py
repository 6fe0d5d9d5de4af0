"""``auto`` for ``tilegemm.w4a16.matmul``: the kernel for a call, and the launch of the kernel a call names
(``dequant_cublas``'s Triton half alone too, for the host fast path).

auto's thresholds, in the table below (the measurements behind each: docs/w4a16.md, "Configs and `auto`").
"""

from __future__ import annotations

import torch

from tilegemm.core import registry
from tilegemm.core.activations import torch_activation
from tilegemm.core.runtime import interpreting, new_output, on_device
from tilegemm.ops.w4a16.format import fits_fragments
from tilegemm.ops.w4a16.problem import W4A16Problem

# name: value  # why
FRAG_WGMMA_MAX_M = 512  # on Hopper, frag_wgmma up to here; above, dequant_cublas (cuBLAS's GEMM after one pass)
FRAG_WGMMA_NARROW_N = 3200  # from 129 rows, frag_wgmma only for weights of this many rows (N) or more: narrower
# ones make too few 128-row tiles to fill the GPU, where the pass plus cuBLAS wins (docs/w4a16.md, "auto")
GEMV_MAX_M = 2  # elsewhere gemv up to here: one program per row, the second reading the weight from L2
MMA_MAX_M = 128  # then mma up to here; above, dequant_cublas (cuBLAS's GEMM hides the weight's extra pass)

FRAG_KERNELS = ("frag_wgmma",)  # the kernels that read the weight's fragment layout
# act-order: x's inputs are reordered by one Triton gather (ops/w4a16/reorder.py), then the kernel auto picks for
# the natural-order weight runs, at every M: as CUDA graphs that ran well ahead of frag_wgmma reading x through perm
# (GATHER) at every M measured (docs/w4a16.md, "Act-order").
# GATHER stays for the op called with perm and kernel="frag_wgmma" named; auto never takes it.
GATHER_KERNELS = ("frag_wgmma",)  # the kernels that take perm when named


def frag_rows(M: int, N: int | None = None) -> bool:
    """Whether ``auto`` gives M rows against a weight of N rows (None: not known) to the fragment kernel where it
    can run."""
    return M <= FRAG_WGMMA_MAX_M and (M <= 128 or N is None or N >= FRAG_WGMMA_NARROW_N)


def choose(M: int, frag: bool = False, N: int | None = None) -> str:
    """The kernel for M rows against a weight of N rows; ``frag``: the fragment kernel can run (Hopper; every group
    length the format takes)."""
    if frag and frag_rows(M, N):
        return "frag_wgmma"
    if M <= GEMV_MAX_M:
        return "gemv"
    if M <= MMA_MAX_M:
        return "mma"
    return "dequant_cublas"


_FRAG_REASON: dict = {}  # device -> why the fragment kernel cannot run there ("" when it can), asked once


def frag_usable(group_k: int, device: torch.device, K: int | None = None) -> bool:
    """Whether ``auto`` may use the fragment kernel on ``device`` for a weight of group length ``group_k`` and ``K``
    inputs: a Hopper GPU with Gluon (not the interpreter) and a group length it takes (:func:`fits_fragments`)."""
    if device.type != "cuda" or not fits_fragments(group_k, K):
        return False
    reason = _FRAG_REASON.get(device)
    if reason is None:
        with on_device(device):  # (the kernel's check reads the current GPU's capability: asked of this one)
            reason = _FRAG_REASON[device] = registry.get("w4a16", "frag_wgmma").unavailable_reason() or ""
    return not reason


def keeps_fragments(group_k: int, device: torch.device, K: int) -> bool:
    """Whether a layer or a loader keeps the fragment layout of a weight (group length ``group_k``, ``K`` inputs) on
    ``device``: where ``auto`` may take the fragment kernel (:func:`frag_usable`). Elsewhere no call reads it and it
    would double the 4-bit parts' memory (a CPU, a GPU before Hopper, the interpreter)."""
    return frag_usable(group_k, torch.device(device), K)


def wants_frag(kernel: str, x2: torch.Tensor, w) -> bool:
    """Whether a call with 2-D activations ``x2`` and weight ``w`` runs, or under ``auto`` may run, a kernel that
    takes the fragment layout. While torch.compile traces: where the fragments were made before (``Int4Linear``
    keeps them as buffers where the kernel runs), whatever M; the op picks its kernel by M when it runs, so a
    dynamic token count is not guarded on (one graph for every M), and no packing enters the graph."""
    if torch.compiler.is_compiling():
        return (kernel in FRAG_KERNELS or kernel == "auto") and w._frag is not None
    # frag_usable first: where the kernel cannot run, M is not compared
    return kernel in FRAG_KERNELS or (kernel == "auto" and frag_usable(w.group_k, x2.device, w.shape[-1])
                                      and frag_rows(x2.shape[0], w.shape[-2]))


def gathers(p: W4A16Problem) -> bool:
    """Whether call ``p`` (its ``perm`` set: the op called with it) reads x through perm in the kernel: only where
    a kernel that takes perm is named and perm is contiguous (a valid weight may hold a strided view, which the
    kernel does not read); ``auto`` and the other kernels run on x reordered first."""
    return p.perm is not None and p.kernel in GATHER_KERNELS and p.perm.stride(0) == 1


def kernel_for(p: W4A16Problem) -> str:
    """The kernel that runs ``p``: the one it names, or ``auto``'s choice."""
    if p.kernel != "auto":
        return p.kernel
    return choose(p.M, p.fweight is not None and frag_usable(p.group_k, p.x.device, p.K), p.N)


def launcher(name: str):
    """The launch function of a registered w4a16 kernel (:func:`tilegemm.core.registry.launcher`)."""
    return registry.launcher("w4a16", name)


def forward(p: W4A16Problem) -> torch.Tensor:
    """The output of call ``p`` (``p.out`` unset): made, then written by the chosen kernel."""
    out = new_output((p.M, p.N), p.x.dtype, p.x.device)
    if p.M == 0:
        return out
    if p.x.shape[1] == 0:  # K = 0: the product is zero, as torch's (Linear(0, N) returns its bias)
        pre = torch.zeros(p.N, device=p.x.device) if p.bias is None else p.bias.float()
        return out.copy_(torch_activation(pre, p.activation).to(out.dtype).expand(p.M, p.N))
    kernel, perm = kernel_for(p), p.perm
    if perm is not None and not gathers(p):  # x's inputs reordered first (see GATHER_KERNELS), any strides
        from tilegemm.ops.w4a16.reorder import reorder_columns  # (a kernel module: imported when first needed)

        with on_device(p.x.device):
            x, perm = reorder_columns(p.x, perm), None
    else:
        x = p.x if p.x.stride(-1) == 1 else p.x.contiguous()
    p = W4A16Problem(x=x, qweight=p.qweight, scales=p.scales, zeros=p.zeros, bias=p.bias, out=out,
                     group_k=p.group_k, activation=p.activation,
                     upcast=x.dtype == torch.bfloat16 and interpreting(), fweight=p.fweight, fzs=p.fzs,
                     kernel=p.kernel, perm=perm)
    with on_device(x.device):
        launcher(kernel)(p)
    return out


def dequantized(p: W4A16Problem) -> torch.Tensor:
    """``dequant_cublas``'s Triton half alone on call ``p`` (on the GPU, M and K > 0): the weight dequantized to
    W ``[N, K]``, one launch; :func:`tilegemm.ops.w4a16.cublas_half.forward` is the rest."""
    from tilegemm.ops.w4a16 import dequant_cublas  # the module imports triton: here, when a call runs

    with on_device(p.x.device):
        return dequant_cublas.dequantized(p)
