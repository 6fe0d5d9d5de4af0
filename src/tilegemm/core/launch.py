"""Kernel launches, and replaying a recorded launch to cut host time on repeated calls.

Launching through ``kernel[grid](...)`` costs about 16 us of host time in Triton 3.6 (argument binding,
specialization, cache key, knobs); calling the compiled kernel directly costs about 7 us (measured on an
H200, tools/launch_profile.py). For a small GEMM that difference is most of the call.

So every tilegemm launcher goes through :func:`launch`. While :func:`recording` is active, each launch is
remembered as (compiled kernel, grid, full parameter list). An op that sees a call whose shapes, strides,
dtypes, device and 16-byte alignment all match an earlier one (everything Triton specializes on) can then
replay it with :class:`Replay`, swapping in the new tensors (the ops' cache of them: :mod:`tilegemm.core.replay`). A replay calls Triton's C launcher itself
unless a launch hook is registered (what that saves a small call: docs/performance.md).

Host-side TMA descriptors (Gluon's or Triton's ``TensorDescriptor``, kernel parameters) replay too: the
descriptor's shape, strides and block are the call's (they are in the op's replay key), so a replay
passes a copy of the recorded descriptor with the new tensor as its base. Triton 3.6's launcher would
encode every descriptor again on every launch (about 8 us for three); a replay encodes one once per
base address and passes the C launch the expanded parameters itself (:func:`_descriptor_launcher`).
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd.forward_ad as _forward_ad

from tilegemm.core.runtime import fork_safe, interpreting, quiet_interpreter

class _State(threading.local):
    """This thread's recording and kept buffers. Class defaults: a replay key asks on every call, and a lookup
    that fails (a thread that never recorded) costs several times one that finds them."""

    launches = None  # the active recording's launches, or None
    spoiled = False
    keeping = ()
    views = False  # inside :class:`into_views`


_state = _State()

try:  # what Triton's CUDA driver itself uses for the current stream (and, under it, the current device)
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
    from torch._C import _cuda_getDevice as _current_device
except ImportError:  # a CPU-only torch: nothing is ever replayed there
    _raw_stream = _current_device = None


_cuda_up = False  # CUDA seen initialised once (it stays so)


def current_stream() -> int:
    """The raw CUDA stream Triton launches on: torch's current stream of the current device (0 on the CPU)."""
    global _cuda_up
    if _raw_stream is None:
        return 0
    if not _cuda_up:
        # Before CUDA is initialised no stream can have been made current: the default one (0). Asking would
        # initialise CUDA, which fails where a CUDA build of torch has no driver (interpreter runs on the CPU).
        if not torch.cuda.is_initialized():
            return 0
        _cuda_up = True
    return _raw_stream(_current_device())


_runtime_knobs = None  # triton.knobs.runtime, taken when the first Replay is made (triton is imported then)


def scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's global scratch for tensor descriptors made on the device, on the current device (the launch's)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Give Triton an allocator for kernels that make tensor descriptors on the device, where this thread has
    none: Triton keeps it per thread (a context variable), so autograd's backward thread asks anew; an allocator
    the user set is kept. Called at launch, never at import (no GPU work then); nothing under the interpreter."""
    if interpreting():
        return
    import triton  # (here: importing tilegemm imports no triton)
    from triton.runtime import _allocation

    current = getattr(_allocation, "_allocator", None)  # (Triton 3.6's; where it moved, set ours each launch)
    if current is None or isinstance(current.get(), _allocation.NullAllocator):
        triton.set_allocator(scratch)


def _hooks_idle() -> bool:
    """True when no launch hook is set (Triton 3.6 keeps them as hook chains, empty by default)."""
    enter, leave = _runtime_knobs.launch_enter_hook, _runtime_knobs.launch_exit_hook
    return not getattr(enter, "calls", enter) and not getattr(leave, "calls", leave)


@dataclass
class Launch:
    compiled: Any
    grid: tuple[int, int, int]
    params: list
    keep: tuple = ()  # tensors of the launcher's own (a workspace) that a replay passes as they were
    stream: int | None = None  # set when the launch may only be replayed on this stream
    device: int | None = None  # the CUDA device it ran on (the current one at launch)
    views: bool = False  # made inside :class:`into_views`: it may pass addresses inside a call's tensors


def launch(kernel, grid, args: tuple, kwargs: dict, keep: tuple = (), stream: int | None = None):
    """``kernel[grid](*args, **kwargs)``, remembered when a recording is active.

    ``keep``: tensors among the arguments that belong to the launcher (a workspace), not to the call; a
    replay passes them unchanged and holds them alive. ``stream``: the raw CUDA stream the launcher's
    workspace is meant for; a replay on any other stream declines (the caller then launches afresh).
    """
    if interpreting():
        with quiet_interpreter():
            compiled = kernel[grid](*args, **kwargs)
    else:
        compiled = kernel[grid](*args, **kwargs)
    kept = getattr(_state, "keeping", ())
    if kept:  # per-stream buffers of the call's: a replay belongs to this stream too
        keep = tuple(keep) + kept
        stream = current_stream() if stream is None else stream
    record = getattr(_state, "launches", None)
    if record is not None:
        if compiled is None or interpreting() or getattr(_state, "spoiled", False):
            _state.spoiled = True
        else:
            g = tuple(grid(kwargs) if callable(grid) else grid)
            g = g + (1,) * (3 - len(g))
            params = _all_params(kernel, args, kwargs)
            if params is None:
                _state.spoiled = True
            else:
                record.append(Launch(compiled, g, params, tuple(keep), stream, _current_device(), _state.views))
    return compiled


_DEFAULTS: dict[int, tuple] = {}  # id(kernel) -> (kernel, {parameter name: default}); the kernel keeps the id


def _all_params(kernel, args: tuple, kwargs: dict) -> list | None:
    """Every parameter of a launch in order: the positional ones, then each named one from ``kwargs`` or, left
    out there, the kernel's default (a constexpr such as ``UNPACK="reshape"``); None if one has neither."""
    names = kernel.arg_names[len(args):]
    if all(name in kwargs for name in names):  # the common case, kept cheap: recording is on a call's path
        return list(args) + [kwargs[name] for name in names]
    found = _DEFAULTS.get(id(kernel))
    if found is None or found[0] is not kernel:
        fn = kernel
        while hasattr(fn, "fn"):  # an autotuner or JIT function around the Python function
            fn = fn.fn
        defaults = {name: p.default for name, p in inspect.signature(fn).parameters.items()
                    if p.default is not inspect.Parameter.empty}
        found = _DEFAULTS[id(kernel)] = (kernel, defaults)
    defaults = found[1]
    if any(name not in kwargs and name not in defaults for name in names):
        return None
    return list(args) + [kwargs[name] if name in kwargs else defaults[name] for name in names]


class recording:
    """Context manager collecting the launches made inside it; ``.launches`` is None if any was unusable."""

    def __enter__(self):
        self._outer = getattr(_state, "launches", None), getattr(_state, "spoiled", False)
        _state.launches, _state.spoiled = [], False
        return self

    def __exit__(self, *exc):
        launches, spoiled = _state.launches, _state.spoiled
        outer, outer_spoiled = self._outer
        if outer is not None:  # nested (conv2d's 1x1 path calls matmul): the launches belong to both
            outer.extend(launches)
            outer_spoiled = outer_spoiled or spoiled or exc[0] is not None
        _state.launches, _state.spoiled = outer, outer_spoiled
        self.launches = None if (spoiled or exc[0] is not None) else launches
        return False


class keeping:
    """Context manager: launches inside it keep ``tensors`` as their own (as :func:`launch`'s ``keep``), for
    buffers that a call's earlier launches filled and that a replay must pass as recorded (matmul's padded
    operands)."""

    def __init__(self, *tensors):
        self.tensors = tensors

    def __enter__(self):
        self._outer = getattr(_state, "keeping", ())
        _state.keeping = self._outer + self.tensors
        return self

    def __exit__(self, *exc):
        _state.keeping = self._outer
        return False


