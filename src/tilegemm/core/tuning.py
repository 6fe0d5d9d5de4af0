"""Tuned configs that persist: per GPU and Triton version, on disk, with defaults shipped in the package.

A tuned rung (``autotuned``, ``persistent_tma``) asks :func:`lookup` before timing anything and calls
:func:`record` after. Keys bucket M to the next power of two (1, 2, 4, ..., 8192, then exact), so a new batch
size reuses the config of its bucket instead of re-tuning; N, K and the dtypes are exact.

Where configs come from, first hit wins:
1. this process's memory;
2. the user's cache file, ``$TILEGEMM_CACHE_DIR`` or ``~/.cache/tilegemm``, one file per GPU and Triton version;
3. the package's ``tilegemm/tuned/<gpu>.json`` (shipped defaults, so a first call on a known shape class on a
   known GPU tunes nothing).

Writes are atomic (a temporary file renamed over the old one); a damaged file is ignored with a warning and
rewritten on the next save. ``TILEGEMM_TUNING_CACHE=0`` turns the disk off (memory only).

The user's file holds only what was tuned on that machine (its ``"tuned_only"`` field says so), so a
later release's shipped configs reach users who tuned before. Files written before that field existed also
held copies of the shipped entries of their day; from such a file the keys that the package ships now are
ignored (a key the user had tuned then was not shipped then, since a shipped entry was found first).
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import warnings
from pathlib import Path

from tilegemm.core.dtypes import dtype_name, rename_old
from tilegemm.core.files import atomic_write
from tilegemm.core.runtime import fork_safe

SCHEMA = "tilegemm-tuned/2"  # 2: dtype labels in tilegemm's vocabulary (fp16, fp8_e4m3); 1 had torch's names
_lock = fork_safe(threading.Lock())
_memory: dict[str, dict] = {}
_tuned: dict[str, dict] = {}  # what the user's file holds: its own entries and this process's tunings
_guessed: dict[tuple, dict] = {}  # untimed choices of this process (choose_untimed): never neighbours, never saved
GUESSED_MAX = 4096  # forgotten all at once past this many (a server's varying shapes; each is made again cheaply)
_borrowed: set[str] = set()  # shipped keys read from a sibling GPU's file (table_slug): not this GPU's measurements
_loaded_for: str | None = None
_shipped: set[str] = set()  # the keys of the shipped table read
_generation = 0  # bumped when entries are recorded or dropped: answers derived from the entries go stale


def generation() -> int:
    """A counter that changes whenever this process records or drops entries (for caches of answers that
    depend on which entries exist). Entries read again for another GPU do not change it: the caches that use
    it key their answers by device too."""
    return _generation


def m_bucket(m: int) -> int:
    """The power of two at or above M, up to 8192; above that M itself."""
    if m > 8192:
        return m
    bucket = 1
    while bucket < m:
        bucket *= 2
    return bucket


def key(rung: str, M: int, N: int, K: int, dtype, out_dtype, layout: str = "", batch: int = 1) -> str:
    """A shape class's key: the rung, M bucketed (:func:`m_bucket`), N, K, the dtypes and the layout; a batched
    product's (``batch`` > 1) adds its batch count bucketed the same way (``|B32``). A batched class is its own:
    it never takes a single product's entry, nor lends its own (:func:`parse_key` does not read it, so
    :func:`nearest` passes it by), since its tiles fill the GPU ``batch`` times over (a single product's config
    runs a batch slowly: docs/performance.md)."""
    base = f"{rung}|M{m_bucket(M)}|N{N}|K{K}|{dtype_name(dtype)}|{dtype_name(out_dtype)}|{layout}"
    return base if batch <= 1 else f"{base}|B{m_bucket(batch)}"


def gpu_slug(gpu_name: str) -> str:
    """A GPU's name as the shipped tables' file names spell it (``NVIDIA H200`` -> ``nvidia-h200``)."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")


