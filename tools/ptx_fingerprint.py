"""Fingerprints of the sm_90 code of every shipped tilegemm kernel and config, compiled without a GPU.

For each kernel a rung (or ``auto``) can launch, each representative operand mode and each distinct
config from the kernels' default candidate lists and the shipped tuning tables (``tilegemm/tuned/*.json``),
this builds the launch the way the rung's own host code does (CPU tensors stand in for the GPU's),
specializes its arguments the way Triton's launcher does on a GPU (ints equal to 1 become constexprs,
multiples of 16 and 16-byte aligned pointers get ``tt.divisibility``), compiles it for sm_90, strips line
info, debug sections and comments from the PTX, and records a short sha1 of what is left:

    {"<kernel>/<mode>/<config>": "<12 hex digits>", ...}

Keys name the kernel by a logical name (the :data:`KERNELS` table below), never by its Python module, so
they match across a refactor that moves modules. Equal hashes at two commits mean the GPU runs the same
instructions.

    TRITON_INTERPRET=0 TILEGEMM_INTERPRET=0 PYTHONPATH=src python tools/ptx_fingerprint.py --out before.json
    python tools/ptx_fingerprint.py --compare before.json after.json     # exit 1 on any difference

Options: ``--jobs N`` compiles in N processes; ``--dump DIR`` writes each kernel's stripped PTX (to diff);
``--list`` prints the keys without compiling; ``--filter S`` keeps keys containing S (repeatable).
Every run compiles into a fresh private Triton cache, so nothing is taken from an earlier compile. The
pipeline stops after the PTX (``--ptxas`` also assembles it: slower, same fingerprints). No GPU or CUDA
driver is needed.

After modules move, only the two tables below (:data:`KERNELS`, :data:`HOST`) need editing.
"""

from __future__ import annotations

# ======================================================================================================
# THE ONLY PLACE THAT NAMES TILEGEMM MODULES. Everything of tilegemm the tool uses is resolved from these
# two tables ("module.path:attribute", or "module.path" for a module); nothing else imports tilegemm.
# ======================================================================================================

# Kernels (@triton.jit / @gluon.jit), by the logical name the fingerprint keys use.
KERNELS = {
    "naive": "tilegemm.ops.matmul.naive:matmul_naive_kernel",
    "grouped": "tilegemm.ops.matmul.grouped:matmul_grouped_kernel",  # also autotuned's, and split_k's at SPLIT_K=1
    "split_k": "tilegemm.ops.matmul.split_k:matmul_split_k_kernel",
    "split_k_reduce": "tilegemm.ops.matmul.split_reduce:split_k_reduce_kernel",  # a wide split's second launch
    "persistent_tma": "tilegemm.ops.matmul.persistent_tma:matmul_persistent_tma_kernel",
    "gluon_f16": "tilegemm.ops.matmul.gluon_f16:matmul_f16_coop_kernel",
    "gluon_fp8_overlap": "tilegemm.ops.matmul.gluon_fp8:matmul_fp8_overlap_kernel",
    "gluon_fp8_ws": "tilegemm.ops.matmul.gluon_fp8:matmul_fp8_ws_kernel",
    "gluon_tf32": "tilegemm.ops.matmul.gluon_tf32:matmul_tf32_regs_kernel",
    "copy_contiguous": "tilegemm.ops.guide.kernels:copy_contiguous_kernel",
    "copy_strided": "tilegemm.ops.guide.kernels:copy_strided_kernel",
    "grey": "tilegemm.ops.guide.kernels:grey_kernel",
}

