"""Checkpoints (DCP): model and optimizer state under original FQNs, onto another cut, one
process or the plain model; plain weights (state_dict, save_pretrained) into a pipeline."""

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import autopart
import autopart.runtime.checkpoint.save_load as ckpt
from autopart.core.errors import CheckpointError
from tests import training
from tests.zoo import gpt2, mlp

TOL = {"rtol": 1e-5, "atol": 4e-5}


def _trained(build: Any, stages: int = 2) -> tuple[Any, ...]:
    model, args, target, loss_fn = build()
    pipe = autopart.compile(model, args, loss_fn=loss_fn, num_stages=stages, num_microbatches=2,
                            schedule="gpipe", time_limit_s=5.0)
    opt = training.adamw(pipe.named_parameters())
    pipe.train_step(*args, target=target)
    opt.step()
    opt.zero_grad()
    return pipe, opt, args, target, loss_fn


def test_save_then_load_into_another_cut_and_into_the_plain_model(tmp_path: Path) -> None:
    pipe, opt, args, target, loss_fn = _trained(gpt2)
    folder = pipe.save(tmp_path / "ck", optimizer=opt, extra={"step": 1, "data": [3, 4]})
    assert sorted(p.name for p in folder.iterdir()) == [
        ".metadata", "__0_0.distcp", "autopart.json", "plan.json"]
    assert autopart.checkpoint_extra(tmp_path / "ck") == {"step": 1, "data": [3, 4]}
    # with example inputs: compiled on the saved plan
    fresh_pipe = autopart.load(tmp_path / "ck", training.scrambled(gpt2()[0]), args,
                               loss_fn=loss_fn)
    assert fresh_pipe.plan == pipe.plan
    assert list(fresh_pipe.state_dict()) == list(pipe.state_dict())
    for key, value in pipe.state_dict().items():
        torch.testing.assert_close(fresh_pipe.state_dict()[key], value, rtol=0, atol=0)
    # a 3-stage pipeline, with its optimizer: the same state by FQN, the same next step
    model3, *_ = gpt2()
    pipe3 = autopart.compile(training.scrambled(model3), args, loss_fn=loss_fn, num_stages=3,
                             num_microbatches=2, schedule="gpipe", time_limit_s=5.0)
    opt3 = training.adamw(pipe3.named_parameters())
    autopart.load(tmp_path / "ck", pipe3, optimizer=opt3)
    ours = training.optimizer_state(pipe3.named_parameters(), opt3)
    theirs = training.optimizer_state(pipe.named_parameters(), opt)
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=0)
    for p in (pipe, pipe3):
        p.train_step(*args, target=target)
    opt.step()
    opt3.step()
    for (name, a), (_, b) in zip(pipe.named_parameters(), pipe3.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    # the plain model (tied lm_head.weight follows wte)
    plain = autopart.load(tmp_path / "ck", training.scrambled(gpt2()[0]))
    torch.testing.assert_close(plain(*args).logits, fresh_pipe(*args).logits, **TOL)
    assert plain.lm_head.weight is plain.transformer.wte.weight


def test_plain_weights_load_into_a_pipeline(tmp_path: Path) -> None:
    model, args, _, loss_fn = gpt2()
    reference = copy.deepcopy(model)
    reference.save_pretrained(tmp_path / "hf")  # safetensors, lm_head.weight left out (tied)
    pipe = autopart.compile(training.scrambled(model), args, loss_fn=loss_fn, num_stages=2,
                            num_microbatches=2, schedule="gpipe", time_limit_s=5.0)
    autopart.load(tmp_path / "hf", pipe)
    torch.testing.assert_close(pipe(*args).logits, reference(*args).logits, **TOL)
    training.scrambled(model)
    pipe.load_state_dict(reference.state_dict())  # a plain state_dict
    torch.testing.assert_close(pipe(*args).logits, reference(*args).logits, **TOL)
    with pytest.raises(CheckpointError, match="holds weights only"):
        autopart.load(tmp_path / "hf", pipe, optimizer=torch.optim.SGD(pipe.parameters()))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no .safetensors file"):
        autopart.load(tmp_path / "empty", pipe)


def test_a_bf16_model_loads_a_float32_checkpoint(tmp_path: Path) -> None:
    pipe, opt, args, *_ = _trained(mlp)
    pipe.save(tmp_path / "ck")
    plain = autopart.load(tmp_path / "ck", mlp()[0].to(torch.bfloat16))
    for key, value in pipe.state_dict().items():
        assert plain.state_dict()[key].dtype == torch.bfloat16
        torch.testing.assert_close(plain.state_dict()[key], value.to(torch.bfloat16))


def test_a_crash_mid_write_leaves_the_previous_checkpoint(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pipe, opt, *_ = _trained(mlp)
    pipe.save(tmp_path / "ck", optimizer=opt, extra={"step": 1})
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    with torch.no_grad():
        for p in pipe.parameters():
            p.add_(1.0)

    def dies(*args: Any, **kwargs: Any) -> None:
        (Path(kwargs["checkpoint_id"]) / "__0_0.distcp").write_bytes(b"half a file")
        raise OSError("killed mid-write")

    monkeypatch.setattr(ckpt.state_dict_saver, "save", dies)
    with pytest.raises(OSError, match="killed mid-write"):
        pipe.save(tmp_path / "ck", optimizer=opt, extra={"step": 2})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        ".ckpt-000001.tmp", ".lock", "ckpt-000000", "latest"]
    with pytest.raises(CheckpointError, match=r"partial checkpoint: its save did not finish"):
        autopart.load(tmp_path / "ck" / ".ckpt-000001.tmp", mlp()[0])
    restored = autopart.load(tmp_path / "ck", mlp()[0])
    assert autopart.checkpoint_extra(tmp_path / "ck") == {"step": 1}
    for key, value in restored.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_keep_keeps_the_last_checkpoints(tmp_path: Path) -> None:
    pipe, *_ = _trained(mlp)
    for _ in range(4):
        pipe.save(tmp_path / "ck", keep=2)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        ".lock", "ckpt-000002", "ckpt-000003", "latest"]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "ckpt-000003"
    with pytest.raises(CheckpointError, match="keep=0 must be >= 1"):
        pipe.save(tmp_path / "ck", keep=0)