# A GPU the package ships no tables for takes those of a shipped sibling of its architecture, by name (as a
# slug): the H200's for the H200 NVL and the GH200 (132 SMs, HBM3e); the H100 SXM's for the H100 PCIe and NVL
# and the H800. The tables' ranking re-counts waves with the GPU's own SM count; its measured speeds carry over
# (a sibling's tables beat the rules alone: docs/rungs/auto.md). Other GPUs (other architectures above all: the tables name Hopper-only kernels) keep the rules.
# A MIG slice (a few of the GPU's SMs) keeps the rules: the tables' entries were tuned for the whole GPU. While
# timing is on (``tilegemm tune``), a sibling's entries do not stand in for this GPU's own: its classes are timed.
SIBLINGS: list[tuple[str, str]] = [(r"^nvidia-g?h200(-|$)", "nvidia-h200"),
                                   (r"^nvidia-h[18]00(-|$)", "nvidia-h100-80gb-hbm3")]


def _tuned_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "tuned"


def ships_tables_for(slug: str) -> bool:
    """Whether the package ships tuned entries or a (16-bit NN) survey table under exactly this GPU slug."""
    tuned = _tuned_dir()
    return (tuned / f"{slug}.json").exists() or (tuned / "survey" / f"{slug}.json").exists()


@functools.lru_cache(maxsize=None)
def table_slug(gpu: str) -> str:
    """The slug whose shipped tables serve GPU ``gpu`` (a name as torch reports it, or its slug): its own where the
    package ships any, else a sibling's (:data:`SIBLINGS`), else its own (no file: the rules decide)."""
    slug = gpu_slug(gpu)
    if ships_tables_for(slug) or "-mig-" in slug:
        return slug
    for pattern, sibling in SIBLINGS:
        if re.search(pattern, slug) and ships_tables_for(sibling):
            return sibling
    return slug


def _device_tag() -> tuple[str, str]:
    """(gpu slug, triton version) of the current device."""
    import torch
    import triton

    from tilegemm.core.runtime import interpreting

    gpu = "interpreter" if interpreting() else torch.cuda.get_device_name()
    return gpu_slug(gpu), triton.__version__


def cache_dir() -> Path:
    """The folder of the user's tuning files: ``$TILEGEMM_CACHE_DIR`` (``~`` expanded), else ``~/.cache/tilegemm``;
    RuntimeError where neither can be had (no home directory: set the variable)."""
    named = os.environ.get("TILEGEMM_CACHE_DIR")
    if named:
        return Path(named).expanduser()
    try:
        return Path.home() / ".cache" / "tilegemm"
    except (RuntimeError, KeyError) as err:  # a user without a home (a container's arbitrary uid)
        raise RuntimeError(f"tilegemm: no home directory for the tuning cache ({err}): set TILEGEMM_CACHE_DIR "
                           f"to a writable folder") from None


def cache_file() -> Path:
    slug, triton_version = _device_tag()
    return cache_dir() / f"tuned-{slug}-triton{triton_version}.json"


def shipped_file() -> Path:
    """The package's tuned entries for this GPU (or its sibling's, :func:`table_slug`); it may not exist."""
    slug, _ = _device_tag()
    return _tuned_dir() / f"{table_slug(slug)}.json"


_SCHEMA_1 = "tilegemm-tuned/1"


def migrate_key(k: str) -> str:
    """A key of a ``tilegemm-tuned/1`` file as ``tilegemm-tuned/2`` writes it: its two dtype labels renamed."""
    parts = k.split("|")
    if len(parts) == 7:
        parts[4], parts[5] = rename_old(parts[4]), rename_old(parts[5])
    return "|".join(parts)


_warned_env: set[str] = set()


