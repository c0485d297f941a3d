"""Atomic JSON file writing and dataclass <-> JSON helpers shared by the contracts."""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any

from autopart.core.errors import PlanError

__all__ = ["dumps", "write_text_atomic", "fsync_dir"]

# os.umask can only be read by setting it; the lock keeps two writers from racing on it.
_UMASK_LOCK = threading.Lock()


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the new one, never half.

    The text goes to a temporary file in the same directory, is flushed and fsynced, then
    renamed over the file (``os.replace`` is atomic on POSIX and Windows) and the directory
    is fsynced. The file behaves as if written with ``open(path, "w")``:

    * a new file gets mode ``0o666 & ~umask``; an existing file keeps its mode;
    * a symlink is written through: its target is replaced and the link stays a link
      (a dangling link creates its target, if the target's directory exists);
    * missing parent directories of ``path`` itself are created.

    On any failure the previous file is untouched and no temporary file is left behind.

    Args:
        path: the file to write (a symlink to one is followed).
        text: the content, encoded as UTF-8.

    Raises:
        PlanError: the file cannot be written; the message names the path, the cause (no
            such directory, permission denied, is a directory, not a directory, read-only
            file system, no space left, symlink loop) and the fix.
    """
    given = Path(path)
    try:
        given.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        # Permission is denied by the existing directory above the one being created.
        denied = exc.errno in (errno.EACCES, errno.EPERM) and exc.filename
        raise _write_error(given, given, exc,
                           Path(exc.filename).parent if denied else given.parent) from exc
    target = Path(os.path.realpath(given))
    if target.is_symlink():  # realpath stops at a link it cannot resolve: a loop
        raise _write_error(given, target, OSError(errno.ELOOP, "symlink loop"))
    if target.is_dir():
        raise _write_error(given, target, IsADirectoryError(errno.EISDIR, "is a directory"))
    tmp: str | None = None
    try:
        mode = _mode_for(target)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
        tmp = None
    except OSError as exc:
        raise _write_error(given, target, exc) from exc
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
    fsync_dir(target.parent)


def _mode_for(target: Path) -> int:
    """The permission bits the written file gets: the existing file's, else the umask's."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process umask, read without changing it where ``/proc`` allows (Linux >= 4.7)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def fsync_dir(directory: Path) -> None:
    """Make the rename durable; best effort (some platforms cannot open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_error(given: Path, target: Path, exc: OSError,
                 folder: Path | None = None) -> PlanError:
    """A ``PlanError`` naming the path, what is wrong and the fix, for ``exc``; ``folder``
    is the directory at fault (default: the target's)."""
    resolved = str(target) != os.path.abspath(given)
    where = f"{str(given)!r}" + (f" (resolved to {str(target)!r})" if resolved else "")
    directory = str(folder if folder is not None else target.parent)
    code = exc.errno
    if code == errno.ENOENT:
        why = (f"no such directory {directory!r}; create the directory or choose a path in an "
               "existing one")
    elif code in (errno.EACCES, errno.EPERM):
        why = (f"permission denied in directory {directory!r}; choose a writable path or make "
               "the directory writable")
    elif code == errno.EISDIR:
        why = "it is a directory; give a file path inside it, e.g. " + repr(
            str(target / "plan.json"))
    elif code in (errno.ENOTDIR, errno.EEXIST):
        why = (f"a component of {directory!r} is a file, not a directory; choose a path whose "
               "parents are directories")
    elif code == errno.ELOOP:
        why = "the symlink points to itself (a loop); fix the link or choose another path"
    elif code == errno.EROFS:
        why = "the file system is read-only; choose a path on a writable file system"
    elif code in (errno.ENOSPC, errno.EDQUOT):
        why = "no space left on the device (or quota exceeded); free space or choose another path"
    else:
        why = f"{exc.strerror or exc}; choose a writable path"
    return PlanError(f"cannot write {where}: {why} (the previous file, if any, is unchanged)")


def dumps(obj: Any) -> str:
    """Stable, human-readable JSON: sorted keys, two-space indent, trailing newline."""
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"