# Host code the tool calls to build the launches as the rungs build them.
HOST = {
    "make_problems": "tilegemm.ops.matmul.problem:make_problems",
    "fixed_config": "tilegemm.ops.matmul.configs:fixed_config",
    "autotune_configs": "tilegemm.ops.matmul.configs:autotune_configs",
    "prune_for": "tilegemm.ops.matmul.configs:prune_for",
    "naive.run": "tilegemm.ops.matmul.naive:run",  # run(p, config): launches through tilegemm's launch()
    "grouped.run": "tilegemm.ops.matmul.grouped:run",
    "autotuned.run": "tilegemm.ops.matmul.autotuned:run",
    "split_k.run": "tilegemm.ops.matmul.split_k:run",
    "split_k.configs": "tilegemm.ops.matmul.split_k:configs",  # configs(p)
    "persistent_tma.configs": "tilegemm.ops.matmul.persistent_tma:configs",  # configs(dtype_bytes, mma_operands)
    "persistent_tma.triton_launch_args": "tilegemm.ops.matmul.persistent_tma:triton_launch_args",
    "persistent_tma.why_not": "tilegemm.ops.matmul.persistent_tma:why_not",
    "persistent_tma.GLUON_CONFIG_KEYS": "tilegemm.ops.matmul.persistent_tma:GLUON_CONFIG_KEYS",
    # Gluon kernel modules (CONFIG_KEY, configs(out_element_size), why_not(p), launch_args(p, cfg, num_sms)),
    # in the order persistent_tma.gluon_kernel_for tries them.
    "gluon_fp8": "tilegemm.ops.matmul.gluon_fp8",
    "gluon_tf32": "tilegemm.ops.matmul.gluon_tf32",
    "gluon_f16": "tilegemm.ops.matmul.gluon_f16",
    "copy_flat": "tilegemm.ops.guide.kernels:copy_flat",  # copy_flat(x, out)
    "grey_planar": "tilegemm.ops.guide.kernels:grey_planar",  # grey_planar(img, out)
    "tuned_json": "tilegemm:tuned/*.json",  # the shipped tuning tables: a glob under the package's folder
}

# ======================================================================================================

import os  # noqa: E402

# Compiled code, never the interpreter (set before triton or tilegemm is imported).
os.environ["TRITON_INTERPRET"] = "0"
os.environ["TILEGEMM_INTERPRET"] = "0"

import argparse  # noqa: E402
import glob  # noqa: E402
import hashlib  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402

NUM_SMS = 132  # H100 SXM and H200: the persistent kernels' NUM_SMS constexpr
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "leaky_relu")  # besides "none"

# The config part of a key: these launch arguments, in this order, where the launch passes them. (The
# rest of a launch's constexprs follow from the mode; a key that two different compiles would share is
# an error, see :func:`plan`.)
CONFIG_PARAMS = {
    "naive": ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"),
    "grouped": ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"),
    "split_k": ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SLICES", "APART", "num_warps", "num_stages"),
    "split_k_reduce": ("BLOCK_M", "BLOCK_N", "PLANES", "num_warps"),
    "persistent_tma": ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SERPENTINE", "FLATTEN", "WARP_SPECIALIZE",
                       "HOST_DESC", "num_warps", "num_stages"),
    "gluon_f16": ("BLOCK_M", "BLOCK_N", "BLOCK_K", "STAGES", "SHARED_OUT", "GROUP_M", "SERPENTINE", "num_warps"),
    "gluon_fp8_overlap": ("BLOCK_M", "BLOCK_N", "BLOCK_K", "STAGES", "GROUP_M", "num_warps"),
    "gluon_fp8_ws": ("BLOCK_M", "BLOCK_N", "BLOCK_K", "STAGES", "GROUP_M", "SERPENTINE", "PRODUCER_WARPS",
                     "num_warps"),
    "gluon_tf32": ("BLOCK_R", "BLOCK_S", "BLOCK_K", "STAGES", "GROUP_M", "num_warps"),
    "copy_contiguous": ("BLOCK", "num_warps"),
    "copy_strided": ("BLOCK", "num_warps"),
    "grey": ("BLOCK", "STREAM", "num_warps"),
}


def resolve(target: str):
    """The object a table entry names: ``module.path:attr`` (dotted attrs allowed) or ``module.path``."""
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


def host(name: str):
    return resolve(HOST[name])


