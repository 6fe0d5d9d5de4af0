"""Where kernels run: compiled on a CUDA GPU, or under Triton's interpreter on the CPU.

Triton decides between its compiler and its interpreter when a function is decorated with
``@triton.jit``, by reading ``TRITON_INTERPRET``. tilegemm therefore imports no kernel module at
import time; :func:`ensure_backend` settles the choice once, sets ``TRITON_INTERPRET`` to match, and
only then are kernel modules imported (see :mod:`tilegemm.core.registry`).

The choice, in order:

1. ``TILEGEMM_INTERPRET=1`` or ``=0`` forces the interpreter or the compiler.
2. ``TRITON_INTERPRET=1`` (set by the user before anything ran) means the interpreter.
3. Otherwise the interpreter is used exactly when torch sees no CUDA GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings

log = logging.getLogger("tilegemm")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of Python ints on the host. ``triton.cdiv`` is a JIT function: calling it from Python
    costs microseconds (its argument handling), and a call's host path makes dozens of such divisions."""
    return -(-a // b)

_FORK_LOCKS: list = []


def fork_safe(lock):
    """``lock``, registered to be made anew (unlocked) in a child process forked while another thread held it: the
    child has only the forking thread, so a lock held by any other would never be released there."""
    _FORK_LOCKS.append(lock)
    return lock


def _unlock_in_child() -> None:
    for lock in _FORK_LOCKS:
        if getattr(lock, "_is_owned", lambda: False)():  # an RLock the forking thread holds: its block releases it
            continue
        reinit = getattr(lock, "_at_fork_reinit", None)  # (CPython's own hook, as logging's locks use it)
        if reinit is not None:
            reinit()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_unlock_in_child)

_lock = fork_safe(threading.Lock())
_interpret: bool | None = None

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class InterpreterWarning(UserWarning):
    """Kernels run under Triton's interpreter: results are exact, timings mean nothing."""


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None or not value.strip():  # (set empty, "TILEGEMM_INTERPRET= cmd": as if unset)
        return None
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"{name}={value!r}: expected 1 or 0 (or true/false, yes/no, on/off)")


def _forced() -> bool | None:
    """The backend the environment asks for: TILEGEMM_INTERPRET=1/0, else TRITON_INTERPRET=1; or None."""
    forced = _env_flag("TILEGEMM_INTERPRET")
    if forced is None and _env_flag("TRITON_INTERPRET"):
        forced = True
    return forced


def _decide() -> bool:
    forced = _forced()
    if forced is not None:
        return forced
    import torch

    # is_available() asks the driver for a device count; it does not create a CUDA context.
    return not torch.cuda.is_available()


def preselect() -> None:
    """Called when tilegemm is imported: settle the backend now if that needs no GPU query.

    Triton's own library (``tl.cdiv``, ...) is decorated when triton is imported, and torch imports
    triton on its own (``torch.compile``), so ``TRITON_INTERPRET`` is best set before anything runs.
    That is possible without touching a GPU when an env var forces the choice or torch is a CPU-only
    build; otherwise the choice waits for the first kernel.
    """
    global _interpret
    if _interpret is not None:
        return
    forced = _forced()
    if forced is None:
        import torch

        if not torch.backends.cuda.is_built():
            forced = True
    if forced is not None:
        with _lock:
            _interpret = forced
            os.environ["TRITON_INTERPRET"] = "1" if forced else "0"


def _check_triton_mode(interpret: bool) -> None:
    """Raise if triton was imported in the other mode: its library would not match our kernels."""
    import sys

    if "triton.language" not in sys.modules:
        return
    import triton.language as tl

    stdlib_interpreted = type(tl.cdiv).__name__ == "InterpretedFunction"
    if stdlib_interpreted != interpret:
        want = "1" if interpret else "0"
        # Triton reads TRITON_INTERPRET when it is imported; TILEGEMM_INTERPRET alone came too late for it.
        how = (f"TILEGEMM_INTERPRET={want} is set, but triton reads TRITON_INTERPRET when it is imported: set "
               f"TRITON_INTERPRET={want} as well" if _env_flag("TILEGEMM_INTERPRET") == interpret
               else f"Set TILEGEMM_INTERPRET={want} (or TRITON_INTERPRET={want})")
        raise RuntimeError(
            f"triton was imported before tilegemm chose {'the interpreter' if interpret else 'the GPU compiler'} "
            f"(TRITON_INTERPRET was {'unset' if interpret else '1'} then). {how} before importing torch, triton or "
            f"tilegemm, or import tilegemm first."
        )


