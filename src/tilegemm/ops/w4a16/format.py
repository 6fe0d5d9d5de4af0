"""The house's 4-bit weight format, :class:`Int4Weight`: quantize, dequantize, and import GPTQ / AWQ /
compressed-tensors checkpoints.

A linear weight ``W`` is ``[N, K]`` (``y = x @ W.T``), cut along K into ``G = K / group_size`` groups. Held as:

- ``qweight`` int32 ``[K/8, N]``: packed along K, nibble ``i`` of ``qweight[r, n]`` is ``q[k = 8r + i, n]``
  (GPTQ v1's own layout, so a GPTQ checkpoint imports without repacking). K-major because the kernels
  walk K for a block of N columns: a warp reads a row of ``qweight`` as 16-byte vectors along N (coalesced),
  and every int32 it holds is eight K steps of one output column, so no thread needs another's nibbles.
- ``scales`` and ``zeros`` ``[G, N]`` in the weight's dtype (fp16 or bf16), contiguous along N like the
  packed rows. The zero point is an integer (0..16: GPTQ v1's stored zero plus one reaches 16) held as a
  float, so a kernel dequantizes with one subtraction and one multiplication in 16-bit, bit for bit like
  :func:`dequantize`: ``W.T[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]``, ``g = k // group_size``.
- ``perm`` int64 ``[K]`` or None: act-order GPTQ checkpoints quantized the rows of ``W.T`` in another order; they
  are stored sorted by group, and ``x[..., perm]`` is what multiplies them. Stacked experts hold one an expert,
  ``[E, K]`` (the grouped product reads each expert's rows of x through its own).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch

from tilegemm.core.dtypes import dtype_name
from tilegemm.core.runtime import cdiv, check_dense

GROUP_SIZES = (32, 64, 128, 256, -1)
FLOAT_DTYPES = (torch.float16, torch.bfloat16)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
_SHIFTS = torch.arange(8, dtype=torch.int32) * 4


# --- packing: eight 4-bit values per int32 ----------------------------------------------------------------


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """``q`` ``[K, N]`` of values 0..15 -> int32 ``[K/8, N]``, nibble ``i`` of row ``r`` holding ``q[8r + i]``."""
    K, N = q.shape
    q = q.to(torch.int64).reshape(K // 8, 8, N)
    word = (q << _SHIFTS.to(q.device, torch.int64)[None, :, None]).sum(dim=1)  # [K/8, N], 0 .. 2^32 - 1
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # the same bits as int32


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: int32 ``[R, N]`` -> uint8 ``[8R, N]``."""
    R, N = packed.shape
    shifts = _SHIFTS.to(packed.device)[None, :, None]
    return ((packed[:, None, :] >> shifts) & 15).reshape(8 * R, N).to(torch.uint8)


