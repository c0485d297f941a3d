"""Mixed-precision checks shared by the one-process and multi-process tests: a pipeline and
the plain model, both run under bf16 autocast (or with bf16 weights), compared.

Tolerances: bfloat16 keeps 8 significant bits, so one rounding is off by up to
2**-8 ~ 3.9e-3 relative. The pipeline runs the same ops on the same rows, but splits the
batch into microbatches, so a weight gradient is a sum of per-microbatch bf16 products
instead of one product over the batch: its rounding differs by a few units of 2**-8. We
allow a relative (Frobenius) error of 4 * 2**-8 per gradient, and 2**-7 on the loss: with
bf16 weights the loss is itself a bf16 number (spacing up to 2**-7 relative just above a
power of two) and the pipeline's is the mean of per-microbatch bf16 losses, one rounding
apart (seen: 6.21875 vs 6.25, one spacing at 6.25). With bf16 weights the gradients are
bf16 tensors too: each microbatch's gradient is rounded, scaled by 1/m and summed in bf16,
and the activation gradients they come from were rounded at every layer on the way back,
so we allow 8 * 2**-8 there (seen: 1.8e-2 on a LayerNorm weight on 2 ranks). A real bug (a
missing microbatch, a gradient counted twice, autocast not applied on a stage) is off by 10%
or more.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

BF16_EPS = 2.0 ** -8
GRAD_TOL = {"autocast": 4 * BF16_EPS, "bf16": 8 * BF16_EPS}
LOSS_TOL = 2 * BF16_EPS


def models(mode: str, ranks: int, backend: str) -> tuple[Any, ...]:
    """``(reference, pipe, args, target, loss_fn)``: GPT-2 (tests.zoo) and its pipeline on a
    2-microbatch 1F1B plan over ``ranks`` ranks; bf16 weights when ``mode == "bf16"``."""
    import autopart
    from autopart.core.capture import capture
    from tests.plans import even_positions, manual_plan
    from tests.zoo import gpt2

    model, args, target, loss_fn = gpt2()
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    reference = copy.deepcopy(model)
    captured = capture(model, tuple(a[:4] for a in args))
    plan = manual_plan(captured, even_positions(captured, ranks), 2, 8, schedule_kind="1f1b")
    kwargs: dict[str, Any] = ({"backend": "distributed"} if backend == "distributed"
                              else {"devices": ["cpu"] * ranks})
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan, **kwargs)
    return reference, pipe, args, target, loss_fn


def compare(pipe: Any, reference: torch.nn.Module, args: Any, target: Any, loss_fn: Any,
            mode: str) -> str:
    """Train one step of both; returns ``"ok <loss> <worst grad error>"`` or the problems."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast")
    with autocast:
        loss = pipe.train_step(*args, target=target)
        out = reference(*args)
        ref_loss = loss_fn(out, target)
    if out.logits.dtype != torch.bfloat16:
        return f"the reference ran in {out.logits.dtype}, not bf16"
    ref_loss.backward()
    problems = []
    ref_value = float(ref_loss.detach())
    if abs(float(loss) - ref_value) > LOSS_TOL * abs(ref_value):
        problems.append(f"loss {float(loss)} vs {ref_value}")
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, p in pipe.named_parameters():
        if p.dtype != ref[name].dtype or p.grad is None or p.grad.dtype != p.dtype:
            problems.append(f"{name}: dtype {p.dtype} / grad {None if p.grad is None else p.grad.dtype}")
            continue
        g, r = p.grad.float(), ref[name].grad.float()
        err = float((g - r).norm() / r.norm().clamp_min(1e-30))
        worst = max(worst, err)
        if err > GRAD_TOL[mode]:
            problems.append(f"{name}: relative gradient error {err:.2e} > {GRAD_TOL[mode]:.2e}")
    return "\n".join(problems) if problems else f"ok {float(loss):.6f} {worst:.3e}"