_warned = False


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning raised in this module's caller at the user's code: the first
    frame outside tilegemm, torch and triton (so the warning names the line that called tilegemm)."""
    import sys

    skip = tuple(os.path.dirname(os.path.dirname(m.__file__)) + os.sep
                 for m in (sys.modules.get("tilegemm.core"),) if m is not None)
    skip += tuple(os.path.dirname(m.__file__) + os.sep
                  for m in (sys.modules.get("torch"), sys.modules.get("triton")) if m is not None)
    frame, level = sys._getframe(2), 2  # level 1: ensure_backend, which calls warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def ensure_backend() -> bool:
    """Settle the backend once (before any kernel module is imported); return True if interpreting."""
    global _interpret, _warned
    if _interpret is None:
        with _lock:
            if _interpret is None:
                interpret = _decide()
                os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
                _interpret = interpret
    if not _warned:
        _check_triton_mode(_interpret)
        _warned = True
        if _interpret:
            message = (
                "tilegemm: no CUDA GPU in use, so kernels run under Triton's interpreter on the CPU; "
                "results are checked the same way, but timings are not GPU performance."
            )
            log.info(message)
            warnings.warn(message, InterpreterWarning, stacklevel=_caller_level())
    return _interpret


def interpreting() -> bool:
    """True when kernels run under Triton's interpreter (settles the backend if needed)."""
    return ensure_backend()


# Constants of the process to torch.compile: Dynamo calls them while tracing and keeps the result. Traced as
# code, ensure_backend's lock and warning broke the graph at a model's first convolution or matmul when no call
# had settled the backend before, and every layer then ran as a graph of its own. The mark is what
# torch.compiler.assume_constant_result sets; that function imports torch._dynamo, which imports triton, and
# this module must not (TRITON_INTERPRET is set first). tests/core/test_compile_first.py fails if it stops working.
for _fn in (ensure_backend, interpreting):
    _fn._dynamo_marked_constant = True


_INTERPRETER_LOCK = fork_safe(threading.RLock())


@contextlib.contextmanager
def quiet_interpreter():
    """A context for a launch under the interpreter: one launch at a time (Triton's interpreter is not
    thread-safe: it patches the language's functions during a launch, and threads launching at once failed), and
    numpy's floating-point warnings (overflow in exp, ...), which the interpreter's arithmetic raises where a GPU
    computes inf or 0 silently, kept inside the launch."""
    import numpy as np

    with _INTERPRETER_LOCK, np.errstate(all="ignore"):
        yield


def missing_gpu() -> str | None:
    """Why no kernel can run here, or None: the GPU compiler forced (``TILEGEMM_INTERPRET=0``) where torch sees no
    CUDA GPU."""
    if interpreting():
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return ("TILEGEMM_INTERPRET=0 asks for Triton's GPU compiler, but torch sees no CUDA GPU: unset it, or set "
            "TILEGEMM_INTERPRET=1 to run Triton's interpreter on the CPU")


def check_device(name: str, device) -> None:
    """Raise ValueError when a tensor is not on a CUDA device while kernels are compiled for the GPU."""
    if not interpreting() and device.type not in ("cuda", "meta"):  # (meta: shapes only, nothing launched)
        problem = missing_gpu()
        if problem:
            raise ValueError(f"{name} is on {device}: {problem}")
        raise ValueError(
            f"{name} is on {device}, but a CUDA GPU is in use: move the tensors to the GPU "
            "(or set TILEGEMM_INTERPRET=1 to run Triton's interpreter on the CPU)"
        )


def check_same_device(named: dict) -> None:
    """Raise ValueError naming two tensors of ``named`` (name -> tensor) on different devices, or, via
    :func:`check_device`, real tensors that are not on the GPU in use; TypeError for DTensors mixed with plain
    tensors (DTensor's own error there names neither)."""
    check_one_kind(named)
    first_name, first = next(iter(named.items()))
    for name, t in named.items():
        if t.device != first.device:
            raise ValueError(f"tensors are on different devices: {first_name} on {first.device}, {name} on {t.device}")
    from torch._subclasses.fake_tensor import FakeTensor

    # A fake launches nothing, and DTensor's sharding propagation (torch <= 2.11) makes its fakes on the CPU
    # whatever the mesh's device: the real call is checked when it runs.
    if not isinstance(first, FakeTensor):
        check_device(first_name, first.device)