class into_views:
    """Context manager: launches inside it may pass views that start inside a call's tensors (a convolution's
    stride phase of its output), which a replay then passes at the same offset into the new tensors
    (:class:`Replay`). Named by the caller that makes such views, since only it knows that no torch op writes the
    rest of the tensor (a replay repeats Triton's launches only)."""

    def __enter__(self):
        self._outer = _state.views
        _state.views = True
        return self

    def __exit__(self, *exc):
        _state.views = self._outer
        return False


def spoil() -> None:
    """Mark the active recording unusable (no-op outside one): for launches made outside :func:`launch`
    (Triton's autotuner) or launches that are not the call's own (a tuner timing candidates), which a replay
    must not repeat or leave out."""
    if getattr(_state, "launches", None) is not None:
        _state.spoiled = True


# Held while a call launches a sequence that shares per-stream buffers between its launches (matmul's aligned
# twin, a K split reduced apart) and while a replay repeats one: Triton releases the GIL around a launch, so
# two threads on one stream could otherwise interleave their launches over the same buffers.
sequence_lock = fork_safe(threading.RLock())


def recording_active() -> bool:
    """True inside a :class:`recording` (a caller's replay would hide its launch from the recording)."""
    return getattr(_state, "launches", None) is not None


def _direct_launcher(launcher):
    """(C launch function, cooperative flag, PDL flag) under Triton 3.6's CUDA launcher object, or None.

    That object's ``__call__`` allocates global and profile scratch buffers (when the kernel needs any)
    and then calls its C ``launch``. For kernels that need neither, calling ``launch`` directly saves
    about a microsecond. Only on the Triton version whose argument order this was written against.
    """
    import triton

    if not triton.__version__.startswith("3.6."):
        return None
    if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None
    if getattr(launcher, "num_ctas", 1) != 1 or not hasattr(launcher, "launch"):
        return None
    return launcher.launch, launcher.launch_cooperative_grid, launcher.launch_pdl


def _descriptor_launcher(launch_fn):
    """(C launch, {parameter index: tensordesc metadata}) under Triton 3.6's wrapper of a launcher whose
    kernel takes host-side TMA descriptors, or None.

    That wrapper (``wrap_handle_tensordesc`` in Triton's NVIDIA driver) walks every parameter on every
    launch and encodes each descriptor afresh (``cuTensorMapEncodeTiled``): about 8 us of host time a
    launch for three descriptors on an H200, more than the whole launch of a kernel without them. A
    :class:`Replay` of such a launch instead passes the C launch the expanded parameters itself and
    encodes a descriptor once per base address (:meth:`Replay._encoded`)."""
    import triton

    if not triton.__version__.startswith("3.6.") or getattr(launch_fn, "__name__", "") != "inner":
        return None
    try:
        names = inspect.getclosurevars(launch_fn).nonlocals
        raw, indices, metas = names["launcher"], names["tensordesc_indices"], names["tensordesc_meta"]
    except (KeyError, TypeError, ValueError):
        return None
    return raw, dict(zip(sorted(indices), metas))


def _is_host_descriptor(value) -> bool:
    """A host-side TMA descriptor: Gluon's or Triton's ``TensorDescriptor`` (both hold ``base``, the tensor
    whose address they encode, and ``block_shape``). Any object like that gets a slot by its base, so a
    replay can never pass a recorded descriptor that still points at an earlier call's tensor."""
    return hasattr(value, "block_shape") and hasattr(value, "base")


def call_tensors(params) -> tuple:
    """The tensors a recorded parameter list holds, a host descriptor standing for its base: what a replay
    of it, as it was, takes."""
    return tuple(v.base if _is_host_descriptor(v) else v for v in params
                 if _is_host_descriptor(v) or hasattr(v, "data_ptr"))


def _rebased(desc, tensor):
    """A copy of host descriptor ``desc`` over ``tensor``'s memory. The replay key vouches for everything
    the descriptor's checks cover (shape, strides, dtype, 16-byte alignment), so they are not run again."""
    copy = object.__new__(type(desc))
    copy.__dict__.update(desc.__dict__)
    copy.base = tensor
    return copy


_OFFSET = object()  # marks a slot of :class:`Replay`'s expanded parameters that holds an address inside a tensor