def code_of(ptx: str) -> str:
    """The instructions of a PTX file: no debug sections, line info or comments."""
    kept = []
    for line in ptx.split(".section")[0].splitlines():
        t = line.strip()
        if not t or t.startswith((".loc", ".file", "//", "$L__tmp", "$L__func")):
            continue
        kept.append(re.sub(r"\s+//.*", "", t))
    return "\n".join(kept)


def fingerprint(code: str) -> str:
    return hashlib.sha1(code.encode()).hexdigest()[:12]


# --- operand modes -------------------------------------------------------------------------------------

SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float8_e4m3fn": "fp8e4m3",
         "float8_e5m2": "fp8e5m2", "float64": "fp64", "uint8": "u8", "int8": "i8", "int16": "i16",
         "int32": "i32", "int64": "i64"}
DEFAULT_OUT = {"float8_e4m3fn": "bfloat16", "float8_e5m2": "bfloat16"}


def _divisor(value: int) -> int:
    value = abs(value)
    return 16 if value == 0 else min(16, value & -value)


@dataclass(frozen=True)
class Mode:
    """A GEMM problem class: operand dtypes, precision, layout, epilogue and what Triton specializes on in
    the sizes (equal to 1, largest power of two dividing them up to 16)."""
    a: str  # torch dtype name
    b: str
    out: str
    tf32: bool = False
    layout: str = "NN"  # A then B: N row-major, T column-major
    fast: bool = False  # fp8 fast accumulation
    epilogue: str = "plain"  # plain | epi (C, bias, gelu; fp8 vector scales) | act-<name> (bias and <name>)
    M: int = 512
    N: int = 512
    K: int = 512

    @property
    def name(self) -> str:
        base = "tf32" if self.tf32 else SHORT[self.a] if self.a == self.b else f"{SHORT[self.a]}x{SHORT[self.b]}"
        s = base + ("+fast" if self.fast else "") + "-" + self.layout
        if self.out != DEFAULT_OUT.get(self.a, self.a):
            s += ">" + SHORT[self.out]
        if self.epilogue == "epi":
            s += "+epi"
        elif self.epilogue.startswith("act-"):
            s += "+bias+" + self.epilogue[4:]
        shape = "".join(f"{d}{'1' if v == 1 else f'd{_divisor(v)}'}" for d, v in zip("MNK", (self.M, self.N, self.K))
                        if v == 1 or v % 16)
        return s + ("@" + shape if shape else "")

    def problem(self):
        """The GemmProblem of this mode, over CPU tensors (what a launch needs offline)."""
        import torch

        dt = lambda n: getattr(torch, n)  # noqa: E731
        M, N, K = self.M, self.N, self.K
        a = torch.empty(K, M, dtype=dt(self.a)).T if self.layout[0] == "T" else torch.empty(M, K, dtype=dt(self.a))
        b = torch.empty(N, K, dtype=dt(self.b)).T if self.layout[1] == "T" else torch.empty(K, N, dtype=dt(self.b))
        out = torch.empty(M, N, dtype=dt(self.out))
        c = bias = None
        act, beta = "none", 0.0
        if self.epilogue == "epi":
            c, bias, act, beta = torch.empty(M, N, dtype=out.dtype), torch.empty(N, dtype=out.dtype), "gelu", 0.5
        elif self.epilogue.startswith("act-"):
            bias, act = torch.empty(N, dtype=out.dtype), self.epilogue[4:]
        scales = (None, 0, None, 0)
        if a.element_size() == 1:
            if self.epilogue == "epi":  # a scale per row of A and per column of B
                scales = (torch.empty(M), 1, torch.empty(N), 1)
            else:  # one scale per tensor
                scales = (torch.empty(()), 0, torch.empty(()), 0)
        precision = "tf32" if self.tf32 else "ieee"
        return host("make_problems")(a, b, out, c, bias, 1.0, beta, act, precision, False, scales, self.fast)[0]