def pack_cols(q: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """``q`` ``[R, N]`` of values 0..15 -> int32 ``[R, N/8]``, nibble ``i`` of word ``c`` holding
    ``q[:, 8c + order[i]]`` (GPTQ's qzeros: the plain order; AWQ: :data:`AWQ_ORDER`)."""
    R, N = q.shape
    q = q.to(torch.int32).reshape(R, N // 8, 8)[:, :, list(order)]
    return pack_rows(q.permute(2, 0, 1).reshape(8, R * (N // 8))).reshape(R, N // 8)


def unpack_cols(packed: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """Inverse of :func:`pack_cols`: int32 ``[R, C]`` -> uint8 ``[R, 8C]``."""
    R, C = packed.shape
    nibbles = unpack_rows(packed.reshape(1, R * C)).reshape(8, R, C).permute(1, 2, 0)  # [R, C, 8] by nibble
    out = torch.empty_like(nibbles)
    out[:, :, list(order)] = nibbles
    return out.reshape(R, 8 * C)


# --- the tensor-core fragment layout (kernel ``frag_wgmma``) -------------------------------------------


# --- the offline shuffle --------------------------------------------------------------------------------


FRAG_K_STEP = 64  # the fragment kernel's K step: its scales change between steps, or between its halves
FRAG_HALF_GROUP = 32  # the group length whose scales change at half a K step (two groups a step)


def fits_fragments(group_k: int, K: int | None = None) -> bool:
    """Whether the ``frag_wgmma`` kernel can take a weight of group length ``group_k``: 32 (two groups a K step), a
    multiple of its K step, or one group of all ``K`` inputs (any length: it spans the padded steps)."""
    return group_k > 0 and (group_k % FRAG_K_STEP == 0 or group_k == FRAG_HALF_GROUP
                            or (K is not None and group_k >= K))


def pack_fragments(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_k: int):
    """The layout of the ``frag_wgmma`` kernel (:mod:`tilegemm.ops.w4a16.frag_wgmma`, whose docstring describes it).

    ``q`` ``[K, N]`` (values 0..15, ``W.T``), ``scales``/``zeros`` ``[G, N]`` -> (int32 ``[N16, K64, 32, 4]``,
    ``[G', N16, 8, 4]`` in the scales' dtype), padded to N16 = 16 ceil(N / 256) and K64 = 2 ceil(K / 128); G' covers the
    padded K (group 32: two groups a 64-deep step, one per half), padded groups with zero scales."""
    K, N = q.shape
    n16, k64 = cdiv(N, 256) * 16, cdiv(K, 128) * 2  # whole programs of up to 256 rows, steps of up to 128
    qp = torch.zeros((k64 * 64, n16 * 16), dtype=torch.int64, device=q.device)
    qp[:K, :N] = q.to(torch.int64)
    # [row, k] -> (t, j0, rl) x (c, l, j1, km, h)
    t = qp.T.reshape(n16, 2, 8, k64, 4, 2, 4, 2)
    t = t.permute(0, 3, 2, 6, 4, 7, 5, 1)  # (t, c, rl, km, l, h, j1, j0): nibble i = 4h + 2j1 + j0
    t = t.reshape(n16, k64, 32, 4, 8)
    shifts = torch.arange(8, device=q.device, dtype=torch.int64) * 4
    words = (t << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    groups = cdiv(k64 * 64, group_k)
    zs = torch.zeros((groups, n16 * 16, 2), dtype=scales.dtype, device=q.device)
    zs[: scales.shape[0], :N, 0] = zeros
    zs[: scales.shape[0], :N, 1] = scales
    zs = zs.reshape(groups, n16, 2, 8, 2).permute(0, 1, 3, 4, 2).reshape(groups, n16, 8, 4)  # z, z8, s, s8
    return words.contiguous(), zs.contiguous()


def gate_up_tiles(t: torch.Tensor, half: int) -> torch.Tensor:
    """The gated product's row order (the last dim of ``t``, ``[..., 2 * half]``: a gate's ``half`` rows, then the up
    projection's): gate and up rows alternate by 16-row tiles, tile ``2j`` gate rows ``16j .. 16j + 15`` and tile
    ``2j + 1`` the up rows of the same numbers, each half padded with zeros to ``half16`` = a multiple of 16 rows.
    Returns ``[..., 2 * half16]``; ``grouped_w4a16``'s ``frag`` kernel then finds both halves of its output columns
    in every program's row tiles."""
    half16 = cdiv(half, 16) * 16
    lead = t.shape[:-1]
    out = torch.zeros(*lead, 2, half16, dtype=t.dtype, device=t.device)
    out[..., 0, :half] = t[..., :half]
    out[..., 1, :half] = t[..., half:2 * half]
    tiles = out.reshape(*lead, 2, half16 // 16, 16).transpose(-3, -2)  # [..., tile j, gate/up, 16]
    return tiles.reshape(*lead, 2 * half16)


def _expert_fragments(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_k: int,
                      gated: bool):
    """:func:`pack_fragments` of one expert's (or a 2-D weight's) parts; ``gated``: of its rows in
    :func:`gate_up_tiles`' order."""
    q = unpack_rows(qweight)
    if gated:
        half = q.shape[1] // 2
        q, scales, zeros = (gate_up_tiles(t, half) for t in (q, scales, zeros))
    return pack_fragments(q, scales, zeros, group_k)



# --- the weight --------------------------------------------------------------------------------------------


class Int4Weight:
    """A 4-bit weight of logical shape ``[N, K]``; see the module docstring for the layout. Stacked experts
    ``[E, N, K]`` (``quantize`` of a 3-D weight) hold every part with a leading E: qweight ``[E, K/8, N]``,
    scales and zeros ``[E, G, N]``; ``expert(e)`` is one of them (the grouped family multiplies them).

    Make one with :func:`quantize`, :func:`from_gptq`, :func:`from_awq` or :func:`from_compressed_tensors`.
    ``.to(device)`` / ``.to(dtype)`` move it or change the dtype of its scales; :meth:`state_dict` / :meth:`from_state_dict` and ``torch.save``
    keep it; ``nbytes`` is what it occupies.
    """

    __slots__ = ("qweight", "scales", "zeros", "perm", "group_size", "shape", "_frag", "_frag_gated")

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, shape: tuple[int, int], perm: torch.Tensor | None = None, frag=None):
        self.qweight = qweight  # int32 [K/8, N]
        self.scales = scales  # [G, N], fp16 or bf16
        self.zeros = zeros  # [G, N], scales' dtype, integer values
        self.perm = perm  # int64 [K] ([E, K] stacked: an expert's each) or None
        self.group_size = _as_int("group_size", group_size)  # as asked: 32..256, or -1 for all of K
        self.shape = _as_shape(shape)  # (N, K), or (E, N, K) for stacked experts
        self._frag = frag  # (fweight, fzs) of the fragment kernel, made by fragments() when first needed
        self._frag_gated = None  # the same of the rows in the gated product's order (fragments(gated=True))
        validate(self)
        if frag is not None:  # given (Int4Linear's kept buffers): the fragment kernel reads it unchecked
            check_fragments(self, frag)

    @classmethod
    def _checked_before(cls, qweight, scales, zeros, group_size: int, shape: tuple, perm, frag) -> "Int4Weight":
        """The weight of parts that made a valid one before, unchanged since (``Int4Linear`` knows it by its fragment
        record): ``__init__`` without its checks, which cost a decode step's layer more host time than the rest."""
        w = cls.__new__(cls)
        w.qweight, w.scales, w.zeros, w.perm, w.group_size, w.shape = qweight, scales, zeros, perm, group_size, shape
        w._frag, w._frag_gated = frag, None
        return w

    # The group length along K that the kernels step by (group_size, or K for -1).
    @property
    def group_k(self) -> int:
        return self.shape[-1] if self.group_size == -1 else self.group_size

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        """Bytes held: the parts, plus the fragment layout once made."""
        parts = list(self.tensors().values()) + list(self._frag or ()) + list(self._frag_gated or ())
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def expert(self, e: int) -> "Int4Weight":
        """Expert ``e`` of a stacked weight, as a 2-D ``Int4Weight`` (views of the stacked parts; a negative ``e``
        counts from the end, as Python's indexing)."""
        if len(self.shape) != 3:
            raise ValueError(f"expert() takes a stacked [E, N, K] weight, this one is {list(self.shape)}")
        try:
            index = None if isinstance(e, bool) else operator.index(e)
        except TypeError:
            index = None
        if index is None:
            raise TypeError(f"expert() takes an int index, got {type(e).__name__} {e!r}")
        e = index
        if not -self.shape[0] <= e < self.shape[0]:
            raise ValueError(f"expert {e} is out of range for {self.shape[0]} experts")
        return Int4Weight(self.qweight[e], self.scales[e], self.zeros[e], self.group_size, self.shape[1:],
                          None if self.perm is None else self.perm[e])

    def fragments(self, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fweight, fzs)``: the weight shuffled for the ``frag_wgmma`` kernel (:func:`pack_fragments`), made on the
        weight's device the first time it is asked for and kept (about the size of ``qweight`` and the scales
        again). ``tilegemm.nn.Int4Linear`` makes it once and keeps it as buffers, where the kernel runs (a Hopper GPU).

        Stacked experts ``[E, N, K]``: each expert's fragments stacked along a leading E (``[E, N16, K64, 32, 4]``
        and ``[E, G', N16, 8, 4]``), what ``grouped_w4a16``'s ``frag`` kernel reads. ``gated``: of the rows in the
        gated product's order (:func:`gate_up_tiles`: gate and up rows alternating by 16-row tiles), kept apart
        from the plain ones."""
        made = self._frag_gated if gated else self._frag
        if made is not None:
            return made
        if self.qweight.is_cuda and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing():
            # Packing inside a capture would run again on every replay of the graph (and copies from the host,
            # which a capture refuses): the layout must exist before.
            raise RuntimeError("this Int4Weight's fragment layout cannot be made during CUDA graph capture: "
                               "call w.fragments() before capturing (a call makes it only where auto may pick "
                               "the fragment kernel, so a warm-up at another batch size may not have; "
                               "tilegemm.nn.Int4Linear makes it when built, and again at its first call after "
                               "its parts change)")
        if gated and self.shape[-2] % 2:
            raise ValueError(f"gated fragments need an even number of rows (gate, then up), this weight has "
                             f"{self.shape[-2]}")
        if len(self.shape) == 3:
            # expert by expert into the stacked result: the packing's int64 scratch is one expert's at a time
            first = _expert_fragments(self.qweight[0], self.scales[0], self.zeros[0], self.group_k, gated)
            made = tuple(torch.empty((self.shape[0], *t.shape), dtype=t.dtype, device=t.device) for t in first)
            for e in range(self.shape[0]):
                parts = first if e == 0 else _expert_fragments(self.qweight[e], self.scales[e], self.zeros[e],
                                                               self.group_k, gated)
                for dst, src in zip(made, parts):
                    dst[e] = src
        else:
            made = _expert_fragments(self.qweight, self.scales, self.zeros, self.group_k, gated)
        if gated:
            self._frag_gated = made
        else:
            self._frag = made
        return made

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return dict(qweight=self.qweight, scales=self.scales, zeros=self.zeros, perm=self.perm)

    def to(self, *args, **kwargs) -> "Int4Weight":
        """Like ``Tensor.to``: a device moves every tensor; a float dtype converts scales and zeros only;
        ``non_blocking`` and ``copy`` as there (a memory format is the activations': the parts stay dense)."""
        device, dtype, non_blocking, copy = _to_args(args, kwargs)
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise TypeError(f"an Int4Weight's scales are fp16 or bf16, not {dtype_name(dtype)}")

        def move(t, to_dtype=None):
            if t is None:
                return None
            return t.to(device=t.device if device is None else device, dtype=to_dtype or t.dtype,
                        non_blocking=non_blocking, copy=copy)

        qweight, scales, zeros = move(self.qweight), move(self.scales, dtype), move(self.zeros, dtype)
        if dtype is not None and dtype != self.scales.dtype and not scales.is_meta and _values_checkable(scales):
            _check_finite(f"scales converted to {dtype_name(dtype)}", scales)  # bf16 scales past fp16's range
            # finite scales can still make weights past its range: inf in dequantize and the 16-bit kernels
            if dequantized_overflow(qweight, scales, zeros, dtype):
                raise ValueError(f"this Int4Weight's dequantized values pass {dtype_name(dtype)}'s range (they "
                                 f"would be inf in {dtype_name(dtype)}): keep it {dtype_name(self.dtype)}")
        return Int4Weight(qweight, scales, zeros, self.group_size, self.shape, move(self.perm))

    def cuda(self, device=None) -> "Int4Weight":
        return self.to(torch.device("cuda") if device is None else torch.device("cuda", device)
                       if isinstance(device, int) else device)

    def cpu(self) -> "Int4Weight":
        return self.to("cpu")

    def half(self) -> "Int4Weight":
        return self.to(torch.float16)

    def bfloat16(self) -> "Int4Weight":
        return self.to(torch.bfloat16)

    def state_dict(self) -> dict:
        d = {k: v for k, v in self.tensors().items() if v is not None}
        d["group_size"] = torch.tensor(self.group_size)
        d["shape"] = torch.tensor(self.shape)
        return d

    @classmethod
    def from_state_dict(cls, d: dict) -> "Int4Weight":
        if not isinstance(d, Mapping):
            raise TypeError(f"Int4Weight.from_state_dict takes a dict (Int4Weight.state_dict()), got "
                            f"{type(d).__name__}")
        missing = [k for k in ("qweight", "scales", "zeros", "group_size", "shape") if k not in d]
        if missing:
            raise ValueError(f"Int4Weight.from_state_dict: the state dict has no {', '.join(missing)} (it has "
                             f"{', '.join(map(str, d)) or 'no keys'})")
        perm = d.get("perm")
        perm = perm if perm is not None and perm.numel() else None
        return cls(d["qweight"], d["scales"], d["zeros"], int(d["group_size"]), tuple(int(v) for v in d["shape"]),
                   perm)

    def __reduce__(self):
        # Rebuilt from tensors and ints only, so torch.load(weights_only=True) takes it (see safe globals).
        return (_rebuild, (self.qweight, self.scales, self.zeros, self.group_size, self.shape, self.perm))

    def __repr__(self) -> str:
        order = ", act-order" if self.perm is not None else ""
        return (f"Int4Weight(shape={list(self.shape)}, group_size={self.group_size}, dtype={self.dtype}, "
                f"device={self.device}{order}, nbytes={self.nbytes})")


def _rebuild(qweight, scales, zeros, group_size, shape, perm):
    return Int4Weight(qweight, scales, zeros, group_size, shape, perm)


_TO_KEYWORDS = ("device", "dtype", "non_blocking", "copy", "memory_format")


def _to_args(args, kwargs) -> tuple[torch.device | None, torch.dtype | None, bool, bool]:
    """``Int4Weight.to``'s arguments as ``Tensor.to`` takes them: ``(device, dtype, non_blocking, copy)``; a keyword
    it does not know is a TypeError (a misspelt one was ignored)."""
    unknown = [k for k in kwargs if k not in _TO_KEYWORDS]
    if unknown:
        raise TypeError(f"Int4Weight.to got an unexpected keyword argument {unknown[0]!r} (it takes "
                        f"{', '.join(_TO_KEYWORDS)})")
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    flags = [kwargs.get("non_blocking", False), kwargs.get("copy", False)]
    given = 0
    for a in args:
        if isinstance(a, bool):  # (before int: a bool is one) non_blocking, then copy, as Tensor.to's order
            if given == 2:
                raise TypeError("Int4Weight.to takes at most two bools (non_blocking, copy)")
            flags[given], given = a, given + 1
        elif isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (str, torch.device, int)):
            device = a
        else:
            raise TypeError(f"Int4Weight.to takes a device and/or a dtype, got {type(a).__name__}")
    return (torch.device(device) if device is not None else None), dtype, bool(flags[0]), bool(flags[1])


# --- checks ------------------------------------------------------------------------------------------------


def check_group_size_value(group_size, who: str = "") -> None:
    """A ValueError unless ``group_size`` is one of :data:`GROUP_SIZES` (``who``: the caller's name, prefixed)."""
    plain = isinstance(group_size, int) and not isinstance(group_size, bool)
    if not plain or group_size not in GROUP_SIZES:
        # (named by type too: "got np.int64(64)" read as a listed value refused)
        kind = "" if plain else f" ({type(group_size).__name__}, not a Python int)"
        raise ValueError(f"{who + ': ' if who else ''}group_size must be one of {', '.join(map(str, GROUP_SIZES))} "
                         f"(-1: all of K), got {group_size!r}{kind}")


def check_group_size(group_size, K: int) -> None:
    check_group_size_value(group_size)
    if K % 8:
        raise ValueError(f"K = in_features = {K} must be a multiple of 8 (eight 4-bit weights per int32)")
    if group_size != -1 and K % group_size:
        raise ValueError(f"K = in_features = {K} is not divisible by group_size = {group_size}")


def _as_int(name: str, v) -> int:
    """``v`` as an int, refusing what ``int()`` would truncate or parse (a float, a string) and bools."""
    if isinstance(v, bool):  # (True is an int)
        raise TypeError(f"Int4Weight: {name} must be an int, got {v!r}")
    try:
        return operator.index(v)  # ints, SymInts (a traced shape), numpy and 0-dim integer tensors
    except TypeError:
        raise TypeError(f"Int4Weight: {name} must be an int, got {type(v).__name__} {v!r}") from None


def _as_shape(shape) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints (the logical ``(N, K)`` or ``(E, N, K)``)."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"Int4Weight: shape must be (N, K) or (E, N, K), got {type(shape).__name__} "
                        f"{shape!r}") from None
    dims = tuple(_as_int("shape", d) for d in dims)
    if any(d < 0 for d in dims):
        raise ValueError(f"Int4Weight: shape must be non-negative, got {list(dims)}")
    return dims


def fragment_shapes(shape, group_k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of :func:`pack_fragments`' ``(fweight, fzs)`` for a weight of logical ``shape`` (``[N, K]``, or
    ``[E, N, K]``: a leading E on both) and group length ``group_k``."""
    N, K = shape[-2:]
    n16, k64 = cdiv(N, 256) * 16, cdiv(K, 128) * 2  # as pack_fragments pads them
    lead = tuple(shape[:-2])
    return lead + (n16, k64, 32, 4), lead + (cdiv(k64 * 64, group_k), n16, 8, 4)


def check_fragments(w: "Int4Weight", frag) -> None:
    """Raise TypeError/ValueError unless ``frag`` is a fragment layout ``(fweight, fzs)`` of ``w``'s shape, group
    length, scales' dtype and device (:meth:`Int4Weight.fragments` makes one)."""
    if not isinstance(frag, (tuple, list)) or len(frag) != 2 or not all(isinstance(t, torch.Tensor) for t in frag):
        raise TypeError(f"Int4Weight: frag must be a pair of tensors (fweight, fzs), got {type(frag).__name__}")
    if not fits_fragments(w.group_k, w.shape[-1]):
        raise ValueError(f"Int4Weight: a weight of K = {w.shape[-1]} and group_size {w.group_size} has no fragment "
                         f"layout (frag must be None)")
    want = fragment_shapes(w.shape, w.group_k)
    for name, t, shape, dtype in (("fweight", frag[0], want[0], torch.int32), ("fzs", frag[1], want[1], w.dtype)):
        if t.dtype != dtype:
            raise TypeError(f"Int4Weight: frag's {name} must be {dtype_name(dtype)}, got {dtype_name(t.dtype)}")
        if tuple(t.shape) != shape:
            raise ValueError(f"Int4Weight: frag's {name} must be {list(shape)} for a weight {list(w.shape)} of "
                             f"group_size {w.group_size}, got {list(t.shape)}")
        if t.device != w.device:
            raise ValueError(f"Int4Weight: frag's {name} is on {t.device}, the weight on {w.device}")
        if not t.is_contiguous():
            raise ValueError(f"Int4Weight: frag's {name} must be contiguous")


def _values_checkable(t: torch.Tensor) -> bool:
    """Whether a check may read ``t``'s values here: not while a graph is traced (``torch.compile``, export: an
    autocast call converts the scales in the graph, with no values to branch on), not a tensor subclass standing for
    others (a fake, functional or DTensor), not in a CUDA graph capture (a read would synchronize)."""
    return (not torch.compiler.is_compiling() and type(t) in (torch.Tensor, torch.nn.Parameter)
            and not (t.is_cuda and torch.cuda.is_current_stream_capturing()))


def _check_finite(name: str, t: torch.Tensor) -> None:
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} has non-finite values (inf or NaN)")


def dequantized_overflow(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a weight ``(q - zero) * scale`` of these parts (qweight ``[..., K/8, N]``, scales and zeros
    ``[..., G, N]``) rounds to inf in ``dtype``, as :func:`dequantize` rounds it: a bound from the scales and zeros
    first, the 4-bit values read only where the bound passes the range."""
    K, G = qweight.shape[-2] * 8, scales.shape[-2]
    if not K or not G:
        return False
    s, z = scales.float(), zeros.float()
    if bool(torch.isfinite((torch.maximum(z, 15 - z) * s.abs()).to(dtype)).all()):  # |q - zero| <= max(z, 15 - z)
        return False
    q = ((qweight.unsqueeze(-2) >> _SHIFTS.to(qweight.device)[:, None]) & 15).flatten(-3, -2)  # [..., K, N]
    g = torch.arange(K, device=q.device) // (K // G)  # [K] group of each row
    return not bool(torch.isfinite(((q.float() - z[..., g, :]) * s[..., g, :]).to(dtype)).all())


def _check_perm_values(perm: torch.Tensor, K: int, stacked: bool) -> None:
    """``perm``'s values, a permutation of 0..K-1 (each expert's where ``stacked``), read only where that stalls
    nothing (the CPU; on the GPU a bad perm reads wrong rows of x)."""
    if perm.device.type == "cpu" and K and _values_checkable(perm) \
            and not torch.equal(perm.sort(-1).values, torch.arange(K).expand(perm.shape)):
        raise ValueError(f"perm must be a permutation of 0..{K - 1} (K = {K}) for each "
                         f"{'expert' if stacked else 'weight'}")


def validate(w: Int4Weight, values: bool = False) -> None:
    """Raise TypeError/ValueError when the parts of an :class:`Int4Weight` do not fit together; ``values``: also
    that ``perm`` is a permutation, where it is on the CPU (the products' checks ask; a weight may be built from
    buffers not filled yet)."""
    for name in ("qweight", "scales", "zeros", "perm"):  # (perm may be None)
        t = getattr(w, name)
        if not isinstance(t, torch.Tensor) and (t is not None or name != "perm"):
            raise TypeError(f"Int4Weight: {name} must be a torch.Tensor, got {type(t).__name__}")
    if len(w.shape) not in (2, 3):
        raise ValueError(f"an Int4Weight is [N, K] or stacked experts [E, N, K], got shape {list(w.shape)}")
    N, K = w.shape[-2:]
    lead = tuple(w.shape[:-2])  # (E,) for stacked experts
    check_group_size(w.group_size, K)
    G = 1 if w.group_size == -1 else K // w.group_size
    if w.qweight.dtype != torch.int32:  # a wrong dtype is a TypeError, as everywhere else
        raise TypeError(f"qweight must be int32 [K/8, N] = [{K // 8}, {N}], got {dtype_name(w.qweight.dtype)}")
    if tuple(w.qweight.shape) != lead + (K // 8, N):
        raise ValueError(f"qweight must be int32 {list(lead + (K // 8, N))} ([K/8, N]), got {list(w.qweight.shape)}")
    for name in ("scales", "zeros"):
        t = getattr(w, name)
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be fp16 or bf16, got {dtype_name(t.dtype)}")
        if tuple(t.shape) != lead + (G, N):
            raise ValueError(f"{name} must be {list(lead + (G, N))} ([G, N]), got {list(t.shape)}")
    if w.zeros.dtype != w.scales.dtype:
        raise TypeError(f"zeros ({w.zeros.dtype}) and scales ({w.scales.dtype}) must share a dtype")
    tensors = {"qweight": w.qweight, "scales": w.scales, "zeros": w.zeros}
    if w.perm is not None:  # stacked experts: one permutation an expert, [E, K]
        if w.perm.dtype != torch.int64:  # a wrong dtype is a TypeError, as qweight's
            raise TypeError(f"perm must be int64 {list(lead + (K,))}, got {dtype_name(w.perm.dtype)}")
        if tuple(w.perm.shape) != lead + (K,):
            raise ValueError(f"perm must be int64 {list(lead + (K,))}, got {w.perm.dtype} {list(w.perm.shape)}")
        if values:
            _check_perm_values(w.perm, K, bool(lead))
        tensors["perm"] = w.perm
    # zeros are whole numbers held as floats: the 16-bit kernels add them to the 4-bit values as integers (a fraction
    # would be rounded away, silently off from dequantize); read only where that stalls nothing, as perm's
    if values and w.zeros.device.type == "cpu" and w.zeros.numel() and _values_checkable(w.zeros):
        z = w.zeros.float()
        # (0..16 is what the formats give; the gemv kernel adds 16 under an exponent, which holds no larger zero)
        for bad, rule in ((z != z.round(), "be whole numbers (the 4-bit zero points, held as floats)"),
                          ((z < 0) | (z > 16), "lie in 0..16 (the 4-bit zero points)")):
            where = bad.nonzero()
            if len(where):
                at = tuple(where[0].tolist())
                raise ValueError(f"zeros must {rule}, got {z[at].item()} at {list(at)}")
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"the parts of an Int4Weight are on different devices: {devices}")
    for name in ("qweight", "scales", "zeros"):
        if not tensors[name].is_contiguous():
            raise ValueError(f"{name} must be contiguous")


# --- quantize / dequantize ---------------------------------------------------------------------------------


def quantize(weight: torch.Tensor, group_size: int = 128, symmetric: bool = False) -> Int4Weight:
    """Round-to-nearest min-max 4-bit quantization of a linear weight ``[N, K]`` (fp16, bf16 or fp32).

    Per group of ``group_size`` consecutive inputs (K) of each output row: asymmetric (the default) maps the
    group's range, widened to hold 0, onto 0..15 with an integer zero point; ``symmetric=True`` uses zero 8 and
    scale ``max|w| / 7``. The scales take the weight's dtype (fp32 weights: fp16), rounded up where rounding to
    nearest falls below the exact step, and values are rounded against the stored scale (within half a step of
    it), so ``dequantize`` is the weight the kernels multiply by.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    check_dense("weight", weight)
    if not isinstance(symmetric, bool):  # (a truthy string would choose the symmetric form unnoticed)
        raise TypeError(f"symmetric must be True or False, got {symmetric!r}")
    if weight.dim() == 3:  # stacked experts [E, N, K]: every row quantized alone, so as one [E*N, K] weight
        E, N, K = weight.shape
        flat = quantize(weight.reshape(E * N, K), group_size, symmetric)
        return Int4Weight(*(t.reshape(t.shape[0], E, N).transpose(0, 1).contiguous()  # (E or N may be 0)
                            for t in (flat.qweight, flat.scales, flat.zeros)), group_size, (E, N, K))
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K] (out_features, in_features) or 3-D [E, N, K] (experts), got "
                         f"{list(weight.shape)}")
    if weight.dtype not in (*FLOAT_DTYPES, torch.float32):
        raise TypeError(f"weight must be fp16, bf16 or fp32, got {dtype_name(weight.dtype)}")
    N, K = weight.shape
    check_group_size(group_size, K)
    if not weight.is_meta:  # (meta: a model built before loading; shapes only)
        _check_finite("weight", weight)
    dtype = weight.dtype if weight.dtype in FLOAT_DTYPES else torch.float16
    if K == 0:  # no inputs (torch's Linear(0, N) returns its bias): no groups, or one empty one for -1
        G, kw = (1 if group_size == -1 else 0), dict(dtype=dtype, device=weight.device)
        return Int4Weight(torch.zeros((0, N), dtype=torch.int32, device=weight.device), torch.ones((G, N), **kw),
                          torch.zeros((G, N), **kw), group_size, (N, K))
    gk = K if group_size == -1 else group_size
    w = weight.detach().float().reshape(N, K // gk, gk)  # [N, G, gk]
    if symmetric:
        scale = w.abs().amax(dim=2) / 7.0
        zero = torch.full_like(scale, 8.0)
    else:
        lo = w.amin(dim=2).clamp(max=0.0)
        hi = w.amax(dim=2).clamp(min=0.0)
        scale = (hi - lo) / 15.0
    # An all-zero group has scale 0; any positive scale represents it exactly.
    exact = torch.where(scale > 0, scale, torch.ones_like(scale))
    scale = exact.to(dtype)
    # rounded up where rounding to nearest went below the exact step, so the group's extremes still map inside
    # 0..15 (they were clamped, up to 0.54 of a step off in bf16 and more on fp16's subnormal scales); a tiny scale
    # that underflowed to zero becomes the smallest one above it
    scale = torch.where(scale.float() < exact, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    s = scale.float()
    if not symmetric:
        zero = torch.round(-lo / s).clamp(0, 15)
    q = torch.clamp(torch.round(w / s[:, :, None]) + zero[:, :, None], 0, 15)  # [N, G, gk]
    qweight = pack_rows(q.reshape(N, K).T.contiguous())
    scales = scale.T.contiguous()  # [G, N]
    zeros = zero.T.contiguous().to(dtype)
    if not weight.is_meta:
        _check_finite("scales", scales)
        # fp32 weights near fp16's limit: a finite scale times (q - zero) can still round to inf in 16 bits
        if not torch.isfinite(((q - zero[:, :, None]) * s[:, :, None]).to(dtype)).all():
            raise ValueError(f"weight's values do not fit {dtype_name(dtype)} once quantized (dequantized values "
                             f"overflow to inf): quantize it in bf16 (weight.bfloat16()) or scale it down")
    return Int4Weight(qweight, scales, zeros, group_size, (N, K))


def unpacked(w: Int4Weight) -> torch.Tensor:
    """The 4-bit values ``q`` as uint8 ``[K, N]`` in stored order (sorted by group when act-order)."""
    return unpack_rows(w.qweight)


def dequantize(w: Int4Weight) -> torch.Tensor:
    """The weight ``[N, K]`` the 4-bit one stands for, in the scales' dtype: the reference of every kernel.

    ``W.T[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]``, computed exactly in fp32 and rounded once.
    """
    if not isinstance(w, Int4Weight):
        raise TypeError(f"dequantize takes an Int4Weight, got {type(w).__name__}")
    if len(w.shape) == 3:  # stacked experts: [E, N, K]
        if not w.shape[0]:
            return w.scales.new_empty(w.shape)
        return torch.stack([dequantize(w.expert(e)) for e in range(w.shape[0])])
    K = w.shape[1]
    g = torch.arange(K, device=w.device) // w.group_k  # [K] group of each stored row
    wt = (unpacked(w).float() - w.zeros.float()[g]) * w.scales.float()[g]  # [K, N]
    wt = wt.to(w.dtype)
    if w.perm is not None:
        _check_perm_values(w.perm, K, False)  # (as the products check it: a repeated index left rows unwritten)
        out = torch.empty_like(wt)
        out[w.perm] = wt  # stored row j is input k = perm[j]
        wt = out
    return wt.T.contiguous()


# --- importers --------------------------------------------------------------------------------------------


def _check_int32(name: str, t, shape_text: str, dims: int = 2) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 {shape_text}, got {dtype_name(t.dtype)}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {shape_text}, got {list(t.shape)}")


def _check_scales(scales, G: int, N: int) -> None:
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"scales must be a torch.Tensor, got {type(scales).__name__}")
    if scales.dtype not in FLOAT_DTYPES:
        raise TypeError(f"scales must be fp16 or bf16, got {dtype_name(scales.dtype)}")
    if tuple(scales.shape) != (G, N):
        raise ValueError(f"scales must be [G, N] = [{G}, {N}], got {list(scales.shape)}")
    if not scales.is_meta:  # (meta: shapes only, no values to check; the parts' devices are checked after)
        _check_finite("scales", scales)


def one_group_size(K: int, recorded=()) -> int:
    """The group length of a layer of ``K`` inputs stored as one group, which its tensors cannot say (-1 and K
    make the same weight): K where the record kept beside the tensors (a saved config's group sizes, a state
    dict's metadata) lists K, else -1 where it lists -1, else what the shapes give (K where the kernels take it
    as a group size, else -1)."""
    if K in recorded:
        return K
    return -1 if -1 in recorded else _group_size_of(1, K)


def _group_size_of(G: int, K: int) -> int:
    if G < 1 or K % G:
        raise ValueError(f"{G} groups do not divide K = {K} evenly")
    gs = K // G
    if G == 1 and gs not in GROUP_SIZES:
        return -1
    if gs not in GROUP_SIZES:
        raise ValueError(f"group size K / G = {K} / {G} = {gs} is not one of {', '.join(map(str, GROUP_SIZES))}")
    return gs


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              g_idx: torch.Tensor | None = None) -> Int4Weight:
    """Import a 4-bit GPTQ checkpoint (format v1: AutoGPTQ / GPTQModel's saved one).

    ``qweight`` int32 ``[K/8, N]`` packed along K; ``qzeros`` int32 ``[G, N/8]`` packed along N, holding
    ``zero - 1``; ``scales`` ``[G, N]``; ``g_idx`` int ``[K]`` (optional): the group of each input. With
    act-order (``desc_act=True``) the inputs are sorted by group once here, and the kernels read
    ``x[..., perm]``. ``W.T[k, n] = scales[g_idx[k], n] * (q[k, n] - (qzeros[g_idx[k], n] + 1))``.
    """
    _check_int32("qweight", qweight, "[K/8, N]")
    _check_int32("qzeros", qzeros, "[G, N/8]")
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    G = qzeros.shape[0]
    if N % 8 or qzeros.shape[1] * 8 != N:
        raise ValueError(f"qzeros must be [G, N/8] with N = {N} a multiple of 8, got {list(qzeros.shape)}")
    _check_scales(scales, G, N)
    zeros = (unpack_cols(qzeros).float() + 1).to(scales.dtype)  # [G, N]; v1 stores zero - 1
    return _by_groups(qweight, scales, zeros, g_idx)


def _by_groups(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx) -> Int4Weight:
    """The :class:`Int4Weight` of ``qweight`` int32 ``[K/8, N]`` (packed along K), ``scales`` and ``zeros``
    ``[G, N]``, whose input ``k`` belongs to group ``g_idx[k]`` (None: ``k // (K / G)``). Act-order (any other
    ``g_idx``): the inputs sorted by group once here (stable), so groups are contiguous again; ``perm`` records
    the order the kernels read x in."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    G = scales.shape[0]
    group_size = _group_size_of(G, K)
    perm = None
    q = qweight
    if g_idx is not None:
        if not isinstance(g_idx, torch.Tensor) or g_idx.dtype.is_floating_point or tuple(g_idx.shape) != (K,):
            raise ValueError(f"g_idx must be an integer tensor [K] = [{K}]")
        if g_idx.is_meta:  # the order is read from its values, which a meta tensor has none of
            raise ValueError("g_idx is on the meta device: the act-order permutation is read from its values; "
                             "load it onto a real device first")
        g_idx = g_idx.to(torch.int64)
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= G):  # (K = 0: no inputs, no groups)
            raise ValueError(f"g_idx holds groups outside 0..{G - 1}")
        natural = torch.arange(K, device=g_idx.device) // (K // G)
        if not torch.equal(g_idx, natural):
            perm = torch.sort(g_idx, stable=True).indices
            if not torch.equal(g_idx[perm], natural):
                raise ValueError(f"g_idx must put exactly K / G = {K // G} inputs in each group")
            q = pack_rows(unpack_rows(qweight)[perm.to(qweight.device)])
            perm = perm.to(qweight.device)
    return Int4Weight(q.contiguous(), scales.contiguous(), zeros.contiguous(), group_size, (N, K), perm)


def from_compressed_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                            weight_zero_point: torch.Tensor | None = None,
                            g_idx: torch.Tensor | None = None) -> Int4Weight:
    """Import one Linear of a 4-bit compressed-tensors checkpoint stored ``"pack-quantized"`` (llm-compressor's
    W4A16 and W4A16_ASYM schemes).

    ``weight_packed`` int32 ``[N, K/8]``, packed along K: nibble ``i`` of word ``j`` of row ``n`` holds
    ``q[n, 8j + i] + 8``, q the signed value -8..7 (so ``weight_packed.T`` is GPTQ's and this format's qweight,
    read without repacking). ``weight_scale`` ``[N, G]`` (G = 1: one scale a row, the ``"channel"`` strategy).
    ``weight_zero_point``: None for symmetric weights (zero 0); asymmetric, int32 ``[ceil(N/8), G]`` packed along
    N the same way (``zero + 8``), or the signed zeros ``[N, G]`` unpacked, as releases before the packed form
    stored them. ``g_idx`` int ``[K]`` (optional, act-order): the group of each input; one holding -1 (never
    set) stands for the natural order, as compressed-tensors reads it.
    ``W[n, k] = weight_scale[n, g] * (q[n, k] - zero[n, g])``, ``g = g_idx[k]``.
    """
    _check_int32("weight_packed", weight_packed, "[N, K/8]")
    N, K = weight_packed.shape[0], weight_packed.shape[1] * 8
    if not isinstance(weight_scale, torch.Tensor):
        raise TypeError(f"weight_scale must be a torch.Tensor, got {type(weight_scale).__name__}")
    if weight_scale.dim() != 2 or weight_scale.shape[0] != N:
        raise ValueError(f"weight_scale must be [N, G] with N = {N}, got {list(weight_scale.shape)}")
    G = weight_scale.shape[1]
    scales = weight_scale.T
    _check_scales(scales, G, N)
    if weight_zero_point is None:
        zeros = torch.full((G, N), 8, dtype=scales.dtype, device=scales.device)  # signed 0, stored unsigned as 8
    elif not isinstance(weight_zero_point, torch.Tensor):
        raise TypeError(f"weight_zero_point must be a torch.Tensor or None, got {type(weight_zero_point).__name__}")
    elif weight_zero_point.dtype.is_floating_point or weight_zero_point.dtype == torch.bool:
        raise TypeError(f"weight_zero_point must be an integer tensor, got {dtype_name(weight_zero_point.dtype)}")
    elif tuple(weight_zero_point.shape) == (cdiv(N, 8), G) and weight_zero_point.dtype == torch.int32:
        zeros = unpack_rows(weight_zero_point)[:N].T.to(scales.dtype)  # the unsigned form: zero + 8
    elif tuple(weight_zero_point.shape) == (N, G):
        zp = weight_zero_point.to(torch.int64)
        if int(zp.min()) < -8 or int(zp.max()) > 7:
            raise ValueError("weight_zero_point (unpacked, [N, G]) must hold signed 4-bit zeros, -8..7")
        zeros = (zp + 8).T.to(scales.dtype)
    else:
        raise ValueError(f"weight_zero_point must be int32 [ceil(N/8), G] = [{cdiv(N, 8)}, {G}] (packed) or "
                         f"[N, G] = [{N}, {G}] (unpacked), got {dtype_name(weight_zero_point.dtype)} "
                         f"{list(weight_zero_point.shape)}")
    return _by_groups(weight_packed.T.contiguous(), scales, zeros, ct_g_idx(g_idx))


def ct_g_idx(g_idx):
    """A compressed-tensors ``weight_g_idx`` as the group of each input, or None for the natural order: where it
    holds -1, the value compressed-tensors initialises it with, the layer was never reordered."""
    if isinstance(g_idx, torch.Tensor) and not g_idx.dtype.is_floating_point and bool((g_idx == -1).any()):
        return None
    return g_idx


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> Int4Weight:
    """Import a 4-bit AutoAWQ checkpoint of the "GEMM" version (not "GEMV", which packs along K).

    ``qweight`` int32 ``[K, N/8]`` and ``qzeros`` int32 ``[G, N/8]``, packed along N with the interleaved
    nibble order ``[0, 2, 4, 6, 1, 3, 5, 7]``; ``scales`` ``[G, N]``.
    ``W.T[k, n] = scales[k // group_size, n] * (q[k, n] - zero[k // group_size, n])``.
    """
    _check_int32("qweight", qweight, "[K, N/8]")
    _check_int32("qzeros", qzeros, "[G, N/8]")
    K, N = qweight.shape[0], qweight.shape[1] * 8
    G = qzeros.shape[0]
    if qzeros.shape[1] != qweight.shape[1]:
        raise ValueError(f"qzeros must be [G, N/8] = [G, {N // 8}], got {list(qzeros.shape)}")
    if K % 8:
        raise ValueError(f"K = {K} must be a multiple of 8")
    _check_scales(scales, G, N)
    group_size = _group_size_of(G, K)
    q = unpack_cols(qweight, AWQ_ORDER)  # [K, N]
    zeros = unpack_cols(qzeros, AWQ_ORDER).to(scales.dtype)
    return Int4Weight(pack_rows(q), scales.contiguous(), zeros.contiguous(), group_size, (N, K))


# --- experts -------------------------------------------------------------------------------------------------


def _check_joinable(what: str, weights) -> list:
    weights = list(weights)
    if not weights or not all(isinstance(w, Int4Weight) for w in weights):
        raise TypeError(f"{what} takes a non-empty list of Int4Weight")
    first = weights[0]
    for i, w in enumerate(weights):
        if len(w.shape) != 2:
            raise ValueError(f"{what}: weight {i} is {list(w.shape)}, not a 2-D [N, K] weight")
        if w.group_size != first.group_size or w.shape[1] != first.shape[1]:
            raise ValueError(f"{what}: weight {i} has K = {w.shape[1]}, group_size {w.group_size}; weight 0 has "
                             f"K = {first.shape[1]}, group_size {first.group_size} (they must agree)")
        if w.dtype != first.dtype or w.device != first.device:
            raise ValueError(f"{what}: weight {i} is {w.dtype} on {w.device}, weight 0 {first.dtype} on "
                             f"{first.device}")
    return weights


def _perm_or_identity(w: Int4Weight) -> torch.Tensor:
    return w.perm if w.perm is not None else torch.arange(w.shape[-1], device=w.device)


def regroup(w: Int4Weight, group_size: int, perm: torch.Tensor | None = None) -> Int4Weight:
    """The same ``[N, K]`` weight with its rows in the input order ``perm`` (None: the natural one) and in groups
    of ``group_size`` (-1: all of K): each new group takes the scale and zero of the group of ``w`` that holds
    it, so every weight keeps its value. Weights stored in several group sizes or act-order orders, joined into one
    (an expert's gate and up projections, experts that per-module settings stored apart): a coarser group splits
    into finer ones, a one-group weight takes any order, and act-order groups of one order split into the finer
    groups of that order. ValueError where a new group would hold inputs of two of ``w``'s groups."""
    if len(w.shape) != 2:
        raise ValueError(f"regroup takes a 2-D [N, K] weight, got {list(w.shape)}")
    N, K = w.shape
    size = K if group_size == -1 else group_size
    if not isinstance(size, int) or size <= 0 or K % size:
        raise ValueError(f"regroup: group_size {group_size!r} does not cut K = {K} into whole groups")
    dev = w.qweight.device
    natural = torch.arange(K, device=dev)
    src = w.perm if w.perm is not None else natural  # row r of w holds input src[r]
    tgt = perm.to(dev, torch.int64) if perm is not None else natural
    same_order = torch.equal(src, tgt)
    if same_order and size == w.group_k:
        return w if group_size == w.group_size else Int4Weight(w.qweight, w.scales, w.zeros, group_size, w.shape,
                                                                w.perm)
    row_of = torch.empty(K, dtype=torch.int64, device=dev)
    row_of[src] = natural  # the row of w holding input k
    groups = (row_of[tgt] // w.group_k).reshape(K // size, size)  # w's group of each new row
    if not bool((groups == groups[:, :1]).all()):
        raise ValueError(f"regroup: the weight's act-order input permutation differs from the order asked, and its "
                         f"groups of {w.group_k} inputs are not whole groups of {size} in that order")
    first = groups[:, 0]
    qweight = w.qweight if same_order else pack_rows(unpack_rows(w.qweight)[row_of[tgt]])
    return Int4Weight(qweight, w.scales[first].contiguous(), w.zeros[first].contiguous(), group_size, w.shape,
                      None if perm is None else tgt.clone())


def stack_experts(weights) -> Int4Weight:
    """The stacked ``[E, N, K]`` weight of ``E`` experts' ``[N, K]`` weights (same shape, group size, dtype and
    device): what ``quantize`` of a 3-D weight gives, for experts imported one by one. Act-order experts keep their
    input permutations, stacked ``[E, K]`` (an expert without one gets the identity)."""
    weights = _check_joinable("stack_experts", weights)
    if any(w.shape != weights[0].shape for w in weights):
        raise ValueError(f"stack_experts: the experts' shapes differ: {sorted({w.shape for w in weights})}")
    parts = (torch.stack([getattr(w, p) for w in weights]) for p in ("qweight", "scales", "zeros"))
    perm = None
    if any(w.perm is not None for w in weights):
        perm = torch.stack([_perm_or_identity(w) for w in weights])
    return Int4Weight(*parts, weights[0].group_size, (len(weights), *weights[0].shape), perm)


def concat_outputs(weights, interleave: bool = False) -> Int4Weight:
    """One ``[N1 + N2 + ..., K]`` weight of weights sharing K and the group size (their output rows one after the
    other), or, with ``interleave``, rows taken in turn from each (equal N): a MoE expert's gate and up projections
    as transformers' ``gate_up_proj`` holds them (concatenated or interleaved). Act-order weights join when they
    share one input permutation (the gate and up projections of one input do)."""
    weights = _check_joinable("concat_outputs", weights)
    perm = None
    if any(w.perm is not None for w in weights):
        perm = _perm_or_identity(weights[0])
        for i, w in enumerate(weights[1:], 1):
            if not torch.equal(_perm_or_identity(w), perm):
                raise ValueError(f"concat_outputs: weight {i}'s act-order input permutation differs from weight "
                                 f"0's; joined outputs must read their inputs in one order")
    if interleave:
        if len({w.shape[0] for w in weights}) != 1:
            raise ValueError("concat_outputs(interleave=True) takes weights of equal N")
        join = lambda ts: torch.stack(ts, dim=-1).flatten(-2)  # noqa: E731 - column n of weight j -> n * len + j
    else:
        join = lambda ts: torch.cat(ts, dim=-1)  # noqa: E731
    parts = (join([getattr(w, p) for w in weights]).contiguous() for p in ("qweight", "scales", "zeros"))
    return Int4Weight(*parts, weights[0].group_size, (sum(w.shape[0] for w in weights), weights[0].shape[1]), perm)
