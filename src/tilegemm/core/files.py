"""Writing files so that a reader never sees half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, TextIO


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write: Callable[[TextIO], object]) -> None:
    """Call ``write(f)`` on a temporary file beside ``path``, then rename it over ``path``. The file gets the
    mode a plain ``open(path, "w")`` would give it (0666 less the umask), not mkstemp's private 0600.

    A symbolic link is written through (its target replaced, the link kept), and a path that is no regular file
    (``/dev/stdout``, a FIFO, a device) is written in place as ``open`` writes it: renamed over, it was replaced by
    a plain file."""
    path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file():
        with open(path, "w", newline="") as f:
            write(f)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