def env_flag(name: str, default: bool) -> bool:
    """A yes/no environment variable: 1, true, yes, on or 0, false, no, off (any case); unset or empty: ``default``;
    anything else: ``default``, with one warning naming the variable and the values it takes."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    if raw and name not in _warned_env:
        _warned_env.add(name)
        warnings.warn(f"tilegemm: {name}={os.environ[name]!r} is not one of 1, true, yes, on, 0, false, no, off; "
                      f"taken as {'on' if default else 'off'}", stacklevel=3)
    return default


_no_home_warned = False


def _disk_enabled() -> bool:
    global _no_home_warned
    from tilegemm.core.runtime import interpreting

    if not env_flag("TILEGEMM_TUNING_CACHE", True):
        return False
    # Under the interpreter there is nothing worth keeping, unless a cache folder was asked for explicitly.
    if interpreting() and not os.environ.get("TILEGEMM_CACHE_DIR"):
        return False
    try:
        cache_dir()
    except RuntimeError as err:
        if not _no_home_warned:
            _no_home_warned = True
            warnings.warn(f"{err}; tuned configs are kept in memory only", stacklevel=3)
        return False
    return True


# Configs' integer fields the kernels take as sizes: a file whose entry holds another type there (a string, a
# float, a size not a power of two where one must be) would fail every call that reads it.
_SIZES = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "num_warps", "num_stages", "STAGES")
_POWERS_OF_TWO = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps")
# The fields every entry of a rung holds (those its shipped tables all have).
_REQUIRED = {
    "autotuned": ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"),
    "split_k": ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "num_warps", "num_stages"),
    "auto": ("rung",),
    "persistent_tma": ("num_warps",),
}


def _sound(k: str, config) -> bool:
    """Whether a file's entry ``config`` for key ``k`` is a config this version's kernels can take: a non-empty
    dict of booleans, strings and non-negative integers, its sizes positive integers (powers of two where the
    kernels need them), with the fields its rung's entries always hold."""
    if not isinstance(config, dict) or not config:
        return False
    for name, value in config.items():
        if not isinstance(name, str) or not isinstance(value, (bool, int, str)):
            return False
        if name in _SIZES and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return False
        if name in _POWERS_OF_TWO and value & (value - 1):
            return False
        if isinstance(value, int) and value < 0:
            return False
    return all(name in config for name in _REQUIRED.get(k.split("|")[0], ()))


_keep_as_is: set[str] = set()  # files this process must not write over: unreadable, or of a newer schema


def _read(path: Path, quiet: bool = False) -> tuple[dict[str, dict], bool]:
    """(entries, whether the file says it holds tuned entries only) of a tuning file; ({}, True) for a
    missing or damaged one. Entries that are not configs this version's kernels take (:func:`_sound`) are
    left out, with a warning. A file that cannot be read, or was written with a schema this version does not
    know (a newer tilegemm's), is left as it is (:data:`_keep_as_is`): this process keeps its own tunings in memory
    only. ``quiet``: no warnings but that one (a file read again before it is written, whose reading warned)."""
    def warn(message: str) -> None:
        if not quiet:
            warnings.warn(message, stacklevel=4)

    def keep(reason: str) -> tuple[dict, bool]:
        if str(path) not in _keep_as_is:  # (once: at the load, or at a save where the file changed since)
            _keep_as_is.add(str(path))
            warnings.warn(f"tilegemm: {reason}; it is left as it is and this process's tunings are kept in memory "
                          f"only", stacklevel=4)
        return {}, True

    if not path.exists():
        return {}, True
    try:
        data = json.loads(path.read_text())
        schema = data.get("schema")
        if isinstance(schema, str) and schema.startswith("tilegemm-tuned/") and schema not in (SCHEMA, _SCHEMA_1):
            return keep(f"the tuning file {path} has schema {schema!r}, which this version does not read (a newer "
                        f"tilegemm's?)")
        if schema not in (SCHEMA, _SCHEMA_1) or not isinstance(data.get("entries"), dict):
            raise ValueError(f"schema {schema!r}")
        entries = dict(data["entries"])
        if schema == _SCHEMA_1:
            entries = {migrate_key(k): v for k, v in entries.items()}
        unsound = [k for k, v in entries.items() if not _sound(k, v)]
        if unsound:
            warn(f"tilegemm: {len(unsound)} entr{'y' if len(unsound) == 1 else 'ies'} of the tuning file {path} "
                 f"{'is' if len(unsound) == 1 else 'are'} not a config this version reads (first: {unsound[0]!r}); "
                 f"ignored")
        return {k: dict(v) for k, v in entries.items() if k not in unsound}, data.get("tuned_only") is True
    except OSError as err:  # (not UnicodeDecodeError, a ValueError: bytes that are no text are damage)
        return keep(f"cannot read the tuning file {path} ({err.strerror or err})")
    except (ValueError, TypeError, AttributeError, RecursionError) as err:
        warn(f"tilegemm: ignoring damaged tuning file {path} ({err}); it will be rebuilt")
        return {}, True