def mode(a, layout="NN", b=None, out=None, tf32=False, **kw) -> Mode:
    b = b or a
    return Mode(a, b, out or DEFAULT_OUT.get(a, a), tf32, layout, **kw)


FP16, BF16, FP32, FP8 = "float16", "bfloat16", "float32", "float8_e4m3fn"
LAYOUTS = ("NN", "NT", "TN", "TT")

# Pointer kernels (naive, grouped/autotuned, split_k): the five MMA operand modes (as loaded, tf32 swapped and
# A through registers, fp8 as loaded and swapped), bf16, IEEE fp32, tf32 with both operands K-major, 16-bit TT.
POINTER_MODES = [mode(FP16), mode(BF16), mode(FP16, "TT"), mode(FP32), mode(FP32, "NN", tf32=True),
                 mode(FP32, "NT", tf32=True), mode(FP32, "TT", tf32=True), mode(FP8, "NT"), mode(FP8, "NN")]
# persistent_tma (Triton kernel and the Gluon kernels it offers): every layout of the 16-bit and tf32 operands,
# IEEE fp32, fp8 as loaded (promoted and fast) and swapped.
TMA_MODES = ([mode(d, lay) for d in (FP16, BF16) for lay in LAYOUTS] + [mode(FP32)]
             + [mode(FP32, lay, tf32=True) for lay in LAYOUTS]
             + [mode(FP8, "NT"), mode(FP8, "NT", fast=True), mode(FP8, "NN"), mode(FP8, "NT", out=FP32)])
# Modes whose persistent_tma defaults are also compiled with pointers (HOST_DESC=False) as well as descriptors.
POINTER_TMA_MODES = {mode(FP16).name, mode(FP32, "NN", tf32=True).name, mode(FP8, "NT").name}

COPY_DTYPES = ("uint8", "float16", "bfloat16", "float32", "float64", "int32", "int64")
GREY_DTYPES = ("uint8", "float16", "bfloat16", "float32")


# --- launches ------------------------------------------------------------------------------------------


@dataclass
class Launch:
    kernel: str  # logical name (KERNELS)
    mode: str
    args: tuple
    kwargs: dict
    origin: str  # where the config came from (for --list)


_captured: list | None = None


def _install_capture() -> None:
    """Make ``kernel[grid](...)`` record (kernel, args, kwargs) instead of launching: the rungs' host code
    then runs as on a GPU and the tool sees exactly what it would launch."""
    from triton.runtime.jit import JITFunction

    def run(self, *args, grid, warmup, **kwargs):
        if _captured is None:
            raise RuntimeError("a kernel launch outside the fingerprint tool's capture")
        _captured.append((self, args, kwargs))
        return None

    JITFunction.run = run


_names: dict = {}


def kernel_name(kernel) -> str:
    if not _names:
        for name, target in KERNELS.items():
            _names[id(resolve(target))] = name
    name = _names.get(id(kernel))
    if name is None:
        raise RuntimeError(f"a launch of {kernel!r}, which is not in the KERNELS table")
    return name


def captured(fn, mode_name: str, origin: str) -> list[Launch]:
    global _captured
    _captured = []
    try:
        fn()
        return [Launch(kernel_name(k), mode_name, args, kwargs, origin) for k, args, kwargs in _captured]
    finally:
        _captured = None


def returned(launch_args, mode_name: str, origin: str) -> Launch:
    kernel, _grid, args, kwargs = launch_args
    return Launch(kernel_name(kernel), mode_name, tuple(args), dict(kwargs), origin)


