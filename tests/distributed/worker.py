"""Worker processes for the multi-process tests (spawned with torch.multiprocessing, gloo)."""

from __future__ import annotations

import copy
import datetime
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.rank_exit import end_rank


def _setup(rank: int, world: int, port: int, timeout_s: float) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def numerics(rank: int, world: int, port: int, model_name: str, kind: str, v: int,
             result_dir: str, recompute: bool = False, recompute_policy: str = "full") -> None:
    """Train one step on a plan for ``world`` ranks; write this rank's check results.

    With ``recompute`` every stage recomputes under the plan's ``recompute_policy``, and each
    must run its forward twice per microbatch in the training step (once more in backward)."""
    _setup(rank, world, port, 60)
    end_rank(_numerics(rank, world, result_dir, model_name, kind, v, recompute,
                       recompute_policy))


def _numerics(rank: int, world: int, result_dir: str, model_name: str, kind: str, v: int,
              recompute: bool = False, recompute_policy: str = "full") -> Any:
    """:func:`numerics`' checks in a process group already set up; returns the pipeline."""
    sys.path.insert(0, os.getcwd())
    import dataclasses

    import autopart
    from autopart.core.capture import capture
    from tests.plans import even_positions, manual_plan
    from tests.zoo import ZOO

    model, args, target, loss_fn = ZOO[model_name]()
    reference = copy.deepcopy(model)
    m = 4
    captured = capture(model, tuple(a[: 8 // m] for a in args))
    plan = manual_plan(captured, even_positions(captured, world * v), m, 8, schedule_kind=kind,
                       stages_per_rank=v, recompute=recompute)
    plan = dataclasses.replace(plan, recompute_policy=recompute_policy)
    if recompute and recompute_policy == "op":  # every second keepable node kept
        from autopart.core.capture import op_nodes
        from autopart.core.op_names import VIEW_OPS
        from autopart.core.recompute_policy import op_keepable

        nodes = op_nodes(captured.graph_module.graph)
        bounds = [0, *(c.position for c in plan.cuts), len(nodes)]
        plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, recompute_kept=tuple(
            nd.name for i, nd in enumerate(nodes[bounds[s]:bounds[s + 1]], bounds[s])
            if i % 2 == 0 and op_keepable(str(nd.target), VIEW_OPS)))
            for s, st in enumerate(plan.stages)))
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan, backend="distributed")
    # the one-process pipeline of the same plan emits byte-identical sources for this
    # rank's stages: both take them from codegen.build_stages
    local = autopart.compile(copy.deepcopy(reference), args, loss_fn=loss_fn, plan=plan,
                             backend="local", devices=["cpu"] * world)
    mine = pipe.stage_sources()
    problems = [f"stage {s}: its source differs from the one-process pipeline's"
                for s, text in mine.items() if local.stage_sources()[s] != text]
    if sorted(mine) != [s.stage_index for s in plan.stages if s.rank == rank]:
        problems.append(f"rank {rank} holds stages {sorted(mine)}")
    policies = {st.submod.recompute_policy for st in pipe.pipeline_stages}
    if policies != {recompute_policy}:
        problems.append(f"the stages run recompute policies {policies}, not {recompute_policy!r}")
    # a first step sets the runtime up (its shape inference runs stages' forwards too); the
    # weights do not change, so the second step's loss and gradients are the first's
    pipe.train_step(*args, target=target)
    for p in pipe.parameters():
        p.grad = None
    calls = [0] * len(pipe.stages)
    for k, mod in enumerate(pipe.stages):
        mod.register_forward_pre_hook(lambda *_, k=k: calls.__setitem__(k, calls[k] + 1))
    loss = pipe.train_step(*args, target=target)
    problems += [f"stage {k} ran its forward {n} times for {m} microbatches"
                 for k, n in enumerate(calls) if n != m * (2 if recompute else 1)]
    ref_loss = loss_fn(reference(*args), target)
    ref_loss.backward()
    ref_params = dict(reference.named_parameters())
    try:
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=4e-5)
    except AssertionError as exc:
        problems.append(f"loss: {exc}")
    names = []
    for name, p in pipe.named_parameters():
        names.append(name)
        try:
            torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=4e-5)
        except (AssertionError, TypeError) as exc:
            problems.append(f"{name}: {str(exc).splitlines()[0]}")
    out = pipe(*args)
    ref_out = reference(*args)
    ref_primary = ref_out.logits if hasattr(ref_out, "logits") else ref_out
    primary = out.logits if hasattr(out, "logits") else out
    try:
        torch.testing.assert_close(primary, ref_primary, rtol=1e-5, atol=4e-5)
    except AssertionError as exc:
        problems.append(f"output: {str(exc).splitlines()[0]}")
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join([f"params {len(names)}", *problems]) + "\n")
    return pipe