def test_async_save_copies_the_state_before_returning(tmp_path: Path) -> None:
    pipe, opt, *_ = _trained(mlp)
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    pending = pipe.save(tmp_path / "ck", optimizer=opt, async_save=True)
    with torch.no_grad():
        for p in pipe.parameters():
            p.add_(1.0)  # the step goes on while the files are written
    folder = pending.wait()
    assert pending.wait() == folder and folder.name == "ckpt-000000"
    restored = autopart.load(tmp_path / "ck", mlp()[0])
    for key, value in restored.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_bad_arguments_and_other_models_are_refused(tmp_path: Path) -> None:
    pipe, opt, *_ = _trained(mlp)
    with pytest.raises(CheckpointError, match="is not JSON-serialisable"):
        pipe.save(tmp_path / "ck", extra={"when": object()})
    with pytest.raises(CheckpointError, match="tensor that is not a parameter of the pipeline"):
        pipe.save(tmp_path / "ck", optimizer=torch.optim.SGD([torch.nn.Parameter(torch.ones(2))]))
    pipe.save(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        autopart.load(tmp_path / "ck", pipe, optimizer=opt)
    other = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 4))
    with pytest.raises(CheckpointError, match=r"another model .*missing from checkpoint: "
                                              r"\['1.bias', '1.weight'\].*shape differs: "
                                              r".*0.weight \[32, 32\] vs model \[16, 32\]"):
        autopart.load(tmp_path / "ck", other)
    with pytest.raises(CheckpointError, match="nothing does not exist"):
        autopart.load(tmp_path / "nothing", other)
    manifest = tmp_path / "ck" / "ckpt-000000" / "autopart.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format": 2}))
    with pytest.raises(CheckpointError, match="checkpoint format 2 is not supported"):
        autopart.load(tmp_path / "ck", mlp()[0])
