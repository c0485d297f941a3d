"""Property: any mutation of a valid plan file is refused with PlanError, or runs with the
unpartitioned model's numbers (loss and every gradient) — nothing else escapes.

``AUTOPART_PLAN_EXAMPLES`` sets the number of examples (default 500); the counts (refused
on load, refused by compile, ran correct) are printed at the end (``pytest -s``).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopart
import autopart.api
from autopart.core.capture import CapturedGraph, capture
from autopart.core.errors import PlanError
from autopart.core.plan import Plan
from tests.plans import even_positions, manual_plan
from tests.zoo import mlp

EXAMPLES = int(os.environ.get("AUTOPART_PLAN_EXAMPLES", "500"))
#: (schedule kind, stages, stages_per_rank, num_microbatches, recompute) of the valid plans mutated.
BASES = (("gpipe", 2, 1, 2, False), ("1f1b", 3, 1, 4, False), ("interleaved_1f1b", 4, 2, 4, False),
         ("zero_bubble", 2, 1, 2, True))
COUNTS: Counter[str] = Counter()
_CAPTURES: dict[tuple[int, ...], CapturedGraph] = {}


def _cached_capture(model: Any, args: Any, kwargs: Any = None) -> CapturedGraph:
    """``capture`` memoised by input shape: every compile here is of the same MLP."""
    key = tuple(args[0].shape)
    if key not in _CAPTURES:
        _CAPTURES[key] = capture(model, args, kwargs)
    return _CAPTURES[key]


@pytest.fixture(scope="module")
def world() -> dict[str, Any]:
    """The model, its inputs, the plain model's loss and gradients, and the valid plan texts."""
    model, args, target, loss_fn = mlp()
    ref = mlp()[0]
    ref_loss = loss_fn(ref(*args), target)
    ref_loss.backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    texts = []
    for kind, stages, v, m, recompute in BASES:
        captured = _cached_capture(model, (args[0][: args[0].shape[0] // m],))
        plan = manual_plan(captured, even_positions(captured, stages), m, args[0].shape[0],
                           schedule_kind=kind, stages_per_rank=v, recompute=recompute)
        texts.append(json.dumps(plan.to_dict(), indent=2, sort_keys=True))
    return {"model": model, "args": args, "target": target, "loss_fn": loss_fn,
            "ref_loss": ref_loss.detach(), "grads": grads, "texts": texts}


# ---- mutations -------------------------------------------------------------------------
_SCALARS = st.one_of(
    st.sampled_from([0, 1, -1, 2, 3, 4, 8, 16, 2.7, 0.5, -0.0, 1e308, 10**30, 2**63, True, False,
                     None, "", "0", "2", "cpu", "interleaved_1f1b", "gpipe", "zero_bubble",
                     "1f1b", "memory", [], {}, [0], [0, 1], {"a": 1}]),
    st.integers(-5, 20), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6))


def _same_kind(value: Any) -> st.SearchStrategy[Any]:
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.integers(0, 9)
    if isinstance(value, float):
        return st.floats(0.0, 2.0)
    if isinstance(value, str):
        return st.sampled_from(["", "cpu", "cuda:0", "linear", "linear_3", "gelu_2", "gpipe",
                                "1f1b", "interleaved_1f1b", "zero_bubble", "memory", value + "x"])
    if isinstance(value, list):
        return st.lists(st.integers(0, 4), max_size=4)
    return st.just(value)


def _containers(value: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) pair under ``value``, depth first."""
    out: list[tuple[Any, Any]] = []
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else ()
    for k, v in items:
        out.append((value, k))
        out += _containers(v)
    return out


def _mutate_data(data: dict[str, Any], draw: Any) -> None:
    """One structural mutation of the parsed plan, in place."""
    spots = _containers(data)
    parent, key = spots[draw(st.integers(0, len(spots) - 1))]
    op = draw(st.sampled_from(["replace", "same_kind", "same_kind", "nudge", "drop", "add",
                               "duplicate", "swap", "nest"]))
    value = parent[key]
    if op == "same_kind":  # a value of the right type that may still be wrong
        parent[key] = draw(_same_kind(value))
    elif op == "replace":
        parent[key] = draw(_SCALARS)
    elif op == "nudge" and isinstance(value, int | float) and not isinstance(value, bool):
        parent[key] = value + draw(st.sampled_from([-2, -1, 1, 2, 0.5, -0.5]))
    elif op == "drop":
        del parent[key]
    elif op == "add" and isinstance(parent, dict):
        parent[draw(st.sampled_from(["extra", "rank", "ranks", "stage", "cut"]))] = draw(_SCALARS)
    elif op in ("add", "duplicate") and isinstance(parent, list):
        parent.insert(key, parent[key])
    elif op == "swap" and isinstance(parent, list) and len(parent) > 1:
        other = draw(st.integers(0, len(parent) - 1))
        parent[key], parent[other] = parent[other], parent[key]
    elif op == "swap" and isinstance(parent, dict) and len(parent) > 1:
        other = draw(st.sampled_from(sorted(parent)))
        parent[key], parent[other] = parent[other], parent[key]
    else:  # "nest", and the ops that do not apply to this spot
        depth = draw(st.integers(1, 50))
        for _ in range(depth):
            value = [value]
        parent[key] = value


def _mutate_text(text: str, draw: Any) -> bytes:
    """One textual mutation of the file: truncate, flip a byte, deep nesting, duplicate a key."""
    raw = text.encode()
    op = draw(st.sampled_from(["truncate", "flip", "deep", "dup_key", "junk"]))
    if op == "truncate":
        return raw[: draw(st.integers(0, len(raw) - 1))]
    if op == "flip":
        i = draw(st.integers(0, len(raw) - 1))
        return raw[:i] + bytes([raw[i] ^ (1 << draw(st.integers(0, 7)))]) + raw[i + 1:]
    if op == "deep":
        n = draw(st.sampled_from([100, 5000, 200_000]))
        return raw.rstrip()[:-1] + b', "deep": ' + b"[" * n + b"]" * n + b"}"
    if op == "dup_key":
        return raw.replace(b'"batch_size": 8', b'"batch_size": 8, "batch_size": 4', 1)
    return bytes(draw(st.lists(st.integers(0, 255), max_size=64)))


# ---- the property ----------------------------------------------------------------------
def _run(world: dict[str, Any], plan: Plan) -> None:
    try:
        pipe = autopart.compile(world["model"], world["args"], loss_fn=world["loss_fn"], plan=plan)
    except PlanError:
        COUNTS["refused by compile"] += 1
        return
    for p in pipe.parameters():
        p.grad = None
    loss = pipe.train_step(*world["args"], target=world["target"])
    torch.testing.assert_close(loss.detach(), world["ref_loss"], rtol=1e-5, atol=4e-5)
    got = {n: p.grad for n, p in pipe.named_parameters()}
    assert set(got) == set(world["grads"])
    for name, grad in world["grads"].items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=4e-5, msg=name)
    COUNTS["ran correct"] += 1


def test_mutated_plans_are_refused_or_run_correctly(world: dict[str, Any], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("autopart.steps.capture_step.capture", _cached_capture)
    path = tmp_path / "plan.json"

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data: st.DataObject) -> None:
        text = world["texts"][data.draw(st.integers(0, len(world["texts"]) - 1))]
        if data.draw(st.integers(0, 3)):  # 3 in 4: a structural mutation
            parsed = json.loads(text)
            for _ in range(data.draw(st.integers(1, 2))):
                _mutate_data(parsed, data.draw)
            raw = json.dumps(parsed, indent=2).encode()
        else:
            raw = _mutate_text(text, data.draw)
        path.write_bytes(raw)
        try:
            plan = Plan.load(path)
        except PlanError:
            COUNTS["refused on load"] += 1
            return
        _run(world, plan)

    COUNTS.clear()
    check()
    print(f"\nplan mutations ({EXAMPLES} examples): {dict(sorted(COUNTS.items()))}")
    assert sum(COUNTS.values()) >= 0.9 * EXAMPLES
    assert COUNTS["ran correct"] > 0 and COUNTS["refused on load"] > 0
