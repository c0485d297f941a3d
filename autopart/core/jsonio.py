"""Atomic JSON file writing and dataclass <-> JSON helpers shared by the contracts."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__: list[str] = []


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the new one, never half.

    The text goes to a temporary file in the same directory, is flushed and fsynced,
    then renamed over ``path`` (``os.replace`` is atomic on POSIX and Windows).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def dumps(obj: Any) -> str:
    """Stable, human-readable JSON: sorted keys, two-space indent, trailing newline."""
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"