def _holding(tensors: tuple, ptr: int) -> int | None:
    """The position of the tensor in ``tensors`` whose bytes hold address ``ptr``, or None. Only tensors starting
    16-byte aligned count: a replay key holds that alignment alone, so an address past an unaligned start could
    fall on another alignment in the next call than the compiled kernel assumed."""
    for j, t in enumerate(tensors):
        start = t.data_ptr()
        if start % 16 == 0 and start <= ptr < start + _span_bytes(t):
            return j
    return None


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to the end of its last (non-negative strides; 0 when empty)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st > 0)) * t.element_size()


class Replay:
    """One recorded launch, replayable with new tensors in the same parameter slots."""

    __slots__ = ("runner", "run", "direct", "function", "packed", "grid", "params", "slots", "offsets", "output",
                 "stream", "device", "expanded", "encoded")

    ENCODED_PER_REPLAY = 64  # descriptors kept encoded (by slot and base address) before the cache is cleared

    def __init__(self, launch_: Launch, tensors: tuple, output=None):
        global _runtime_knobs
        if _runtime_knobs is None:
            from triton import knobs

            _runtime_knobs = knobs.runtime
        self.output = output  # what a replay allocates for the call's output (tilegemm.core.replay)
        compiled = launch_.compiled
        self.runner = compiled[launch_.grid]  # Triton's own launch path (also loads the module)
        # What that path ends in: the compiled launcher, called directly when no launch hook listens.
        self.run, self.function, self.packed = compiled.run, compiled.function, compiled.packed_metadata
        self.direct = _direct_launcher(compiled.run)
        self.grid = launch_.grid
        self.stream = launch_.stream
        self.device = launch_.device
        self.params = list(launch_.params)
        kept = {t.data_ptr() for t in launch_.keep}
        # A launcher may pass a view of a call's tensor (same data pointer): the compiled kernel only
        # reads the pointer, so the call's tensor can stand in for it.
        ptrs = [t.data_ptr() for t in tensors]
        self.slots = []  # (param index, position in ``tensors``, the recorded descriptor or None)
        self.offsets = []  # (param index, position in ``tensors``, bytes past that tensor's data pointer)
        for i, value in enumerate(self.params):
            desc = value if _is_host_descriptor(value) else None
            tensor = value.base if desc is not None else value
            if hasattr(tensor, "data_ptr"):
                ptr = tensor.data_ptr()
                if ptr in ptrs:
                    # A call's tensor first, even where it lies in a kept workspace (a caller's matrix gathered
                    # into one, then passed to a public op): the next call may gather into another buffer.
                    self.slots.append((i, ptrs.index(ptr), desc))
                elif ptr in kept:
                    continue  # the launcher's workspace: passed as recorded
                else:
                    j = _holding(tensors, ptr) if desc is None and launch_.views else None
                    if j is None:
                        raise LookupError("a tensor parameter is not one of the call's tensors")
                    # A view inside a call's tensor (a stride phase of a convolution's output): the replay passes
                    # the address the same bytes past the new tensor's start (the key fixes its layout).
                    self.offsets.append((i, j, ptr - ptrs[j]))
        self.expanded = self._expand(kept)
        self.encoded = {}
        self._release_call_tensors()

    def _release_call_tensors(self) -> None:
        """Drop the recording call's tensors (every replay puts its own in their slots): a cache of replays
        must not keep each first call's inputs and output alive. Descriptors keep their shape, strides and
        block, over no memory."""
        for n, (i, j, desc) in enumerate(self.slots):
            self.params[i] = None
            if desc is not None:
                self.slots[n] = (i, j, _rebased(desc, None))
        for i, _, _ in self.offsets:
            self.params[i] = None
        if self.expanded is not None:
            raw, flat, slots = self.expanded
            for n, (pos, j, desc, meta) in enumerate(slots):
                if meta is None or meta is _OFFSET:
                    flat[pos] = None
                if desc is not None:
                    slots[n] = (pos, j, _rebased(desc, None), meta)

    def _expand(self, kept: set):
        """For a direct launch through Triton 3.6's descriptor wrapper: (C launch, the parameters as that
        wrapper would expand them, [(position there, position in ``tensors``, descriptor, its metadata)]);
        otherwise None. A descriptor with metadata expands to (encoded map, shape..., strides...), its map
        at the position; one without to (base, shape..., strides..., ...), its base at the position.
        ``kept``: the data pointers of the launcher's workspaces (descriptors over them are encoded now)."""
        found = _descriptor_launcher(self.direct[0]) if self.direct is not None else None
        if found is None:
            return None
        from triton.backends.nvidia.driver import make_tensordesc_arg

        raw, metas = found
        where = {i: (j, desc) for i, j, desc in self.slots}
        offsets = {i: (j, off) for i, j, off in self.offsets}
        flat, slots = [], []
        for i, value in enumerate(self.params):
            if i in offsets:  # (never a descriptor: __init__ takes plain pointers only)
                j, off = offsets[i]
                slots.append((len(flat), j, off, _OFFSET))
                flat.append(value)
                continue
            if i in metas:
                if i not in where and _is_host_descriptor(value) and value.base is not None \
                        and value.base.data_ptr() in kept:
                    # A descriptor over the launcher's workspace: the replay holds that tensor (the recorded
                    # descriptor stays in ``params``), so its map is encoded once, here.
                    flat.extend(make_tensordesc_arg(value, metas[i]))
                    continue
                if i not in where or where[i][1] is None:
                    return None  # a descriptor parameter that is not a host descriptor of the call's tensors
                j, desc = where[i]
                slots.append((len(flat), j, desc, metas[i]))
                flat.extend(make_tensordesc_arg(desc, metas[i]))
            else:
                if i in where:
                    slots.append((len(flat), where[i][0], None, None))
                flat.append(value)
        return raw, flat, slots

    def _encoded(self, pos: int, desc, meta, tensor):
        """The encoded TMA map of ``desc`` over ``tensor``: made once per (slot, base address). The replay
        key fixes everything else the map holds (shape, strides, block, element type, swizzle)."""
        key = (pos, tensor.data_ptr())
        found = self.encoded.get(key)
        if found is None:
            from triton.backends.nvidia.driver import make_tensordesc_arg

            if len(self.encoded) >= self.ENCODED_PER_REPLAY:
                self.encoded.clear()
            found = self.encoded[key] = make_tensordesc_arg(_rebased(desc, tensor), meta)[0]
        return found

    def __call__(self, *tensors) -> bool:
        """Launch with ``tensors`` in the recorded ones' slots; False (nothing launched) on a foreign stream,
        or when another device than the recorded one is current (the compiled kernel belongs to that one)."""
        device = _current_device()
        if device != self.device:
            return False
        stream = _raw_stream(device)  # as current_stream()
        if self.stream is not None and stream != self.stream:
            return False
        hooked = not _hooks_idle()
        g = self.grid
        if self.expanded is not None and not hooked:
            raw, flat, slots = self.expanded
            params = flat.copy()
            for pos, j, desc, meta in slots:
                if meta is None:
                    params[pos] = tensors[j]  # a tensor, or the base of a descriptor passed unencoded
                elif meta is _OFFSET:
                    params[pos] = tensors[j].data_ptr() + desc  # (desc: the offset in bytes)
                else:
                    params[pos] = self._encoded(pos, desc, meta, tensors[j])
            _, cooperative, pdl = self.direct
            raw(g[0], g[1], g[2], stream, self.function, cooperative, pdl, None, None, self.packed, None, None,
                None, *params)
            return True
        params = self.params.copy()
        for i, j, desc in self.slots:
            params[i] = tensors[j] if desc is None else _rebased(desc, tensors[j])
        for i, j, off in self.offsets:
            params[i] = tensors[j].data_ptr() + off  # Triton's launchers take an int as a device address
        if hooked:
            ensure_allocator()  # (a kernel making descriptors on the device: this thread may have no allocator)
            self.runner(*params, stream=stream)  # a profiler listens: Triton's path gives its hooks metadata
            return True
        # Triton's runner would build launch metadata and call two empty hook chains (about 2 us).
        if self.direct is not None:
            launch_, cooperative, pdl = self.direct
            launch_(g[0], g[1], g[2], stream, self.function, cooperative, pdl, None, None, self.packed, None, None,
                    None, *params)
        else:
            # Triton's launcher allocates the kernel's scratch through this thread's allocator: a replay on a
            # thread (or autograd's) that launched nothing before needs one set.
            ensure_allocator()
            self.run(g[0], g[1], g[2], stream, self.function, self.packed, None, None, None, *params)
        return True


