import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import autopart
import autopart.runtime.checkpoint as ckpt
from autopart.core.errors import PlanError
from tests.zoo import gpt2, mlp

TOL = {"rtol": 1e-5, "atol": 4e-5}


def _trained(build: Any, tmp_path: Path) -> tuple[Any, ...]:
    model, args, target, loss_fn = build()
    pipe = autopart.compile(model, args, loss_fn=loss_fn, num_stages=2, num_microbatches=2,
                            schedule="gpipe", time_limit_s=5.0)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    pipe.train_step(*args, target=target)
    opt.step()
    return pipe, args, target, loss_fn


def test_save_then_load_into_a_pipeline_and_into_the_plain_model(tmp_path: Path) -> None:
    pipe, args, target, loss_fn = _trained(gpt2, tmp_path)
    folder = pipe.save(tmp_path / "ck")
    assert sorted(p.name for p in folder.iterdir()) == [
        "manifest.json", "plan.json", "stage_0.safetensors", "stage_1.safetensors"]
    fresh, *_ = gpt2()
    fresh_pipe = autopart.load(tmp_path / "ck", copy.deepcopy(fresh), args, loss_fn=loss_fn)
    assert fresh_pipe.plan == pipe.plan
    assert list(fresh_pipe.state_dict()) == list(pipe.state_dict())
    for key, value in pipe.state_dict().items():
        torch.testing.assert_close(fresh_pipe.state_dict()[key], value, rtol=0, atol=0)
    plain = autopart.load(tmp_path / "ck", fresh)
    assert plain is fresh
    torch.testing.assert_close(plain(*args).logits, pipe(*args).logits, **TOL)


def test_a_crash_mid_write_leaves_the_previous_checkpoint(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pipe, args, target, loss_fn = _trained(mlp, tmp_path)
    pipe.save(tmp_path / "ck")
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    with torch.no_grad():
        for p in pipe.parameters():
            p.add_(1.0)
    real_save = ckpt.save_file
    calls = []

    def dies_on_second_stage(tensors: Any, path: str) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise OSError("killed mid-write")
        real_save(tensors, path)

    monkeypatch.setattr(ckpt, "save_file", dies_on_second_stage)
    with pytest.raises(OSError, match="killed mid-write"):
        pipe.save(tmp_path / "ck")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".lock", "ckpt-000000", "latest"]
    model, *_ = mlp()
    restored = autopart.load(tmp_path / "ck", model)
    for key, value in restored.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_a_checkpoint_from_another_model_names_what_differs(tmp_path: Path) -> None:
    pipe, *_ = _trained(mlp, tmp_path)
    pipe.save(tmp_path / "ck")
    other = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 4))
    with pytest.raises(PlanError, match=r"another model .*missing from checkpoint: \['1.bias', '1.weight'\].*"
                                        r"shape differs: .*0.weight \[32, 32\] vs model \[16, 32\]"):
        autopart.load(tmp_path / "ck", other)
    with pytest.raises(PlanError, match="not an autopart checkpoint"):
        autopart.load(tmp_path, other)