def _load() -> None:
    global _loaded_for
    tag = "|".join(_device_tag())
    if _loaded_for == tag:
        return
    with _lock:
        if _loaded_for == tag:
            return
        _memory.clear()
        _tuned.clear()
        _guessed.clear()
        _borrowed.clear()
        shipped, _ = _read(shipped_file())
        _memory.update(shipped)
        _shipped.clear()
        _shipped.update(shipped)
        own = _device_tag()[0]
        if table_slug(own) != own:
            _borrowed.update(shipped)
        if _disk_enabled():
            user, tuned_only = _read(cache_file())
            if not tuned_only:  # an older file: its copies of shipped entries must not hide today's
                user = {k: v for k, v in user.items() if k not in shipped}
            _tuned.update(user)
            _memory.update(user)
        _loaded_for = tag


def lookup(k: str) -> dict | None:
    """The config known for key ``k`` (tuned here, or shipped), or None. While timing is on, an entry shipped
    for a sibling GPU only (:func:`table_slug`) counts as unknown, so that ``tilegemm tune`` times the class."""
    _load()
    config = _memory.get(k)
    if config is not None and k in _borrowed and k not in _tuned and timing_enabled():
        return None
    return dict(config) if config is not None else None


def measured(k: str) -> bool:
    """Whether ``k`` was tuned on this machine (recorded here or read from the user's cache file), not only
    shipped with the package."""
    _load()
    return k in _tuned


_timing = threading.local()


def timing_enabled() -> bool:
    """Whether a call on an unseen shape class may time candidates: only when asked, through
    ``TILEGEMM_TUNE=1``, :func:`timing` (what ``tilegemm tune`` uses) or the tuner's own tests."""
    if getattr(_timing, "on", False):
        return True
    return env_flag("TILEGEMM_TUNE", False)


class timing:
    """``with tuning.timing(): ...``: calls inside time the candidates of unseen shape classes and record the
    fastest (this thread only)."""

    def __enter__(self):
        self.old = getattr(_timing, "on", False)
        _timing.on = True
        return self

    def __exit__(self, *exc):
        _timing.on = self.old


def parse_key(k: str):
    """(rung, M, N, K, dtype, out dtype, layout) of a key, or None for a key of another form."""
    parts = k.split("|")
    if len(parts) != 7 or not all(p[:1] == c and p[1:].isdigit() for p, c in zip(parts[1:4], "MNK")):
        return None
    return parts[0], int(parts[1][1:]), int(parts[2][1:]), int(parts[3][1:]), parts[4], parts[5], parts[6]


def _valid(config: dict, options: list[dict]) -> bool:
    """Whether ``config`` is one of ``options`` on the keys both have (an entry tuned before a key existed,
    such as ``HOST_DESC``, still matches the candidate it was)."""
    return any(all(option.get(key, value) == value for key, value in config.items()) for option in options)


# How far a tuned shape class may be for its config to be taken untimed (see nearest): a sum of |log2|
# ratios of M (bucketed), N and K, so 1.0 is, say, N twice as large. Farther, a rung's own model decides
# (autotuned and split_k: tilegemm.ops.matmul.cost), since a neighbour's tile was chosen for its number of
# tiles and its K, not this problem's.
NEAR = 1.0


def nearest(k: str, options: list[dict], max_distance: float = float("inf")) -> dict | None:
    """The config of the shipped or measured shape class nearest to ``k`` that ``options`` allow, or None.

    Near means: the same rung, operand and output dtypes; the smallest sum of |log2| ratios of M (bucketed),
    N and K, half a step more for another layout, at most ``max_distance``. A config is taken only if it is
    among ``options`` (the candidates valid for this problem, :func:`_valid`), so a neighbour's choice this
    problem cannot use is skipped. Untimed choices (:func:`choose_untimed`) are never neighbours.
    """
    import math

    me = parse_key(k)
    if me is None:
        return None
    _load()
    with _lock:
        known = list(_memory.items())
    best, best_d = None, math.inf
    for other, config in known:
        them = parse_key(other)
        if them is None or them[0] != me[0] or them[4:6] != me[4:6] or not _valid(config, options):
            continue
        d = sum(abs(math.log2(max(x, 1) / max(y, 1))) for x, y in zip(me[1:4], them[1:4]))  # K may be 0
        d += 0.5 if them[6] != me[6] else 0.0
        if d < best_d and d <= max_distance:
            best, best_d = config, d
    return dict(best) if best is not None else None