def _compare(pipe: Any, loss: torch.Tensor, ref_loss: torch.Tensor,
             reference: torch.nn.Module) -> list[str]:
    problems = []
    try:
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=4e-5)
    except AssertionError as exc:
        problems.append(f"loss: {str(exc).splitlines()[0]}")
    ref_params = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        try:
            torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=4e-5)
        except (AssertionError, TypeError) as exc:
            problems.append(f"{name}: {str(exc).splitlines()[0]}")
    return problems


def from_meta(rank: int, world: int, port: int, ckpt: str, plan_path: str, result_dir: str) -> None:
    """Build GPT-2 on the meta device; each rank loads only its stages from ``ckpt``."""
    sys.path.insert(0, os.getcwd())
    import autopart
    from autopart.core.plan import Plan
    from tests.zoo import ZOO

    _setup(rank, world, port, 60)
    reference, args, target, loss_fn = ZOO["gpt2"]()
    with torch.device("meta"):
        model = ZOO["gpt2"]()[0]
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=Plan.load(plan_path),
                            backend="distributed", checkpoint=ckpt)
    mine = dict(pipe.named_parameters())
    problems = [f"{n} is on meta" for n, p in mine.items() if p.is_meta]
    loss = pipe.train_step(*args, target=target)
    ref_loss = loss_fn(reference(*args), target)
    ref_loss.backward()
    problems += _compare(pipe, loss, ref_loss, reference)
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join([" ".join(sorted(mine)), *problems]) + "\n")
    end_rank(pipe)


def pp_dp(rank: int, world: int, port: int, result_dir: str) -> None:
    """A 2 x 2 (pp x dp) mesh: each data-parallel replica trains on its half of the batch;
    after the dp all-reduce every gradient equals the full-batch gradient."""
    _setup(rank, world, port, 60)
    end_rank(_pp_dp(rank, world, result_dir))


