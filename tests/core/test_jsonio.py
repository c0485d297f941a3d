"""Tests of write_text_atomic: umask modes, kept modes, symlinks written through, clear errors,
no leftovers and an intact previous file on every failure."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from autopart.core import jsonio
from autopart.core.errors import PlanError
from autopart.core.jsonio import write_text_atomic


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def leftovers(*folders: Path) -> list[Path]:
    return [p for folder in folders for p in folder.glob(".*.tmp")]


@pytest.fixture
def umask() -> Iterator[None]:
    """Restore the process umask after a test that sets it."""
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


@pytest.mark.parametrize(("mask", "expected"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_new_file_follows_umask(tmp_path: Path, umask: None, mask: int, expected: int) -> None:
    os.umask(mask)
    path = tmp_path / "plan.json"
    write_text_atomic(path, "{}\n")
    assert path.read_text() == "{}\n"
    assert mode_of(path) == expected
    assert not leftovers(tmp_path)


def test_umask_read_without_proc_fallback(tmp_path: Path, umask: None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    os.umask(0o027)
    real_open = open

    def no_proc(file: object, *args: object, **kwargs: object) -> object:
        if file == "/proc/self/status":
            raise FileNotFoundError(errno.ENOENT, "no /proc")
        return real_open(file, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr("builtins.open", no_proc)
    assert jsonio._umask() == 0o027
    assert os.umask(0o027) == 0o027  # unchanged by the read


@pytest.mark.parametrize("existing", [0o644, 0o640, 0o444])
def test_overwrite_keeps_existing_mode(tmp_path: Path, umask: None, existing: int) -> None:
    os.umask(0o077)
    path = tmp_path / "plan.json"
    path.write_text("old")
    path.chmod(existing)
    write_text_atomic(path, "new")
    assert path.read_text() == "new"
    assert mode_of(path) == existing


def test_symlink_is_written_through(tmp_path: Path) -> None:
    real = tmp_path / "shared" / "plan.json"
    real.parent.mkdir()
    real.write_text("old")
    real.chmod(0o644)
    link = tmp_path / "plan.json"
    link.symlink_to(real)
    write_text_atomic(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == "new" and mode_of(real) == 0o644
    assert not leftovers(tmp_path, real.parent)


def test_relative_symlink_and_chain(tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    real.write_text("old")
    (tmp_path / "mid.json").symlink_to("real.json")
    (tmp_path / "top.json").symlink_to("mid.json")
    write_text_atomic(tmp_path / "top.json", "new")
    assert (tmp_path / "top.json").is_symlink() and (tmp_path / "mid.json").is_symlink()
    assert real.read_text() == "new"


def test_dangling_symlink_creates_its_target(tmp_path: Path, umask: None) -> None:
    os.umask(0o022)
    link = tmp_path / "plan.json"
    link.symlink_to(tmp_path / "target.json")
    write_text_atomic(link, "new")
    assert link.is_symlink()
    assert (tmp_path / "target.json").read_text() == "new"
    assert mode_of(tmp_path / "target.json") == 0o644


def test_dangling_symlink_into_missing_directory(tmp_path: Path) -> None:
    link = tmp_path / "plan.json"
    link.symlink_to(tmp_path / "gone" / "target.json")
    with pytest.raises(PlanError, match=r"plan\.json.*resolved to .*gone.*no such directory"
                                         r".*create the directory"):
        write_text_atomic(link, "new")
    assert link.is_symlink() and not (tmp_path / "gone").exists()
    assert not leftovers(tmp_path)


def test_symlink_loop(tmp_path: Path) -> None:
    link = tmp_path / "plan.json"
    link.symlink_to(link)
    with pytest.raises(PlanError, match=r"plan\.json.*symlink points to itself.*fix the link"):
        write_text_atomic(link, "new")
    assert link.is_symlink() and not leftovers(tmp_path)


def test_missing_parent_directories_are_created(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "plan.json"
    write_text_atomic(path, "new")
    assert path.read_text() == "new"


def test_parent_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    for path in (tmp_path / "file" / "plan.json", tmp_path / "file" / "sub" / "plan.json"):
        with pytest.raises(PlanError, match=r"plan\.json.*is a file, not a directory.*choose"):
            write_text_atomic(path, "new")
    assert (tmp_path / "file").read_text() == "x" and not leftovers(tmp_path)


def test_target_is_a_directory(tmp_path: Path) -> None:
    folder = tmp_path / "plan.json"
    folder.mkdir()
    with pytest.raises(PlanError, match=r"plan\.json.*is a directory.*give a file path"):
        write_text_atomic(folder, "new")
    assert folder.is_dir() and not list(folder.iterdir()) and not leftovers(tmp_path)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root bypasses directory permissions")
def test_read_only_directory(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    (folder / "plan.json").write_text("old")
    folder.chmod(0o555)
    try:
        with pytest.raises(PlanError, match=r"plan\.json.*permission denied.*writable path"):
            write_text_atomic(folder / "plan.json", "new")
        assert (folder / "plan.json").read_text() == "old" and not leftovers(folder)
        with pytest.raises(PlanError, match=r"permission denied in directory .*/ro'"):
            write_text_atomic(folder / "sub" / "plan.json", "new")
    finally:
        folder.chmod(0o755)


def test_permission_denied_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same error as a read-only directory, forced so that it also runs as root."""

    def denied(*args: object, **kwargs: object) -> tuple[int, str]:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(PlanError, match=r"plan\.json.*permission denied in directory "
                                         r".*choose a writable path"):
        write_text_atomic(tmp_path / "plan.json", "new")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("step", "code", "message"), [
    ("fsync", errno.ENOSPC, "no space left"),
    ("replace", errno.EROFS, "read-only"),
    ("chmod", errno.EIO, "Input/output error; choose a writable path"),
])
def test_failed_write_keeps_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          step: str, code: int, message: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text("old")

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, step, fail)
    with pytest.raises(PlanError, match=rf"plan\.json.*{message}.*previous file.*unchanged"):
        write_text_atomic(path, "new")
    monkeypatch.undo()
    assert path.read_text() == "old" and not leftovers(tmp_path)


def test_interrupt_is_not_wrapped_and_leaves_nothing(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "plan.json"
    path.write_text("old")

    def interrupt(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        write_text_atomic(path, "new")
    monkeypatch.undo()
    assert path.read_text() == "old" and not leftovers(tmp_path)


def test_dumps_is_stable() -> None:
    assert jsonio.dumps({"b": 1, "a": [1, 2]}) == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