def choose_untimed(k: str, options, fallback=None, max_distance: float = float("inf"), variant=None) -> dict:
    """A config for ``k`` without timing: the nearest known shape class's (:func:`nearest`, within
    ``max_distance``), else ``fallback(options)``, else the first option. ``options``: the candidate list,
    or a function making it (called only when ``k`` was not chosen before). Remembered for this process apart
    from the measured entries: not on disk, never a neighbour, and not in the way of a later timing.
    ``variant`` keeps apart, in that memory, problems of one key that ``fallback`` prices differently (rows
    16-byte aligned or not: a key buckets M, which is A's row stride in the TN and TT layouts)."""
    config = _guessed.get((k, variant))
    if config is not None:
        return dict(config)
    if callable(options):
        options = options()
    config = nearest(k, options, max_distance)
    if config is None:
        config = fallback(options) if fallback is not None else options[0]
    _remember(k, variant, config)
    return dict(config)


def _remember(k: str, variant, config: dict) -> None:
    with _lock:
        if len(_guessed) >= GUESSED_MAX:
            _guessed.clear()
        _guessed[(k, variant)] = dict(config)


def remember_untimed(k: str, config: dict, variant=None) -> None:
    """Make ``config`` this process's untimed choice for ``k`` (:func:`choose_untimed`), as when the one chosen
    there could not run here (a kernel that does not fit the SM)."""
    _remember(k, variant, config)


def lookup_or_tune(k: str, candidates, launch, fallback=None, max_distance: float = float("inf")) -> dict:
    """The config known for key ``k``. Else, by default, the nearest known shape class's untimed, within
    ``max_distance`` (:func:`choose_untimed`). Where timing is enabled (:func:`timing_enabled`), the fastest of
    ``candidates()``, timed through ``launch(config)`` and recorded, so that it is timed once per shape class.

    Each candidate is timed by ``triton.testing.do_bench`` (median, L2 cleared before each call); one that
    fails to compile or launch is simply not chosen. A short first pass finds the field; the candidates
    within 10% of its best (at most three) are then timed again, longer and in two alternating rounds, so
    that run-to-run noise of the short pass does not decide between near ties. The timed launches are
    replays of the candidate's own (:func:`replaying`), as a repeated call of the op would make them.
    """
    config = lookup(k)
    if config is not None:
        return config
    options = list(candidates())
    if not timing_enabled():
        return choose_untimed(k, options, fallback, max_distance)
    from tilegemm.core.launch import spoil

    spoil()  # timing launches candidates that a replay of the call being recorded must not repeat
    if len(options) == 1:
        config = options[0]
    else:
        import triton.testing

        def median_ms(cfg: dict, rep: int) -> float:
            try:
                return triton.testing.do_bench(replaying(launch, cfg), warmup=5, rep=rep, return_mode="median")
            except Exception:  # noqa: BLE001 - a config that does not compile or fit is not chosen
                return float("inf")

        timings = [median_ms(cfg, 20) for cfg in options]
        order = sorted(range(len(options)), key=timings.__getitem__)
        finalists = [i for i in order[:3] if timings[i] <= 1.1 * timings[order[0]]]
        if len(finalists) > 1:
            totals = dict.fromkeys(finalists, 0.0)
            for _ in range(2):
                for i in finalists:
                    totals[i] += median_ms(options[i], 100)
            order = sorted(finalists, key=totals.__getitem__)
        config = options[order[0]]
    record(k, config)
    return config


def replaying(launch, cfg: dict):
    """A function for ``do_bench`` that launches what ``launch(cfg)`` launches. Its first call is
    ``launch(cfg)`` itself (it compiles, and a rung may tune its own config there); its second is recorded
    (:class:`tilegemm.core.launch.recording`); later calls replay those launches, which costs the host a few
    microseconds where Triton's launch path costs 15 or more (a Gluon kernel's, with its constexprs, 30 to
    60): on a kernel of 10-30 us, between L2 clears, that path made timings host-bound, and the tuner then
    preferred a kernel that launches quickly to a faster one. Launches that cannot be replayed (under the
    interpreter) are launched through ``launch(cfg)`` every time."""
    from tilegemm.core.launch import Replay, call_tensors, recording

    state = {"calls": 0, "replays": None}

    def run():
        state["calls"] += 1
        replays = state["replays"]
        if replays:
            for replay, tensors in replays:
                if not replay(*tensors):  # another stream or device than recorded: launch afresh from now on
                    state["replays"] = []
                    launch(cfg)
                    return
            return
        if state["calls"] != 2:
            launch(cfg)
            return
        with recording() as rec:
            launch(cfg)
        try:
            found = []
            for recorded in rec.launches or ():
                tensors = call_tensors(recorded.params)
                found.append((Replay(recorded, tensors), tensors))
        except LookupError:
            found = []
        state["replays"] = found

    return run