class ReplaySequence:
    """A call's few recorded launches, replayed in order with the same tensors (:class:`Replay` each)."""

    __slots__ = ("replays", "output")
    MAX_LAUNCHES = 8  # matmul's aligned twin: three copies in, a split product (two), one copy out

    def __init__(self, replays: list, output=None):
        if len({(r.device, r.stream) for r in replays}) != 1:
            raise LookupError("the launches were made on different devices or streams")
        self.replays = replays
        self.output = output

    def __call__(self, *tensors) -> bool:
        """Launch them all (under :data:`sequence_lock`); False (nothing launched) where the first declines
        (another stream or device: all were recorded on the same one, so all would)."""
        first, *rest = self.replays
        with sequence_lock:
            if not first(*tensors):
                return False
            for replay in rest:
                replay(*tensors)
        return True


def tensor_key(t) -> tuple:
    """What Triton specializes a launch on for one tensor argument: dtype, shape, strides, device and 16-byte
    alignment of its data pointer (a part of a replay key)."""
    return (t.dtype, t.shape, t.stride(), t.device, t.data_ptr() % 16 == 0)


# Plain tensors: torch.Tensor itself and nn.Parameter (a module's weights and biases; it disables
# __torch_function__, so dispatch through it is a plain tensor's). Subclasses beyond these go through the op.
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
# Whether a dispatch mode or a torch function mode is on: bound once, the replay keys call them on every call.
dispatch_stack_depth = torch._C._len_torch_dispatch_stack
function_mode_on = torch._C._is_torch_function_mode_enabled
try:  # the innermost of torch.func's transforms (grad, vmap, ...) running, or None: their tensors are wrappers
    functorch_level = torch._C._functorch.peek_interpreter_stack
