"""Checkpoints are verified on load (digests, sizes, dtypes, manifest shape) and killed saves
leave nothing behind after the next save."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

import autopart
from autopart import CheckpointError
from tests.zoo import mlp

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def saved(tmp_path: Path) -> tuple[Any, ...]:
    model, args, target, loss_fn = mlp()
    pipe = autopart.compile(model, args, loss_fn=loss_fn, num_stages=2, num_microbatches=2,
                            schedule="gpipe", time_limit_s=5.0)
    folder = pipe.save(tmp_path / "ck")
    return folder, tmp_path / "ck", mlp()[0], args, loss_fn


def _manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "manifest.json").read_text())


def test_a_flipped_byte_or_a_truncated_file_is_refused(saved: tuple[Any, ...]) -> None:
    folder, root, fresh, args, _ = saved
    stage = folder / "stage_1.safetensors"
    data = bytearray(stage.read_bytes())
    data[-3] ^= 0x40  # one bit in the last weight
    stage.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"stage_1.safetensors does not match its manifest"):
        autopart.load(root, fresh)
    stage.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CheckpointError, match=r"size \d+ vs \d+ bytes"):
        autopart.load(root, fresh)
    stage.unlink()
    with pytest.raises(CheckpointError, match=r"stage_1.safetensors is missing"):
        autopart.load(root, fresh)


def test_a_stage_re_saved_in_another_dtype_is_refused(saved: tuple[Any, ...]) -> None:
    folder, root, fresh, args, _ = saved
    stage = folder / "stage_0.safetensors"
    half = {k: v.half() for k, v in load_file(str(stage)).items()}
    save_file(half, str(stage))
    manifest = _manifest(folder)
    import hashlib
    manifest["files"]["stage_0.safetensors"] = {
        "sha256": hashlib.sha256(stage.read_bytes()).hexdigest(), "bytes": stage.stat().st_size}
    (folder / "manifest.json").write_text(json.dumps(manifest))  # digests made to agree
    with pytest.raises(CheckpointError, match=r"is float16, its manifest says float32"):
        autopart.load(root, fresh)
    manifest["dtypes"] = {k: "float16" if k in half else d for k, d in manifest["dtypes"].items()}
    (folder / "manifest.json").write_text(json.dumps(manifest))  # ... and the dtypes too
    with pytest.raises(CheckpointError, match=r"is float16, the model's is float32; convert"):
        autopart.load(root, fresh)


@pytest.mark.parametrize(("damage", "match"), [
    (lambda m: "{not json", r"manifest.json cannot be read \(JSONDecodeError"),
    (lambda m: json.dumps([1, 2]), r"checkpoint format \[1, 2\] is not supported"),
    (lambda m: json.dumps({**m, "format": 99}), r"checkpoint format 99 is not supported"),
    (lambda m: json.dumps({k: v for k, v in m.items() if k != "stage_of"}),
     r"manifest.json is damaged \(KeyError: 'stage_of'\)"),
    (lambda m: json.dumps({**m, "state_keys": 5}), r"manifest.json is damaged \(TypeError"),
    (lambda m: json.dumps({**m, "files": {}}), r"manifest.json is damaged \(its tensor, stage"),
    (lambda m: json.dumps({**m, "shapes": {"x": "ab"}}), r"manifest.json is damaged"),
])
def test_a_damaged_manifest_is_refused_naming_it(saved: tuple[Any, ...], damage: Any,
                                                 match: str) -> None:
    folder, root, fresh, *_ = saved
    (folder / "manifest.json").write_text(damage(_manifest(folder)))
    with pytest.raises(CheckpointError, match=match):
        autopart.load(root, fresh)


_SAVER = """
import sys
sys.path.insert(0, {root!r})
import autopart
from tests.zoo import mlp
model, args, target, loss_fn = mlp()
pipe = autopart.compile(model, args, loss_fn=loss_fn, num_stages=2, num_microbatches=2,
                        schedule="gpipe", time_limit_s=5.0)
print("ready", flush=True)
while True:
    pipe.save({out!r})
"""


def test_killed_saves_leave_nothing_after_the_next_save(saved: tuple[Any, ...]) -> None:
    folder, root, fresh, args, loss_fn = saved
    script = _SAVER.format(root=str(ROOT), out=str(root))
    for k in range(8):
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.05 + 0.04 * k)  # somewhere inside a save
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        autopart.load(root, fresh)  # the last complete checkpoint always loads
    model, *_ = mlp()
    pipe = autopart.compile(model, args, loss_fn=loss_fn, num_stages=2, num_microbatches=2,
                            schedule="gpipe", time_limit_s=5.0)
    final = pipe.save(root)
    left = sorted(p.name for p in root.iterdir())
    assert left == [".lock", final.name, "latest"], left
    autopart.load(root, fresh)
