"""Shared fixtures: the device kernels run on, NaN-poisoned outputs, and the error check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tilegemm.core.runtime import interpreting, set_poisoning


@pytest.fixture(scope="session")
def device() -> str:
    return "cpu" if interpreting() else "cuda"


@pytest.fixture(autouse=True)
def poisoned_outputs():
    """Every kernel output starts as NaN, so an element a kernel forgets to write fails the check."""
    old = set_poisoning(True)
    yield
    set_poisoning(old)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(1234)


def crossed(names: str, *axes, ids=()):
    """``pytest.mark.parametrize(names, ...)`` over the cross product of ``axes``. Under the interpreter (CI's
    minutes) only the half whose value indices sum to an even number: where a third axis has two values or more,
    every pair of values of two axes still meets; on a GPU the whole cross. ``ids``: a function per axis (str
    where missing); a ``pytest.param`` value gives its values (one or several), id and marks."""
    import itertools

    name_of = [ids[i] if i < len(ids) and ids[i] else str for i in range(len(axes))]
    params = []
    for combo in itertools.product(*(list(enumerate(axis)) for axis in axes)):
        if interpreting() and sum(i for i, _ in combo) % 2:
            continue
        values, marks, labels = [], [], []
        for f, (_, v) in zip(name_of, combo):
            if isinstance(v, type(pytest.param(None))):  # pytest.param: several values, an id, marks of its own
                marks += v.marks
                values += v.values
                labels.append(v.id or f(v.values[0]))
            else:
                values.append(v)
                labels.append(f(v))
        params.append(pytest.param(*values, marks=marks, id="-".join(labels)))
    return pytest.mark.parametrize(names, params)


def fuzz_draw(test):
    """A GPU fuzz test's draw: the same examples each run (hypothesis derandomized), or, with
    ``$TILEGEMM_FUZZ_SEED`` set, the draw of that seed, so that a long run can be split over parallel processes
    with seeds of their own (``TILEGEMM_FUZZ_SEED=3 TILEGEMM_FUZZ_EXAMPLES=64 pytest -m gpu ...``)."""
    from hypothesis import seed

    value = os.environ.get("TILEGEMM_FUZZ_SEED")
    return seed(int(value))(test) if value else test


def spy_launches(monkeypatch, module, grids: list | None = None) -> list:
    """The names of the kernels ``module`` launches through its ``launch`` from now on (in order), and their
    grids into ``grids`` when given; the launches still run."""
    names = []
    real = module.launch

    def spy(kernel, grid, *args, **kwargs):
        names.append(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)
        if grids is not None:
            grids.append(grid)
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(module, "launch", spy)
    return names


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    from tilegemm.core.checks import relative_error

    return relative_error(out, ref)


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), "output has NaN: some element was never written"
    err = rel_err(out, ref)
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"


def kernels(op: str, dtype=None, pseudo: bool = True) -> list:
    """The registered kernels of ``op`` that take ``dtype`` (a torch dtype or a bench name such as "tf32"),
    as pytest params, then its pseudo kernels (``auto``): a newly registered kernel is tested without editing
    a list. A kernel that cannot run on this machine (a Gluon kernel under the interpreter) carries a skip
    mark saying why; it runs where it can (``pytest -m gpu`` on an sm_90 GPU)."""
    from tilegemm.core import registry
    from tilegemm.core.dtypes import dtype_name

    name = None if dtype is None else dtype_name(dtype)
    params = []
    for spec in registry.specs(op):
        if not spec.takes(name):
            continue
        reason = spec.unavailable_reason()
        params.append(pytest.param(spec.name, marks=pytest.mark.skip(reason=reason)) if reason else spec.name)
    return params + (list(registry.op(op).pseudo) if pseudo else [])


def run_kernel(fn):
    """``fn()``, or a skip where a kernel variant says it does not take this problem (a Gluon kernel and a
    layout or shape TMA cannot describe): such variants are checked on the problems they take elsewhere."""
    from tilegemm.core.registry import NotApplicable

    try:
        return fn()
    except NotApplicable as err:
        pytest.skip(str(err))


def mm(*args, **kwargs):
    """``tilegemm.matmul`` through :func:`run_kernel`: for tests parametrized over every registered kernel."""
    import tilegemm

    return run_kernel(lambda: tilegemm.matmul(*args, **kwargs))


def pytest_collection_modifyitems(config, items):
    if not interpreting():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu` on one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def compile_offline(tmp_path, source: str, argument, timeout: int = 600):
    """Run ``source`` (a script that compiles kernels for a GPU given by hand, e.g. sm_90) with the compiler
    instead of the interpreter, passing ``argument`` as JSON; returns the JSON its last stdout line holds.
    No GPU is needed: Triton ships ptxas. A fresh Triton cache under ``tmp_path`` keeps runs apart."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TILEGEMM_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    script = tmp_path / "compile.py"
    script.write_text(source)
    run = subprocess.run([sys.executable, str(script), json.dumps(argument)], env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


# Prepended to a compile_offline script that compiles kernels for sm_90: defines signature(),
# launch_signature(), specialized_signature(), cpu_problem() and compile_sm90() (Triton or Gluon kernels).
SM90 = textwrap.dedent(
    """
    import os, subprocess, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource


    def signature(kernel, flags, types, unit=(), aligned_ints=False):
        \"\"\"(sig, constexprs, attrs) for triton.compile: ``flags`` as constexprs, pointer types from ``types``
        (a dict, or one type for every ``*_ptr``; 16-byte aligned), the names in ``unit`` as the constexpr 1,
        alpha and beta fp32, every other argument i32 (multiples of 16 if ``aligned_ints``).\"\"\"
        sig, constexprs, attrs = {}, {}, {}
        for i, name in enumerate(kernel.arg_names):
            if name in flags:
                sig[name], constexprs[(i,)] = "constexpr", flags[name]
            elif name.endswith("_ptr"):
                sig[name] = types if isinstance(types, str) else types[name]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif name in unit:
                sig[name], constexprs[(i,)] = "constexpr", 1
            elif name in ("alpha", "beta"):
                sig[name] = "fp32"
            else:
                sig[name] = "i32"
                if aligned_ints:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        return sig, constexprs, attrs


    def launch_signature(kernel, args, kwargs):
        \"\"\"(sig, constexprs, attrs) for triton.compile from what a ``launch_args`` gives: ``kwargs`` as
        constexprs, floats fp32, ints i32, tensors (16-byte aligned) and host descriptors as Triton types them.\"\"\"
        import torch
        from triton.runtime.jit import mangle_type
        sig, constexprs, attrs = {}, {}, {}
        for i, name in enumerate(kernel.arg_names):
            param = kernel.params[i]
            # by keyword, positional, or left at its default (as Triton binds them); a runtime None is a constexpr
            if name in kwargs:
                val = kwargs[name]
            elif i < len(args):
                val = args[i]
            elif param.has_default:
                val = param.default
            else:
                raise TypeError(f"{kernel.__name__}: no value for parameter {name}")
            if param.is_constexpr:
                sig[name], constexprs[(i,)] = "constexpr", val
                continue
            if val is None:
                sig[name], constexprs[(i,)] = "constexpr", None
            elif isinstance(val, float):
                sig[name] = "fp32"
            elif isinstance(val, int):
                sig[name] = "i32"
            else:
                sig[name] = mangle_type(val)
                if isinstance(val, torch.Tensor):
                    attrs[(i,)] = [["tt.divisibility", 16]]
        return sig, constexprs, attrs


    def specialized_signature(kernel, args, kwargs):
        \"\"\"(sig, constexprs, attrs) for triton.compile as Triton specializes a launch with ``args`` (by position)
        and ``kwargs`` (constexprs): tensors as typed pointers, 16-byte aligned; floats fp32; ints i32, the value 1
        a constexpr and multiples of 16 marked so, but for the kernel's ``do_not_specialize`` names.\"\"\"
        import torch
        skip = {kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
        pointers = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32",
                    torch.int64: "*i64"}
        sig, constexprs, attrs = {}, {}, {}
        for i, name in enumerate(kernel.arg_names):
            if name in kwargs:
                sig[name], constexprs[(i,)] = "constexpr", kwargs[name]
                continue
            v = args[i]
            if isinstance(v, torch.Tensor):
                sig[name] = pointers[v.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(v, float):
                sig[name] = "fp32"
            elif name in skip:
                sig[name] = "i32"
            elif v == 1:
                sig[name], constexprs[(i,)] = "constexpr", 1
            else:
                sig[name] = "i32"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        return sig, constexprs, attrs


    def cpu_problem(dtype, layout, epilogue, n=512):
        \"\"\"An n^3 GemmProblem of CPU tensors (``dtype`` a torch dtype's name; ``layout`` "NN".."TT", T: a
        transposed view), with C, bias and GELU when ``epilogue``: what a launch_args needs offline.\"\"\"
        import torch
        from tilegemm.ops.matmul.problem import make_problems
        dt = getattr(torch, dtype)
        a = torch.empty(n, n, dtype=dt).T if layout[0] == "T" else torch.empty(n, n, dtype=dt)
        b = torch.empty(n, n, dtype=dt).T if layout[1] == "T" else torch.empty(n, n, dtype=dt)
        c = torch.empty(n, n, dtype=dt) if epilogue else None
        bias = torch.empty(n, dtype=dt) if epilogue else None
        return make_problems(a, b, torch.empty(n, n, dtype=dt), c, bias, 1.0, 0.5 if epilogue else 0.0,
                             "gelu" if epilogue else "none", "ieee", False)[0]


    def compile_sm90(kernel, sig, constexprs, attrs, num_warps, num_stages=None, gluon=True, **more):
        \"\"\"(compiled kernel, its PTX, what ``ptxas -v`` says about it) for sm_90; no GPU needed. ``more``: other
        compile options (``maxnreg``).\"\"\"
        source = (GluonASTSource if gluon else ASTSource)(kernel, sig, constexprs, attrs)
        options = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps, num_stages=num_stages)
        options.update(more)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        ptx = compiled.asm["ptx"]
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(90).path  # the one Triton chose its PTX version for (a GPU machine may name its own)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.ptx")
            with open(path, "w") as f:
                f.write(ptx)
            run = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                                 capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return compiled, ptx, run.stderr
    """
)


def rel_err_of_sums(out: torch.Tensor, ref: torch.Tensor, terms: torch.Tensor, K: int) -> float:
    """:func:`rel_err`, where sums that cancel (a few outputs, tiny random problems) are judged against the norm
    their terms' magnitudes give (``terms``: the same sums of absolute values; ``terms / sqrt(K)``), as the
    fuzz tests judge them; inf for NaN or inf in ``out``."""
    import math

    if not torch.isfinite(out).all():
        return float("inf")
    norm = max(ref.double().norm().item(), 0.5 * terms.double().norm().item() / math.sqrt(max(K, 1)), 1e-30)
    return (out.double() - ref.double()).norm().item() / norm


# --- shared by the contract tests (tests/*/test_*_contract.py) --------------------------------------------

CLEAR = (TypeError, ValueError)  # what bad input may raise: a clear error, never anything else
HERE = "cpu" if interpreting() else "cuda"  # where kernels run: the interpreter's CPU, or the GPU


@pytest.fixture
def keep_fragments(monkeypatch):
    """Layers and the loader keep the fragment layout on every device, not only where the fragment kernel runs
    (a Hopper GPU), so that its life beside the 4-bit parts is followed under the interpreter too."""
    from tilegemm.ops.grouped import dispatch as grouped
    from tilegemm.ops.w4a16 import dispatch, fits_fragments

    monkeypatch.setattr(dispatch, "keeps_fragments", lambda group_k, device, K: fits_fragments(group_k, K))
    monkeypatch.setattr(grouped, "keeps_fragments", lambda group_k, K, device: fits_fragments(group_k, K))


@pytest.fixture
def tensors_here():
    """Tensors made without a device go where the kernels run (a contract test's inputs)."""
    with torch.device(HERE):
        yield


def load_script(*parts: str):
    """The module of a script of the repository that is no package module (``tools/``, ``examples/``), by its path
    from the repository's root: ``load_script("tools", "w4a16_frag_sweep.py")``."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", *parts)
    spec = importlib.util.spec_from_file_location(os.path.splitext(parts[-1])[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hide_broken_torchvision() -> None:
    """A torchvision that does not match torch (its C ops missing: PyPI's CUDA build beside the CPU torch wheel)
    breaks transformers' model imports; make transformers see none."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001
        import transformers.utils as _tu
        import transformers.utils.import_utils as _iu

        _iu.is_torchvision_available = _tu.is_torchvision_available = lambda: False


_COPY_OPS = frozenset({"copy_", "clone", "_to_copy", "contiguous", "reshape", "flatten", "unflatten", "cat"})


def tensor_copies(fn) -> list:
    """The tensor copies ``fn()`` makes, as ``(op name, shape, strides, dtype)`` rows (of the source): aten's ``copy_``, ``clone``,
    ``_to_copy``, ``cat``, and reshapes or ``contiguous`` calls that gave new storage; inside tilegemm's registered
    ops too (their implementation runs under the same mode), but not a kernel launch's own (the interpreter copies
    arguments in and out)."""
    from torch._library.custom_ops import OPDEFS
    from torch.utils._python_dispatch import TorchDispatchMode

    import tilegemm.core.launch as launch_module

    launching = launch_module.launch.__code__

    def in_launch() -> bool:
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code is launching:
                return True
            frame = frame.f_back
        return False

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.rows = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace == "tilegemm":
                with self:
                    return OPDEFS[func.overloadpacket._qualified_op_name]._init_fn(*args, **kwargs)
            out = func(*args, **kwargs)
            name = func.overloadpacket.__name__
            if name in _COPY_OPS and not in_launch():
                src = args[1] if name == "copy_" else args[0][0] if name == "cat" else args[0]
                fresh = name in ("copy_", "clone", "_to_copy", "cat") or (
                    isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr()
                    != src.untyped_storage().data_ptr())
                if fresh:
                    self.rows.append((name, tuple(src.shape), src.stride(), src.dtype))
            return out

    mode = Copies()
    with mode:
        fn()
    return mode.rows