def pointer_launches(m: Mode, origin: str, first_only: bool = False) -> list[Launch]:
    """naive, grouped (its fixed config and autotuned's candidates) and split_k (its candidates over every
    M bucket) for mode ``m``, launched through the rungs' run()."""
    p = m.problem()
    out = captured(lambda: host("naive.run")(p, None), m.name, "naive:fixed_config")
    out += captured(lambda: host("grouped.run")(p, None), m.name, "grouped:fixed_config")
    cands = host("prune_for")(host("autotune_configs")(), p.a.element_size())
    for cfg in cands[:1] if first_only else cands:
        out += captured(lambda: host("autotuned.run")(p, dict(cfg)), m.name, "autotuned:autotune_configs")
    seen = []
    for bucket_m in (16, 32, 64, 128, 256):  # split_k's tiles per M bucket, every split (1 is grouped's)
        bp = replace(m, M=bucket_m, N=128, K=2048, epilogue="plain").problem()
        for cfg in host("split_k.configs")(bp):
            if cfg not in seen:
                seen.append(cfg)
    split = [c for c in seen if c["SPLIT_K"] > 1]
    for cfg in split[:1] if first_only else seen:
        out += captured(lambda: host("split_k.run")(p, dict(cfg)), m.name, "split_k:configs")
    return out


def gluon_for(p):
    """The Gluon module persistent_tma offers for ``p`` (gluon_kernel_for, without asking for a GPU)."""
    for name in ("gluon_fp8", "gluon_tf32", "gluon_f16"):
        module = host(name)
        if module.why_not(p) is None:
            return module
    return None


def tma_launches(m: Mode, origin: str, first_only: bool = False) -> list[Launch]:
    """persistent_tma's candidates for mode ``m``: its Triton kernel's configs and the Gluon kernel's."""
    p = m.problem()
    reason = host("persistent_tma.why_not")(p)
    if reason is not None:
        raise RuntimeError(f"{m.name}: persistent_tma cannot describe it: {reason}")
    cfgs = host("persistent_tma.configs")(p.a.element_size(), p.mma_operands)
    if m.name in POINTER_TMA_MODES and not first_only:
        cfgs = cfgs + [dict(c, HOST_DESC=False) for c in cfgs]
    launch_args = host("persistent_tma.triton_launch_args")
    out = [returned(launch_args(p, dict(cfg), NUM_SMS), m.name, origin) for cfg in (cfgs[:1] if first_only else cfgs)]
    gluon = gluon_for(p)
    if gluon is not None:
        gcfgs = gluon.configs(p.out.element_size())
        if first_only:  # the first config of each kernel the module has
            firsts = {}
            for cfg in gcfgs:
                firsts.setdefault(gluon.launch_args(p, dict(cfg), NUM_SMS)[0], cfg)
            gcfgs = list(firsts.values())
        out += [returned(gluon.launch_args(p, dict(cfg), NUM_SMS), m.name, origin) for cfg in gcfgs]
    return out


def guide_launches() -> list[Launch]:
    import torch

    out = []
    for dt in COPY_DTYPES:
        t = getattr(torch, dt)
        x = torch.empty(256, 384, dtype=t)
        out += captured(lambda: host("copy_flat")(x, torch.empty_like(x)), f"{SHORT[dt]}-contiguous", "copy_flat")
        xt = torch.empty(384, 256, dtype=t).T
        out += captured(lambda: host("copy_flat")(xt, torch.empty(xt.shape, dtype=t)), f"{SHORT[dt]}-T2d", "copy_flat")
        xp = torch.empty(8, 48, 64, dtype=t).permute(2, 0, 1)
        out += captured(lambda: host("copy_flat")(xp, torch.empty(xp.shape, dtype=t)), f"{SHORT[dt]}-perm3d",
                        "copy_flat")
    for dt in GREY_DTYPES:
        t = getattr(torch, dt)
        planar = torch.empty(2, 3, 256, 384, dtype=t)
        out += captured(lambda: host("grey_planar")(planar, torch.empty(2, 256, 384, dtype=t)), f"{SHORT[dt]}-planar",
                        "grey_planar")
        last = torch.empty(2, 256, 384, 3, dtype=t).permute(0, 3, 1, 2)
        out += captured(lambda: host("grey_planar")(last, torch.empty(2, 256, 384, dtype=t)),
                        f"{SHORT[dt]}-channels_last", "grey_planar")
    return out