def _pp_dp(rank: int, world: int, result_dir: str) -> Any:
    """:func:`pp_dp`'s checks in a process group already set up; returns the pipeline."""
    sys.path.insert(0, os.getcwd())
    from torch.distributed.device_mesh import init_device_mesh

    import autopart
    from autopart.core.capture import capture
    from tests.plans import even_positions, manual_plan
    from tests.zoo import ZOO

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    reference, args, target, loss_fn = ZOO["gpt2"]()
    model = copy.deepcopy(reference)
    dp_rank, half = mesh.get_local_rank("dp"), args[0].shape[0] // 2
    mine = slice(dp_rank * half, (dp_rank + 1) * half)
    my_args, my_target = tuple(a[mine] for a in args), target[mine]
    captured = capture(model, tuple(a[: half // 2] for a in my_args))
    plan = manual_plan(captured, even_positions(captured, 2), 2, half, schedule_kind="1f1b")
    pipe = autopart.compile(model, my_args, loss_fn=loss_fn, plan=plan, backend="distributed",
                            mesh=mesh)
    loss = pipe.train_step(*my_args, target=my_target)
    full = loss_fn(reference(*args), target)  # the global batch's loss, on every rank
    full.backward()                           # and its gradients
    problems = _compare(pipe, loss, full, reference)
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join([f"params {len(list(pipe.named_parameters()))}", *problems]) + "\n")
    return pipe


def _mlp_pipeline(world: int, kind: str, v: int, **compile_kwargs: Any) -> tuple[Any, ...]:
    """The test MLP on a hand-made plan for ``world`` ranks, compiled distributed; returns
    ``(pipe, args, target, loss_fn)``."""
    sys.path.insert(0, os.getcwd())
    import autopart
    from autopart.core.capture import capture
    from tests.plans import even_positions, manual_plan
    from tests.zoo import ZOO

    model, args, target, loss_fn = ZOO["mlp"]()
    captured = capture(model, tuple(a[:2] for a in args))
    plan = manual_plan(captured, even_positions(captured, world * v), 4, 8, schedule_kind=kind,
                       stages_per_rank=v)
    # the ranks meet before compile and before the first step, so that a short step timeout
    # governs only the steps a test makes fail, never how far apart a busy machine started them
    dist.barrier()
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan, backend="distributed",
                            **compile_kwargs)
    dist.barrier()
    return pipe, args, target, loss_fn


def dies(rank: int, world: int, port: int, victim: int, timeout_s: float, kind: str = "1f1b",
         v: int = 1) -> None:
    """Every rank trains; ``victim`` kills itself in the middle of its second step."""
    _setup(rank, world, port, 600)  # the default group's set-up is not what is timed
    pipe, args, target, _ = _mlp_pipeline(world, kind, v, step_timeout_s=timeout_s)
    pipe.train_step(*args, target=target)
    if rank == victim:
        os._exit(17)  # killed mid-run: no clean-up, no goodbye
    pipe.train_step(*args, target=target)
    pipe.train_step(*args, target=target)
    raise SystemExit(0)


def fused(rank: int, world: int, port: int, result_dir: str) -> None:
    """``fuse=True`` under torchrun: each rank's stages run through ``torch.compile``; the
    loss and every gradient still match the plain model."""
    sys.path.insert(0, os.getcwd())
    from tests.zoo import ZOO

    _setup(rank, world, port, 120)
    reference = ZOO["mlp"]()[0]  # the same seed: the same weights
    pipe, args, target, loss_fn = _mlp_pipeline(world, "1f1b", 1, fuse=True)
    problems = [] if "fuse_s" in pipe.timings_s else ["no fuse_s timing"]
    loss = pipe.train_step(*args, target=target)
    ref_loss = loss_fn(reference(*args), target)
    ref_loss.backward()
    problems += _compare(pipe, loss, ref_loss, reference)
    names = [n for n, _ in pipe.named_parameters()]
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join([f"params {len(names)}", *problems]) + "\n")
    end_rank(pipe)


def hangs(rank: int, world: int, port: int, victim: int, kind: str, v: int,
          step_timeout_s: float) -> None:
    """Every rank trains; ``victim``'s first stage hangs (sleeps) in a forward of the second
    step. Healthy ranks print the PipelineFailure and exit 0; the victim never returns on
    its own (its heartbeat thread ends it when told to)."""
    import time

    import autopart

    _setup(rank, world, port, 600)  # the default group would wait for minutes
    pipe, args, target, _ = _mlp_pipeline(world, kind, v, step_timeout_s=step_timeout_s)
    pipe.train_step(*args, target=target)
    if rank == victim:
        calls = [0]

        def stall(*_: Any) -> None:
            calls[0] += 1
            if calls[0] == 2:  # mid-step: the second microbatch's forward
                time.sleep(3600)

        pipe.stages[0].register_forward_pre_hook(stall)
    start = time.monotonic()
    try:
        pipe.train_step(*args, target=target)
    except autopart.PipelineFailure as exc:
        print(f"after {time.monotonic() - start:.1f} s: {exc}", file=sys.stderr, flush=True)
        os._exit(0)
    os._exit(5)  # the step should not have succeeded


def traced(rank: int, world: int, port: int, kind: str, v: int, result_dir: str) -> None:
    """One traced and one memory-measured step of the MLP; rank 0 writes the trace and the
    gathered peaks, every rank checks that it got the same trace."""
    _setup(rank, world, port, 120.0)
    pipe = _traced(rank, world, result_dir, kind, v)
    # Clean-clone CI runs twice saw rank 1 abort here at exit ("terminate called without an
    # active exception"): gloo's worker thread freed the peak gather's tensors while the
    # interpreter was finalizing. The runtime now gathers through the store; the ranks also
    # leave together, as autopart.apps.bench's workers do, and skip the interpreter's C++
    # teardown, which is not what this test is about.
    dist.barrier()
    end_rank(pipe)


