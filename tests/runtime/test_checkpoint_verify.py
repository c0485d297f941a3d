"""Checkpoints are verified on load (digests, sizes, manifest shape, DCP metadata read without
unpickling arbitrary objects), and killed saves leave the last checkpoint loadable and
nothing behind after the next save."""

from __future__ import annotations

import hashlib
import json
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import autopart
from autopart import CheckpointError
from tests.zoo import mlp

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def saved(tmp_path: Path) -> tuple[Any, ...]:
    model, args, target, loss_fn = mlp()
    pipe = autopart.compile(model, args, loss_fn=loss_fn, num_stages=2, num_microbatches=2,
                            schedule="gpipe", time_limit_s=5.0)
    opt = torch.optim.AdamW(pipe.parameters())
    pipe.train_step(*args, target=target)
    opt.step()
    folder = pipe.save(tmp_path / "ck", optimizer=opt)
    pipe.plan.save(tmp_path / "plan.json")
    return folder, tmp_path / "ck", mlp()[0], args, loss_fn


def _manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "autopart.json").read_text())


def test_a_flipped_byte_or_a_truncated_file_is_refused(saved: tuple[Any, ...]) -> None:
    folder, root, fresh, args, _ = saved
    data_file = folder / "__0_0.distcp"
    data = bytearray(data_file.read_bytes())
    data[-3] ^= 0x40  # one bit in the last weight
    data_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__0_0.distcp does not match its manifest"):
        autopart.load(root, fresh)
    data_file.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CheckpointError, match=r"size \d+ vs \d+ bytes"):
        autopart.load(root, fresh)
    data_file.unlink()
    with pytest.raises(CheckpointError, match=r"__0_0.distcp is missing"):
        autopart.load(root, fresh)


class _Boom:
    def __reduce__(self) -> Any:
        return (print, ("unpickled",))


def test_dcp_metadata_is_never_unpickled_beyond_dcp_types(saved: tuple[Any, ...]) -> None:
    folder, root, fresh, *_ = saved
    evil = pickle.dumps(_Boom())
    (folder / ".metadata").write_bytes(evil)
    manifest = _manifest(folder)
    manifest["files"][".metadata"] = {"sha256": hashlib.sha256(evil).hexdigest(),
                                      "bytes": len(evil)}  # digests made to agree
    (folder / "autopart.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"builtins.print is not allowed in DCP metadata"):
        autopart.load(root, fresh)


def test_a_format_2_checkpoint_loads_its_weights(tmp_path: Path) -> None:
    model, args, _, loss_fn = mlp()
    folder = tmp_path / "old" / "ckpt-000000"
    folder.mkdir(parents=True)
    state = model.state_dict()
    half = len(state) // 2
    save_file(dict(list(state.items())[:half]), str(folder / "stage_0.safetensors"))
    save_file(dict(list(state.items())[half:]), str(folder / "stage_1.safetensors"))
    (folder / "manifest.json").write_text(json.dumps({"format": 2}))
    (tmp_path / "old" / "latest").write_text("ckpt-000000\n")
    fresh = autopart.load(tmp_path / "old", mlp()[0])
    for key, value in state.items():
        torch.testing.assert_close(fresh.state_dict()[key], value, rtol=0, atol=0)


@pytest.mark.parametrize(("damage", "match"), [
    (lambda m: "{not json", r"autopart.json cannot be read \(JSONDecodeError"),
    (lambda m: json.dumps([1, 2]), r"checkpoint format \[1, 2\] is not supported"),
    (lambda m: json.dumps({**m, "format": 99}), r"checkpoint format 99 is not supported"),
    (lambda m: json.dumps({k: v for k, v in m.items() if k != "optimizer"}),
     r"autopart.json is damaged \(KeyError: 'optimizer'\)"),
    (lambda m: json.dumps({**m, "files": 5}), r"autopart.json is damaged \(AttributeError"),
    (lambda m: json.dumps({**m, "files": {}}), r"autopart.json is damaged \(no .metadata"),
    (lambda m: json.dumps({**m, "extra": [1]}), r"autopart.json is damaged"),
])
def test_a_damaged_manifest_is_refused_naming_it(saved: tuple[Any, ...], damage: Any,
                                                 match: str) -> None:
    folder, root, fresh, *_ = saved
    (folder / "autopart.json").write_text(damage(_manifest(folder)))
    with pytest.raises(CheckpointError, match=match):
        autopart.load(root, fresh)


_SAVER = """
import sys
sys.path.insert(0, {root!r})
import torch
import autopart
from tests.zoo import mlp
model, args, target, loss_fn = mlp()
pipe = autopart.compile(model, args, loss_fn=loss_fn, plan={plan!r})
opt = torch.optim.AdamW(pipe.parameters())
pipe.train_step(*args, target=target)
opt.step()
print("ready", flush=True)
step = 0
while True:
    step += 1
    pipe.save({out!r}, optimizer=opt, extra={{"step": step}})
    print("saved", step, flush=True)
"""


def test_killed_saves_leave_nothing_after_the_next_save(saved: tuple[Any, ...]) -> None:
    folder, root, fresh, args, loss_fn = saved
    # each writer replays the fixture's plan (no profiling: the writers start in seconds)
    plan = root.parent / "plan.json"
    script = _SAVER.format(root=str(ROOT), out=str(root), plan=str(plan))
    steps: list[int] = []
    for k in range(5):
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        if k == 4:  # however slow the disk, at least one killed writer committed a save
            assert proc.stdout.readline().startswith("saved")
        time.sleep(0.05 + 0.07 * k)  # somewhere inside a save
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # the last complete checkpoint always loads, model and optimizer
        opt = torch.optim.AdamW(fresh.parameters())
        autopart.load(root, fresh, optimizer=opt)
        steps.append(autopart.checkpoint_extra(root).get("step", 0))
    model, *_ = mlp()
    pipe = autopart.compile(model, args, loss_fn=loss_fn, num_stages=2, num_microbatches=2,
                            schedule="gpipe", time_limit_s=5.0)
    final = pipe.save(root)
    left = sorted(p.name for p in root.iterdir())
    assert left == [".lock", final.name, "latest"], left
    assert max(steps) > 0, steps  # the killed writers did commit checkpoints
    autopart.load(root, fresh)