def check_one_kind(named: dict, op: str = "", hint: str = "") -> None:
    """Raise TypeError where ``named`` (name -> tensor) mixes DTensors with plain tensors, naming which are which
    (``op``: the message's first words; ``hint``: what follows the advice)."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # (loaded by whoever made a DTensor: no import here)
    if dtensor is None:
        return
    dt = [k for k, t in named.items() if isinstance(t, dtensor.DTensor)]
    if not dt or len(dt) == len(named):
        return
    plain = [k for k in named if k not in dt]
    raise TypeError(f"{op}{', '.join(dt)} {'is a DTensor' if len(dt) == 1 else 'are DTensors'} but "
                    f"{', '.join(plain)} {'is a' if len(plain) == 1 else 'are'} plain torch.Tensor"
                    f"{'' if len(plain) == 1 else 's'}: pass all of them as DTensors on one mesh (a replicated one "
                    f"as DTensor.from_local(t, mesh, [Replicate()]) or distribute_tensor), or all as plain local "
                    f"tensors{hint}")


def check_dense(name: str, t) -> None:
    """Raise TypeError when the tensor ``t`` (named ``name``) is sparse, nested or of another non-strided layout:
    the kernels read memory through strides, which such a tensor does not have (it failed deep in Triton)."""
    import torch

    if t.is_nested:
        raise TypeError(f"{name} is a nested tensor; tilegemm takes dense (strided) tensors only")
    if t.layout is not torch.strided:
        raise TypeError(f"{name} is a tensor of layout {t.layout}; tilegemm takes dense (strided) tensors only: "
                        f"pass {name}.to_dense()")


def any_negative(*tensors) -> bool:
    """Whether one of ``tensors`` (None for an absent one) is a negative view, as ``z.conj().imag`` is: its memory
    holds the values negated and a bit says so, which torch's ops resolve but a kernel reading the memory does not
    (the product came out with that operand's sign flipped). False while Dynamo traces (it cannot trace is_neg)."""
    import torch

    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if t is not None and t.is_neg():
            return True
    return False


def resolved(*tensors) -> tuple:
    """``tensors`` with each negative view (:func:`any_negative`) copied to one that holds its values as they read
    (``resolve_neg``, differentiable); the others, and None, as they are."""
    return tuple(t.resolve_neg() if t is not None and t.is_neg() else t for t in tensors)


def on_device(device):
    """A context in which ``device`` is the current CUDA device, for the launches (and tuning) of one call.

    Triton launches on the current device and its current stream, whatever device the tensors are on; a
    call with tensors on ``cuda:1`` while ``cuda:0`` is current would otherwise run there on foreign
    memory. A no-op (no device switch) when ``device`` is already current, or off the GPU.
    """
    if device.type != "cuda" or device.index is None:
        return contextlib.nullcontext()
    import torch

    if device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


# --- output allocation ----------------------------------------------------------------------------------

class _Poison(threading.local):
    on = False  # a class default: a thread that never set it reads this without a failed lookup (every output)


_poison = _Poison()


def poisoning() -> bool:
    return _poison.on


def set_poisoning(on: bool) -> bool:
    """Make every kernel output start as NaN (or the dtype's max for integers); return the old setting."""
    old = poisoning()
    _poison.on = bool(on)
    return old


_empty = None  # torch.empty, bound at the first output: this module imports no torch when it is imported, and an
#   import statement in new_output would run on every replayed call's host path


def _bind_empty():
    global _empty
    import torch

    _empty = torch.empty
    return _empty


def new_output(shape, dtype, device, memory_format=None):
    """``torch.empty`` for kernel outputs; filled with NaN while poisoning, so unwritten elements show.
    ``memory_format``: ``torch.channels_last`` for a 4-D output laid out so (one allocation, no permuted view)."""
    empty = _empty or _bind_empty()
    if not _poison.on:
        # The sizes as separate ints: torch parses those in about 1.5 us of host time, a tuple in 2.2 and a
        # torch.Size in 3.0 (a replayed call's allocation is a sizable part of its host time).
        if memory_format is not None:
            return empty(*shape, dtype=dtype, device=device, memory_format=memory_format)
        return empty(*shape, dtype=dtype, device=device) if len(shape) else empty((), dtype=dtype, device=device)
    import torch

    if dtype.is_floating_point:
        fill = float("nan")
    elif dtype == torch.bool:
        fill = True
    else:
        fill = torch.iinfo(dtype).max
    if memory_format is not None:
        return torch.empty(*shape, dtype=dtype, device=device, memory_format=memory_format).fill_(fill)
    return torch.full(shape, fill, dtype=dtype, device=device)