def _traced(rank: int, world: int, result_dir: str, kind: str, v: int) -> Any:
    """:func:`traced`'s step in a process group already set up; returns the pipeline."""
    pipe, args, target, loss_fn = _mlp_pipeline(world, kind, v)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    pipe.train_step(*args, target=target)
    opt.step()
    opt.zero_grad()
    loss = pipe.train_step(*args, target=target, trace=True)
    assert pipe.last_trace is not None
    pipe.train_step(*args, target=target, measure_memory=True, optimizer=opt)
    peaks = list(pipe.last_peak_memory_bytes.by_rank.values())
    assert len(peaks) == world and all(p > 0 for p in peaks), peaks
    if rank == 0:
        pipe.last_trace.save(os.path.join(result_dir, "trace.json"))
        with open(os.path.join(result_dir, "peaks.txt"), "w") as f:
            f.write(" ".join(map(str, peaks)) + f"\n{float(loss)}\n")
    return pipe


def _clip_checks(pipe: Any, reference: torch.nn.Module, max_norm: float,
                 norm_type: float) -> list[str]:
    """``pipe.clip_grad_norm_`` against ``clip_grad_norm_`` on the plain model (whose
    gradients must already be the full-batch ones): the norm and every clipped gradient."""
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm,
                                              norm_type=norm_type)
    norm = pipe.clip_grad_norm_(max_norm, norm_type=norm_type)
    problems = []
    try:
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    except AssertionError as exc:
        problems.append(f"norm {norm_type}: {str(exc).splitlines()[0]} ({norm} vs {ref_norm})")
    if not float(ref_norm) > max_norm:
        problems.append(f"the test clips nothing: norm {float(ref_norm)} <= {max_norm}")
    ref_params = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        try:
            torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-7)
        except (AssertionError, TypeError) as exc:
            problems.append(f"clipped {name}: {str(exc).splitlines()[0]}")
    return problems


def clip_norm(rank: int, world: int, port: int, model_name: str, norm_type: float | str,
              mesh_pp: int, result_dir: str) -> None:
    """One training step of ``model_name`` on ``world`` ranks (a ``mesh_pp`` x
    ``world // mesh_pp`` pp x dp mesh when ``mesh_pp < world``), then clip to a tenth of
    the norm; the norm and clipped gradients must equal the plain model's."""
    _setup(rank, world, port, 60)
    end_rank(_clip_norm(rank, world, result_dir, model_name, norm_type, mesh_pp))