# --- the shipped tuning tables -------------------------------------------------------------------------


def tuned_files() -> list[str]:
    package, _, pattern = HOST["tuned_json"].partition(":")
    root = os.path.dirname(importlib.import_module(package).__file__)
    return sorted(glob.glob(os.path.join(root, pattern)))


def _proxy(size: int) -> int:
    """A size Triton specializes as it does ``size`` (1; the largest power of two up to 16 dividing it)."""
    return size if size <= 1024 else 1024 + size % 16


# The dtype vocabulary of the tuned tables (tilegemm.core.dtypes) in torch's names, which the modes use.
TORCH_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp8_e4m3": "float8_e4m3fn",
               "fp8_e5m2": "float8_e5m2"}


def mode_of_key(key: str) -> tuple[str, Mode]:
    """(rung, mode) of a tuned-table key ``rung|M..|N..|K..|dtype|out dtype|layout``."""
    rung, m, n, k, dtype, out, layout = key.split("|")
    fast = dtype.endswith("+fast")
    dtype = dtype.removesuffix("+fast")
    tf32 = dtype == "tf32"
    a, _, b = ("float32" if tf32 else dtype).partition("x")
    a, b, out = (TORCH_NAMES.get(name, name) for name in (a, b, out))  # tilegemm-tuned/2 keys: fp16, fp8_e4m3
    if set(layout) - set("NT") or len(layout) != 2:
        raise ValueError(f"{key}: layout {layout!r} has no mode here")
    sizes = (_proxy(int(m[1:])), _proxy(int(n[1:])), _proxy(int(k[1:])))
    return rung, Mode(a, b or a, out, tf32, layout, fast, "plain", *sizes)


def tuned_launches(path: str) -> list[Launch]:
    with open(path) as f:
        entries = json.load(f)["entries"]
    gluon_keys = host("persistent_tma.GLUON_CONFIG_KEYS")
    gluon_by_key = {}
    for name in ("gluon_fp8", "gluon_tf32", "gluon_f16"):
        gluon_by_key[host(name).CONFIG_KEY] = host(name)
    missing = set(gluon_keys) - set(gluon_by_key)
    if missing:
        raise RuntimeError(f"persistent_tma knows Gluon config keys the HOST table has no module for: {missing}")
    out = []
    origin = os.path.basename(path)
    for key, cfg in sorted(entries.items()):
        if key.count("|") != 6:
            continue  # a batched class (a |B.. field): its problem is not a 2-D one this tool builds
        rung, m = mode_of_key(key)
        if rung == "auto":
            continue  # {"rung": ...}: a choice between rungs, no kernel config
        p = m.problem()
        if rung in ("autotuned", "split_k", "grouped", "naive"):
            out += captured(lambda: host(f"{rung}.run")(p, dict(cfg)), m.name, f"{origin}:{rung}")
        elif rung == "persistent_tma":
            gkeys = [k for k in gluon_keys if cfg.get(k)]
            if gkeys:
                module = gluon_by_key[gkeys[0]]
                reason = module.why_not(p)
                if reason is not None:
                    raise RuntimeError(f"{origin}: {key}: a {gkeys[0]} config for a problem it does not take: {reason}")
                out.append(returned(module.launch_args(p, dict(cfg), NUM_SMS), m.name, f"{origin}:{rung}"))
            else:
                launch_args = host("persistent_tma.triton_launch_args")
                out.append(returned(launch_args(p, dict(cfg), NUM_SMS), m.name, f"{origin}:{rung}"))
        else:
            raise RuntimeError(f"{origin}: {key}: unknown rung {rung!r}")
    return out


