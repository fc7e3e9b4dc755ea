"""Run-directory I/O. Every file is written atomically (temp file in the same folder + rename),
so a crash never leaves a half-written result."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


class RefusedRerun(ValueError):
    """A rerun refused before any compute (its config differs from the run folder's): the
    folder's record (meta.json) stays as the finished run left it."""


def umask_mode(directory: bool = False) -> int:
    """The mode a plain open() or mkdir() would give under this process's umask (0644 / 0755 by
    default): temp files and folders are created 0600 / 0700, and a result renamed from one
    must still be readable by colleagues on a shared cluster."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


def make_temp_dir(prefix: str, parent: Path) -> Path:
    """A temp folder beside its destination (renamed into place when complete), umask's mode."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    tmp.chmod(umask_mode(directory=True))
    return tmp


def write_text_atomic(path: str | Path, text: str | bytes) -> Path:
    """Write `text` (str, or bytes written as they are) to `path` atomically, umask's mode."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, umask_mode())
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=float) + "\n")