except AttributeError:  # an older torch without it
    def functorch_level():
        return None
# Whether torch.jit.trace is recording: a launch made outside the dispatcher is invisible to it (the traced graph
# would keep only the output's allocation), so a traced call always goes through the registered op.
jit_tracing = torch._C._is_tracing


def forward_ad_on() -> bool:
    """Whether a level of ``torch.autograd.forward_ad`` is open (its dual tensors carry tangents that only the
    registered op sees, and refuses)."""
    return _forward_ad._current_level >= 0


def plain_tensor(t) -> bool:
    """True for a ``torch.Tensor`` or an ``nn.Parameter`` (not another subclass, not None)."""
    return type(t) in PLAIN_TENSOR_TYPES


# Whether a tensor is one of torch's older vmap (autograd.grad(..., is_grads_batched=True) and
# jacobian/hessian(vectorize=True) batch the gradients so), which torch.func's level check does not see: its storage
# and layout cannot be read, so only the registered ops take it.
try:
    legacy_batched = torch._C._functorch.is_legacy_batchedtensor
except AttributeError:  # a torch without the older vmap's check
    def legacy_batched(t) -> bool:
        return False


def plain_call(*tensors) -> bool:
    """True when no tracer, mode or autograd needs to see the op, so dispatch through it can be skipped.

    Going through a registered op (``torch.ops.tilegemm.*``) costs tens of microseconds of host time; for small
    problems that is more than the kernel. Under torch.compile, export, fake tensors, dispatch modes or
    autograd the call always goes through the registered op.
    """
    if torch.compiler.is_compiling():
        return False
    if dispatch_stack_depth() or function_mode_on() or jit_tracing() or functorch_level() is not None:
        return False
    if forward_ad_on():  # dual tensors may be about: the op refuses them (torch_ops.refuse_forward_ad)
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) not in PLAIN_TENSOR_TYPES or (grad and t.requires_grad) or t.is_meta:
            return False  # (meta tensors: the op's fake gives the result's shape, launching nothing)
    return True