def _clip_norm(rank: int, world: int, result_dir: str, model_name: str,
               norm_type: float | str, mesh_pp: int) -> Any:
    """:func:`clip_norm`'s checks in a process group already set up; returns the pipeline."""
    sys.path.insert(0, os.getcwd())
    from torch.distributed.device_mesh import init_device_mesh

    import autopart
    from autopart.core.capture import capture
    from tests.plans import even_positions, manual_plan
    from tests.zoo import ZOO

    norm_type = float(norm_type)  # "inf" passes through the spawn script as a string
    reference, args, target, loss_fn = ZOO[model_name]()
    model = copy.deepcopy(reference)
    kwargs: dict[str, Any] = {}
    my_args, my_target = args, target
    if mesh_pp < world:
        mesh = init_device_mesh("cpu", (mesh_pp, world // mesh_pp), mesh_dim_names=("pp", "dp"))
        kwargs["mesh"] = mesh
        dp, part = mesh.get_local_rank("dp"), args[0].shape[0] * mesh_pp // world
        mine = slice(dp * part, (dp + 1) * part)
        my_args, my_target = tuple(a[mine] for a in args), target[mine]
    batch = my_args[0].shape[0]
    captured = capture(model, tuple(a[: batch // 2] for a in my_args))
    plan = manual_plan(captured, even_positions(captured, mesh_pp), 2, batch,
                       schedule_kind="1f1b")
    pipe = autopart.compile(model, my_args, loss_fn=loss_fn, plan=plan, backend="distributed",
                            **kwargs)
    pipe.train_step(*my_args, target=my_target)
    loss_fn(reference(*args), target).backward()  # full-batch gradients
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()], norm_type)
    problems = _clip_checks(pipe, reference, float(ref_norm) / 10, norm_type)
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join([f"params {len(list(pipe.named_parameters()))}", *problems]) + "\n")
    return pipe


def _gpt2_pipeline(world: int, positions_of: Any = None) -> tuple[Any, ...]:
    """GPT-2 (tests.zoo) on a 2-microbatch 1F1B plan over ``world`` ranks, compiled
    distributed; returns ``(pipe, loss_fn)``."""
    sys.path.insert(0, os.getcwd())
    import autopart
    from autopart.core.capture import capture
    from tests.plans import even_positions, manual_plan
    from tests.zoo import ZOO

    model, args, target, loss_fn = ZOO["gpt2"]()
    captured = capture(model, tuple(a[:4] for a in args))
    plan = manual_plan(captured, even_positions(captured, world), 2, 8, schedule_kind="1f1b")
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan, backend="distributed")
    return pipe, loss_fn


def ckpt_train(rank: int, world: int, port: int, root: str, result_dir: str,
               async_save: bool = False) -> None:
    """Train GPT-2 3 steps (AdamW, clipping) on ``world`` ranks, then save with the
    optimizer (with ``async_save``: changes the weights while the files are written, then
    waits); rank 0 writes the losses."""
    from tests import training

    _setup(rank, world, port, 120)
    pipe, _ = _gpt2_pipeline(world)
    opt = training.adamw(pipe.named_parameters())
    losses = training.train(lambda a, t: pipe.train_step(*a, target=t), pipe.clip_grad_norm_,
                            opt, range(3))
    saved = pipe.save(root, optimizer=opt, extra={"step": 3}, async_save=async_save)
    if async_save:
        with torch.no_grad():
            for p in pipe.parameters():
                p.add_(1.0)  # training goes on: the checkpoint must hold the copied state
        saved.wait()
    if rank == 0:
        with open(os.path.join(result_dir, "losses.txt"), "w") as f:
            f.write(" ".join(repr(x) for x in losses) + "\n")
    end_rank(pipe)


def ckpt_resume(rank: int, world: int, port: int, root: str, result_dir: str) -> None:
    """A scrambled GPT-2 on ``world`` ranks loads the checkpoint and trains 3 more steps;
    writes the losses (rank 0) and each rank's optimizer state right after the load."""
    from safetensors.torch import save_file

    import autopart
    from tests import training

    _setup(rank, world, port, 120)
    pipe, _ = _gpt2_pipeline(world)
    with torch.no_grad():
        for p in pipe.parameters():
            p.add_(0.5)
    opt = training.adamw(pipe.named_parameters())
    autopart.load(root, pipe, optimizer=opt)
    extra = autopart.checkpoint_extra(root)
    state = training.optimizer_state(pipe.named_parameters(), opt)
    save_file(state, os.path.join(result_dir, f"state{rank}.safetensors"))
    losses = training.train(lambda a, t: pipe.train_step(*a, target=t), pipe.clip_grad_norm_,
                            opt, range(extra["step"], extra["step"] + 3))
    if rank == 0:
        with open(os.path.join(result_dir, "losses.txt"), "w") as f:
            f.write(" ".join(repr(x) for x in losses) + "\n")
    end_rank(pipe)


def mixed_precision(rank: int, world: int, port: int, mode: str, result_dir: str) -> None:
    """GPT-2 on ``world`` ranks under ``torch.autocast`` bf16 (``mode="autocast"``) or with
    bf16 weights (``mode="bf16"``), against the plain model run the same way; writes the
    loss difference and the worst gradient error (``tests.precision`` decides)."""
    _setup(rank, world, port, 120)
    end_rank(_mixed_precision(rank, world, result_dir, mode))


def _mixed_precision(rank: int, world: int, result_dir: str, mode: str) -> Any:
    """:func:`mixed_precision`'s step in a process group already set up; returns the
    pipeline."""
    sys.path.insert(0, os.getcwd())
    from tests import precision

    reference, pipe, args, target, loss_fn = precision.models(mode, world, "distributed")
    report = precision.compare(pipe, reference, args, target, loss_fn, mode)
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write(report + "\n")
    return pipe


def run_everyone(fn: Any, world: int, *args: Any) -> None:
    import torch.multiprocessing as mp

    mp.spawn(fn, args=(world, *args), nprocs=world, join=True)


__all__: list[str] = ["numerics", "from_meta", "pp_dp", "dies", "fused", "hangs", "traced",
                      "clip_norm", "ckpt_train", "ckpt_resume", "mixed_precision"]
_ = Any


def integer_cut(rank: int, world: int, port: int, kind: str, v: int, result_dir: str) -> None:
    """GPT-2 cut where only the token ids cross (right after ``view(input_ids)``): the next
    rank's stage starts at ``embedding``, so torch's shape inference must not feed it
    uninitialised indices."""
    _setup(rank, world, port, 60)
    end_rank(_integer_cut(rank, world, result_dir, kind, v))


def _integer_cut(rank: int, world: int, result_dir: str, kind: str, v: int) -> Any:
    """:func:`integer_cut`'s checks in a process group already set up; returns the pipeline."""
    sys.path.insert(0, os.getcwd())
    import autopart
    from autopart.codegen.split import crossing_names
    from autopart.core.capture import capture
    from tests.plans import even_positions, manual_plan
    from tests.zoo import ZOO

    model, args, target, loss_fn = ZOO["gpt2"]()
    reference = copy.deepcopy(model)
    m = 4
    captured = capture(model, tuple(a[: 8 // m] for a in args))
    by_name = {n.name: n for n in captured.graph_module.graph.nodes}
    first = next(p for p in range(1, 20)
                 if all(by_name[c].meta["val"].dtype == torch.int64
                        for c in crossing_names(captured, [p])[0]))
    rest = [p for p in even_positions(captured, world * v) if p > first][: world * v - 2]
    plan = manual_plan(captured, [first, *rest], m, 8, schedule_kind=kind, stages_per_rank=v)
    pipe = autopart.compile(model, args, loss_fn=loss_fn, plan=plan, backend="distributed")
    loss = pipe.train_step(*args, target=target)
    ref_loss = loss_fn(reference(*args), target)
    ref_loss.backward()
    problems = _compare(pipe, loss, ref_loss, reference)
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join([f"cut {first}: {crossing_names(captured, [first])[0]}",
                           *problems]) + "\n")
    return pipe


class _Reused(torch.nn.Module):
    """``h = l1(a)`` is read by ``l2`` (which saves it for its weight gradient) and again
    after ``l2``: with cuts after ``l0`` and after ``l2`` the middle stage sends ``h`` while
    its own backward still needs it."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.l3 = (torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(torch.relu(self.l0(x)))
        y = self.l2(h)
        return self.l3(torch.relu(h + y))


def reused_output(rank: int, world: int, port: int, kind: str, result_dir: str) -> None:
    """A stage output the stage itself saved (``h`` above) under ``kind``: torch's split
    backward detaches every stage output in place after ``I``, so its ``W`` would find a
    saved tensor detached; loss and every gradient must equal the plain model's."""
    _setup(rank, world, port, 60)
    end_rank(_reused_output(rank, world, result_dir, kind))


def _reused_output(rank: int, world: int, result_dir: str, kind: str) -> Any:
    """:func:`reused_output`'s checks in a process group already set up; returns the
    pipeline."""
    sys.path.insert(0, os.getcwd())
    import autopart
    from autopart.codegen.split import crossing_names
    from autopart.core.capture import capture
    from tests.plans import manual_plan

    torch.manual_seed(0)
    model = _Reused()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    m = 4
    captured = capture(model, (x[: 8 // m],))
    ops = [n for n in captured.graph_module.graph.nodes if n.op == "call_function"]

    def after(module: str) -> int:
        return 1 + max(i for i, n in enumerate(ops) if any(
            path == module for path, _ in (n.meta.get("nn_module_stack") or {}).values()))

    cuts = [after("l0"), after("l2")]
    plan = manual_plan(captured, cuts, m, 8, schedule_kind=kind)
    pipe = autopart.compile(model, (x,), loss_fn=torch.nn.functional.mse_loss, plan=plan,
                            backend="distributed")
    loss = pipe.train_step(x, target=y)
    ref_loss = torch.nn.functional.mse_loss(reference(x), y)
    ref_loss.backward()
    problems = _compare(pipe, loss, ref_loss, reference)
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join([f"cuts {cuts}: {crossing_names(captured, cuts)}",
                           *problems]) + "\n")
    return pipe


def pinned(rank: int, world: int, port: int, result_dir: str) -> None:
    """Two steps of the MLP; each rank writes the cores its threads may use before, during
    (read in a stage's forward) and after a step, and its ``cpu_cores``."""
    _setup(rank, world, port, 120.0)
    import json

    from autopart.runtime.host import thread_affinity

    pipe, args, target, _ = _mlp_pipeline(world, "1f1b", 1)
    before = sorted({tuple(sorted(c)) for c in thread_affinity().values()})
    during: list[list[tuple[int, ...]]] = []
    pipe.stages[0].register_forward_pre_hook(
        lambda *_: during.append(sorted({tuple(sorted(c)) for c in thread_affinity().values()})))
    for _ in range(2):
        pipe.train_step(*args, target=target)
    after = sorted({tuple(sorted(c)) for c in thread_affinity().values()})
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"cpu_cores": pipe.cpu_cores, "before": before, "during": during,
                   "after": after}, f)
    end_rank(pipe)


#: The checks :func:`batch` can run, by name, with the default group's timeout (seconds)
#: their launchers above set up: each takes ``(rank, world, result_dir, *args)`` in a
#: process group already set up, writes what its test reads to ``result_dir`` and returns
#: its pipeline (still open).
CASES: dict[str, Any] = {
    "numerics": _numerics, "pp_dp": _pp_dp, "traced": _traced, "clip_norm": _clip_norm,
    "mixed_precision": _mixed_precision, "integer_cut": _integer_cut,
    "reused_output": _reused_output}


def batch(rank: int, world: int, port: int, root: str,
          cases: list[tuple[str, str, tuple[Any, ...]]]) -> None:
    """Each ``(key, check, args)`` of ``cases``, in order, on one process group: the start-up
    (interpreter, imports, group) is paid once for all of them
    (:func:`tests.distributed.spawned.run_cases`).

    Each case writes into its own ``root/cases/<key>``, closes its pipeline (its heartbeat)
    and marks itself done for this rank; the ranks meet at a barrier before the next one;
    the group is destroyed once, at the end. Every case runs under the group's timeout of
    120 s (the launcher's own timeout ends a hung launch), and profiles into an empty cache of its
    own (``$AUTOPART_CACHE_DIR``, shared by its ranks), as a launch of it alone from a test
    would (``tests/conftest.py``). A case that raises writes its traceback as this
    rank's crash and re-raises, so that ``torch.multiprocessing.spawn`` ends the other ranks
    at once (they may wait for this one in a send or a collective): the launcher reports it
    and runs the cases after it in a fresh launch."""
    import traceback

    from tests.distributed.spawned import case_dir, mark_case

    _setup(rank, world, port, 120)
    for key, check, args in cases:
        out = case_dir(root, key)
        out.mkdir(parents=True, exist_ok=True)
        os.environ["AUTOPART_CACHE_DIR"] = os.path.join(root, "profile-cache", key)
        try:
            pipe = CASES[check](rank, world, str(out), *args)
            pipe.close()
        except BaseException:
            mark_case(root, key, rank, traceback.format_exc())
            raise
        mark_case(root, key, rank)
        del pipe
        dist.barrier()
    end_rank()