def all_launches() -> list[Launch]:
    out = []
    for m in POINTER_MODES:
        out += pointer_launches(m, "defaults")
    for m in TMA_MODES:
        out += tma_launches(m, "persistent_tma:configs")
    # Epilogues: C, bias and GELU (fp8: per-row and per-column scales) in every mode, with each kernel's first
    # config; every other activation (with a bias) in each kernel family's first mode.
    for modes, fn in ((POINTER_MODES, pointer_launches), (TMA_MODES, tma_launches)):
        for i, m in enumerate(modes):
            variants = ["epi"] + ([f"act-{a}" for a in ACTIVATIONS if a != "gelu"] if i == 0 else [])
            for v in variants:
                out += fn(replace(m, epilogue=v), "epilogue", first_only=True)
    for path in tuned_files():
        out += tuned_launches(path)
    out += guide_launches()
    return out


# --- compile specs ---------------------------------------------------------------------------------------

_backend = None


def target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


def compile_spec(launch: Launch):
    """(signature, constexprs, attrs, options) as JITFunction.run would compile this launch on an sm_90 GPU."""
    global _backend
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    if _backend is None:
        _backend = make_backend(target())
    kernel = resolve(KERNELS[launch.kernel])
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(kernel.signature, kernel.params, _backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(_backend, kwargs, bound_args, specialization, options)
    return signature, constexprs, attrs, dict(options.__dict__)


def key_of(launch: Launch) -> str:
    kw = launch.kwargs
    config = ",".join(f"{k}={kw[k]}" for k in CONFIG_PARAMS[launch.kernel] if k in kw)
    return f"{launch.kernel}/{launch.mode}/{config}"


def _canonical(spec) -> str:
    signature, constexprs, attrs, options = spec
    return json.dumps([signature, sorted((str(k), repr(v)) for k, v in constexprs.items()),
                       sorted((str(k), repr(v)) for k, v in attrs.items()),
                       sorted((k, repr(v)) for k, v in options.items())])


def plan(filters: list[str]) -> tuple[dict, dict]:
    """{key: (kernel, spec)} of the distinct compiles, and {key: origins}. Two launches under one key must
    compile the same thing (else the key leaves out a config parameter: an error)."""
    _install_capture()
    jobs, origins, canon = {}, {}, {}
    for launch in all_launches():
        key = key_of(launch)
        if filters and not any(f in key for f in filters):
            continue
        spec = compile_spec(launch)
        c = _canonical(spec)
        if key in canon and canon[key] != c:
            raise RuntimeError(f"{key}: two launches with different compiles under one key ({launch.origin} and "
                               f"{origins[key]}): add the parameter that differs to CONFIG_PARAMS")
        canon[key] = c
        jobs[key] = (launch.kernel, spec)
        origins.setdefault(key, [])
        if launch.origin not in origins[key]:
            origins[key].append(launch.origin)
    if not filters:
        unused = set(KERNELS) - {k.split("/")[0] for k in jobs}
        if unused:
            raise RuntimeError(f"kernels in the KERNELS table that nothing fingerprints: {sorted(unused)}")
    return jobs, origins


# --- compiling -----------------------------------------------------------------------------------------


def _no_ptxas(backend, stages, options, language, capability) -> None:
    """Triton's pipeline hook: stop after the PTX (the fingerprint's input), leaving ptxas out (about a third
    of the compile time). The cubin stage gives an empty binary; nothing here loads it."""
    stages["cubin"] = lambda src, metadata: b""


def compile_one(job) -> tuple[str, str, str, float, list[str]]:
    """(key, fingerprint, stripped PTX, seconds, lines naming a module or file) of one compile."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    key, kernel_name_, (signature, constexprs, attrs, options), ptxas = job
    knobs.runtime.add_stages_inspection_hook = None if ptxas else _no_ptxas
    kernel = resolve(KERNELS[kernel_name_])
    source_cls = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source_cls
    t0 = time.time()
    compiled = triton.compile(source_cls(kernel, signature, constexprs, attrs), target=target(), options=options)
    code = code_of(compiled.asm["ptx"])
    # Module paths or file names left in the code would make a move of a module change the fingerprint.
    leaks = [line for line in code.splitlines() if re.search(r"tilegemm|\.py\b", line)]
    return key, fingerprint(code), code, time.time() - t0, leaks


def _dump_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=,+@>-]", "_", key.replace("/", "__")) + ".ptx"


def run(args) -> int:
    # A private, fresh Triton cache: everything compiles, and the stubbed cubins (see _no_ptxas) never reach
    # the user's cache.
    cache = tempfile.mkdtemp(prefix="ptx_fingerprint_cache_")
    os.environ["TRITON_CACHE_DIR"] = cache
    try:
        return _run(args)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _run(args) -> int:
    t0 = time.time()
    jobs, origins = plan(args.filter or [])
    if args.list:
        for key in sorted(jobs):
            print(key, " <- ", "; ".join(origins[key]))
        print(f"{len(jobs)} distinct compiles", file=sys.stderr)
        return 0
    work = [(key, kernel, spec, args.ptxas) for key, (kernel, spec) in sorted(jobs.items())]
    print(f"{len(work)} distinct compiles planned in {time.time() - t0:.1f}s; compiling with {args.jobs} "
          f"process(es)", file=sys.stderr)
    prints, seconds, leaks, done = {}, {}, {}, 0
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)

    def collect(result):
        nonlocal done
        key, h, code, secs, leaked = result
        prints[key], seconds[key] = h, secs
        if leaked:
            leaks[key] = leaked
        done += 1
        if args.dump:
            with open(os.path.join(args.dump, _dump_name(key)), "w") as f:
                f.write(code + "\n")
        if done % 25 == 0 or done == len(work):
            print(f"  {done}/{len(work)} compiled, {time.time() - t0:.0f}s", file=sys.stderr)

    if args.jobs <= 1:
        for job in work:
            collect(compile_one(job))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for result in pool.map(compile_one, work, chunksize=4):
                collect(result)
    text = json.dumps(dict(sorted(prints.items())), indent=1) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    kernels = {k.split("/")[0] for k in prints}
    modes = {tuple(k.split("/")[:2]) for k in prints}
    slowest = sorted(seconds, key=seconds.get, reverse=True)[:5]
    print("slowest: " + "; ".join(f"{k} {seconds[k]:.1f}s" for k in slowest), file=sys.stderr)
    print(f"{len(prints)} fingerprints ({len(kernels)} kernels, {len(modes)} kernel/mode pairs) in "
          f"{time.time() - t0:.0f}s ({sum(seconds.values()):.0f}s of compiling)", file=sys.stderr)
    for key, lines in sorted(leaks.items()):
        print(f"WARNING {key}: the PTX names a module or file: {lines[:3]}", file=sys.stderr)
    return 1 if leaks else 0


def compare(path_a: str, path_b: str) -> int:
    with open(path_a) as f:
        a = json.load(f)
    with open(path_b) as f:
        b = json.load(f)
    equal = sorted(k for k in a if k in b and a[k] == b[k])
    different = sorted(k for k in a if k in b and a[k] != b[k])
    only_a = sorted(set(a) - set(b))
    only_b = sorted(set(b) - set(a))
    for k in different:
        print(f"DIFFERENT {k}: {a[k]} -> {b[k]}")
    for k in only_a:
        print(f"MISSING in {path_b}: {k}")
    for k in only_b:
        print(f"MISSING in {path_a}: {k}")
    print(f"{len(equal)} equal, {len(different)} different, {len(only_a)} only in {path_a}, "
          f"{len(only_b)} only in {path_b}")
    return 1 if different or only_a or only_b else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the fingerprints (JSON) here; default: stdout")
    ap.add_argument("--dump", help="also write each kernel's stripped PTX into this folder (to diff)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes (default: CPUs)")
    ap.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                    help="compare two fingerprint files; exit 1 on any different or missing key")
    ap.add_argument("--list", action="store_true", help="print the keys (and where their configs come from)")
    ap.add_argument("--filter", action="append", help="only keys containing this string (repeatable)")
    ap.add_argument("--ptxas", action="store_true",
                    help="also assemble each kernel with ptxas (slower; the fingerprints are the same)")
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