_unsaved_warned = False  # the warning that the cache file cannot be written: once a process


def record(k: str, config: dict) -> None:
    """Remember a tuned config, and save the cache file (atomically) unless the disk is off."""
    global _generation, _unsaved_warned
    _load()
    with _lock:
        _memory[k] = dict(config)
        _tuned[k] = dict(config)
        _generation += 1  # after the entry is in: an answer cached under the new count has seen it
    if _disk_enabled() and str(cache_file()) not in _keep_as_is:
        try:
            save(cache_file())
        except OSError as err:  # (an unwritable cache folder: the call that tuned still returns its result)
            if not _unsaved_warned:
                warnings.warn(f"tilegemm: cannot write the tuning cache {cache_file()} ({err.strerror or err}): "
                              f"tuned configs are kept in memory only; set TILEGEMM_CACHE_DIR to a writable "
                              f"folder", stacklevel=3)
            _unsaved_warned = True


def save(path: Path) -> None:
    """Write the tuned entries (not the shipped ones) to ``path``: a temporary file in the same folder,
    renamed over it. Under an advisory lock on the folder (POSIX), the entries another process saved there since
    this one read it are read first and kept (this process's win on a key both tuned), so that processes tuning
    side by side (a server, ``tilegemm tune``) do not erase each other's. The files are read and written outside
    the tables' lock, so lookups in other threads do not wait on the disk."""
    global _generation
    slug, triton_version = _device_tag()
    path.parent.mkdir(parents=True, exist_ok=True)
    with _folder_lock(path.parent):
        theirs, tuned_only = _read(path, quiet=True) if path.exists() else ({}, True)
        if str(path) in _keep_as_is:  # (it became unreadable, or a newer tilegemm wrote it, since: _read warned)
            return
        with _lock:
            added = {k: v for k, v in theirs.items()
                     if k not in _tuned and (tuned_only or k not in _shipped)}  # (an older file's shipped copies)
            _tuned.update(added)
            _memory.update(added)  # (a measurement of a shipped class overrides it, as at a load)
            if added:
                _generation += 1
            entries = dict(sorted(_tuned.items()))
        data = {"schema": SCHEMA, "gpu": slug, "triton": triton_version, "tuned_only": True, "entries": entries}
        atomic_write(path, lambda f: json.dump(data, f, indent=1))


_held_folder_locks: set[int] = set()  # descriptors of folders this process holds flock on (closed in a fork child)


def _close_held_in_child() -> None:
    """A forked child inherits the descriptor, and flock belongs to it: closing the child's copy leaves the
    parent's lock, which the parent's own close releases; kept, the child would hold it after the parent let go."""
    for fd in list(_held_folder_locks):
        try:
            os.close(fd)
        except OSError:
            pass
    _held_folder_locks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_held_in_child)


class _folder_lock:
    """An exclusive ``fcntl.flock`` on a folder while the block runs (none where fcntl is missing, or the folder
    cannot be opened or locked so: the last writer wins)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def __enter__(self):
        self.fd = None
        try:
            import fcntl

            self.fd = os.open(self.folder, os.O_RDONLY)
            _held_folder_locks.add(self.fd)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except (ImportError, OSError):
            self._release()
        return self

    def _release(self):
        if self.fd is not None:
            _held_folder_locks.discard(self.fd)
            os.close(self.fd)  # (closing releases the lock)
            self.fd = None

    def __exit__(self, *exc):
        self._release()


def entries() -> dict[str, dict]:
    _load()
    return dict(_memory)


def forget() -> None:
    """Drop what this process holds (the files stay); the next lookup reads them again."""
    global _loaded_for, _generation
    with _lock:
        _memory.clear()
        _tuned.clear()
        _guessed.clear()
        _keep_as_is.clear()
        _loaded_for = None
        _generation += 1
