"""``autopart plan``: solve a profiled CostGraph onto a cluster, print the plan, baselines and gap."""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import typer

from autopart.core.errors import UsageError

__all__ = ["plan", "build_cluster"]

_GIB = 2**30


def _load_costs(path: Path) -> Any:
    """Read a CostGraph JSON file written by ``autopart profile``.

    Raises:
        UsageError: missing or unreadable file, not JSON, or not a CostGraph.
    """
    from autopart.core.costgraph import CostGraph
    from autopart.core.errors import PlanError

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file; pass a CostGraph JSON written by "
                           "`autopart profile`") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot read it ({exc})") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise UsageError(f"{path}: not JSON (nested too deep to read); pass a file written by "
                         "`autopart profile`") from None
    except ValueError as exc:  # json.JSONDecodeError, or an integer of > 4300 digits
        raise UsageError(f"{path}: not JSON ({exc}); pass a file written by `autopart profile`"
                           ) from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a JSON object (a CostGraph), got {type(data).__name__}")
    try:
        return CostGraph.from_dict(data)
    except PlanError as exc:
        raise UsageError(f"{path}: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError,
            RecursionError) as exc:  # a damaged file CostGraph.from_dict does not name
        raise UsageError(f"{path}: not a valid CostGraph ({type(exc).__name__}: {exc}); pass a "
                         "file written by `autopart profile`") from None


def build_cluster(costs_source: str, devices: int | None, cluster: str | None) -> Any:
    """The Cluster for ``--devices N`` or ``--cluster PRESET:N``.

    ``--devices N`` takes N devices of the preset the profile was made for
    (``analytical:<preset>``, or ``measured:cpu`` -> the ``cpu`` preset); GPU ranks are named
    ``cuda:0 .. cuda:N-1``, CPU ranks ``cpu``. ``PRESET`` is any name the preset accepts
    (``h100:8``, ``"NVIDIA A100-SXM4-80GB:4"``; see ``autopart devices``).

    Raises:
        UsageError: both or neither option, N < 1, an unknown preset (with the closest names),
            or ``--devices`` with a measured GPU profile (whose GPU model the profile does not
            name).
    """
    from autopart.core.cluster import PRESETS, Cluster, device_preset
    from autopart.core.errors import PlanError

    if (devices is None) == (cluster is None):
        raise UsageError("pass exactly one of --devices N or --cluster PRESET:N "
                           f"(presets: {', '.join(PRESETS)})")
    if cluster is not None:
        name, sep, count = cluster.rpartition(":")
        if not sep or not count.strip().isdigit():
            raise UsageError(f"--cluster {cluster!r}: expected PRESET:N, e.g. h100-sxm:8 "
                               f"(presets: {', '.join(PRESETS)})")
        num = int(count)
    else:
        assert devices is not None
        kind, _, name = costs_source.partition(":")
        if kind == "measured" and name != "cpu":
            raise UsageError(f"the profile was measured on {name!r}, which names no device "
                               "preset; pass --cluster PRESET:N "
                               f"(presets: {', '.join(PRESETS)})")
        num = devices
    try:
        spec = device_preset(name)
    except PlanError as exc:
        raise UsageError(str(exc)) from None
    if num < 1:
        raise UsageError(f"the cluster needs at least one device, got {num}")
    names = ["cpu"] * num if spec.name == "cpu" else [f"cuda:{r}" for r in range(num)]
    return Cluster.uniform(spec, names)


def _solve_3d(costs: Any, cluster: Any, options: Any, *, tp: int | None, pp: int | None,
              dp: int | None, zero_stage: int | None, heads: int | None,
              overlap_grad_reduce: bool = True, zero_layer_units: bool = True,
              sequence_parallel: bool = False, ep: int | None = 1,
              num_experts: int | None = None, cp: int | None = 1,
              max_cp: int | None = None, causal: bool = True,
              cp_attention: str | None = None) -> Any:
    """The (tp, pp, dp, ZeRO) search over the cluster's GPUs, hosts as the preset ships them."""
    from autopart.core.topology import topology_for_device
    from autopart.solver.layout_search import LayoutOptions, solve_layout

    spec = cluster.devices[0]
    topology = topology_for_device(spec.name, spec.link_bandwidth_bytes_per_s,
                                   spec.link_latency_us)
    layout = LayoutOptions(num_gpus=cluster.num_ranks, topology=topology, tp=tp, pp=pp, dp=dp,
                           zero_stage=zero_stage, num_heads=heads,
                           overlap_grad_reduce=overlap_grad_reduce,
                           zero_layer_units=zero_layer_units,
                           sequence_parallel=sequence_parallel, ep=ep,
                           num_experts=num_experts, cp=cp, max_cp=max_cp,
                           causal_attention=causal, cp_attention=cp_attention)
    return solve_layout(costs, spec, options, layout)


def _ships_in_hosts(cluster: Any) -> bool:
    """Whether ``cluster`` has several GPUs of a preset that ships in multi-GPU hosts."""
    from autopart.core.topology import DEVICE_TOPOLOGY, TOPOLOGY_PRESETS

    host = DEVICE_TOPOLOGY.get(cluster.devices[0].name)
    return (cluster.num_ranks > 1 and host is not None
            and TOPOLOGY_PRESETS[host].gpus_per_host > 1)


def _versions() -> dict[str, str]:
    out: dict[str, str] = {}
    for pkg in ("autopart", "torch"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            continue
    return out


def plan(profile: Path = typer.Argument(..., help="CostGraph JSON written by `autopart profile`"),
         devices: int | None = typer.Option(None, "--devices", help="N devices of the profile's preset"),
         cluster: str | None = typer.Option(None, "--cluster", help="PRESET:N, e.g. h100-sxm:8"),
         memory_cap: float | None = typer.Option(None, "--memory-cap",
                                                 help="per-device memory cap, GiB (default: "
                                                      "the device's memory)"),
         optimize: str = typer.Option("speed", help="speed or memory"),
         batch_size: int | None = typer.Option(None, "--batch-size",
                                               help="full batch B (default: the profiled batch)"),
         num_microbatches: int | None = typer.Option(None, "--num-microbatches",
                                                     help="m (default: searched)"),
         schedule: str | None = typer.Option(None, "--schedule",
                                             help="gpipe, 1f1b, interleaved_1f1b, zero_bubble, "
                                                  "zbv or dualpipev (default: searched)"),
         stages_per_rank: int | None = typer.Option(None, "--stages-per-rank",
                                                    help="v virtual stages per rank (default: searched)"),
         time_limit: float = typer.Option(10.0, "--time-limit", help="CP-SAT time limit, s"),
         out: Path = typer.Option(Path("plan.json"), "--out", help="plan JSON to write"),
         search_3d: bool | None = typer.Option(
             None, "--3d/--pipeline-only",
             help="--3d: choose tp, pp, dp and the ZeRO stage together (implied by "
                  "--tp/--pp/--dp/--zero-stage); --pipeline-only: every GPU a pipeline rank. "
                  "Default: --3d where the preset ships in hosts of several GPUs (DGX-class "
                  "a100/h100/h200), else --pipeline-only"),
         tp: int | None = typer.Option(None, "--tp", help="tensor-parallel degree (3D; default: "
                                       "searched)"),
         pp: int | None = typer.Option(None, "--pp", help="pipeline ranks (3D; default: searched)"),
         dp: int | None = typer.Option(None, "--dp", help="data-parallel replicas (3D; default: "
                                       "searched)"),
         zero_stage: int | None = typer.Option(None, "--zero-stage", help="ZeRO stage 0-3 over dp "
                                               "(3D; default: searched)"),
         heads: int | None = typer.Option(None, "--heads", help="the model's attention heads, "
                                          "which tp must divide (3D)"),
         overlap_grad_reduce: bool = typer.Option(
             True, "--overlap-grad-reduce/--no-overlap-grad-reduce",
             help="ZeRO-0's dp gradient all-reduce in buckets during each stage's last "
                  "backward (default), or after the pipeline flush (3D)"),
         zero_layer_units: bool = typer.Option(
             True, "--zero-layer-units/--no-zero-layer-units",
             help="ZeRO 1-3 shard and gather each layer as its own FSDP unit (default), or "
                  "each stage whole (3D)"),
         sequence_parallel: bool = typer.Option(
             False, "--sequence-parallel/--no-sequence-parallel",
             help="tp > 1: Megatron's sequence parallelism, the layer norms, dropouts and "
                  "residual adds between tp pairs on 1/tp of the tokens (3D)"),
         ep: int | None = typer.Option(
             None, "--ep", min=1,
             help="expert parallelism: each MoE layer's experts split over ep of the dp "
                  "replicas, tokens sent to them by all-to-all (3D; keeps tp 1); "
                  "default: searched with --experts, else 1"),
         experts: int | None = typer.Option(
             None, "--experts", min=1,
             help="the model's experts per MoE layer: the layout search then tries every ep "
                  "dividing them and dp (3D)"),
         cp: int | None = typer.Option(
             None, "--cp", min=1,
             help="context parallelism: each sequence split over cp GPUs, attention "
                  "all-gathering keys and values (3D); default: searched with --seq-len "
                  "(among the divisors of the GPUs dividing seq-len / 2), else 1"),
         seq_len: int | None = typer.Option(
             None, "--seq-len", min=2,
             help="tokens per sequence of the profile: the layout search then tries cp "
                  "(3D)"),
         cp_attention: str | None = typer.Option(
             None, "--cp-attention",
             help="how attention spans the cp GPUs: 'all_gather' (keys and values "
                  "all-gathered) or 'ulysses' (all-to-alls between sequence and head "
                  "sharding; tp x cp must divide --heads); default: the better of those that "
                  "apply (3D)"),
         attention: str = typer.Option(
             "causal", "--attention",
             help="the model's attention as cp prices it: 'causal' (decoders) or 'full' "
                  "(encoders)"),
         recompute_policy: str = typer.Option(
             "full", "--recompute-policy",
             help="what a stage that recomputes runs again: 'full' (its whole forward), "
                  "'selective' (all but matmul, attention and tp reduction outputs: torch's "
                  "selective activation checkpointing, torchtitan's op policy), 'op' (all but "
                  "the nodes the solver keeps per stage under the memory cap) or 'auto' (the "
                  "better of 'full' and 'op' for the objective)"),
         ) -> None:
    """Solve a profile onto a cluster; print the plan, the baselines beside it and the gap.

    With ``--3d`` (or any of ``--tp/--pp/--dp/--zero-stage``) the GPUs are grouped in hosts
    (DGX presets: 8 per host) and tp, pp, dp and the ZeRO stage are chosen together;
    ``--batch-size`` is then the global batch over all replicas.
    """
    from autopart.apps.report import print_certificate, print_layout, print_plan, skipped_baselines_table
    from autopart.core.errors import PlanError
    from autopart.core.progress import phase
    from autopart.solver import SolveOptions, solve
    from autopart.solver.baselines import run_baselines

    try:
        if memory_cap is not None and memory_cap <= 0:
            raise UsageError(f"--memory-cap {memory_cap}: must be > 0 GiB")
        costs = _load_costs(profile)
        the_cluster = build_cluster(costs.source, devices, cluster)
        options = SolveOptions(
            batch_size=costs.batch_size if batch_size is None else batch_size,
            num_microbatches=num_microbatches, optimize=optimize, schedule_kind=schedule,
            stages_per_rank=stages_per_rank,
            memory_cap_bytes=None if memory_cap is None else int(memory_cap * _GIB),
            time_limit_s=time_limit, library_versions=_versions(),
            recompute_policy=recompute_policy)
        with phase("solve"):  # on stderr (autopart.core.progress)
            if ep is None:
                ep = None if experts is not None else 1
            if attention not in ("causal", "full"):
                raise UsageError(f"--attention {attention!r}: expected 'causal' or 'full'")
            if cp is None:
                cp = None if seq_len is not None and ep == 1 else 1
            fixed = (any(x is not None for x in (tp, pp, dp, zero_stage)) or ep != 1
                     or cp != 1)
            if search_3d is False and fixed:
                raise UsageError("--pipeline-only makes every GPU a pipeline rank; drop it to "
                                 "fix --tp/--pp/--dp/--zero-stage")
            if search_3d is None:
                search_3d = fixed or _ships_in_hosts(the_cluster)
            if search_3d:
                result = _solve_3d(costs, the_cluster, options, tp=tp, pp=pp, dp=dp,
                                   zero_stage=zero_stage, heads=heads,
                                   overlap_grad_reduce=overlap_grad_reduce,
                                   zero_layer_units=zero_layer_units,
                                   sequence_parallel=sequence_parallel, ep=ep,
                                   num_experts=experts, cp=cp,
                                   max_cp=None if seq_len is None else seq_len // 2,
                                   causal=attention == "causal", cp_attention=cp_attention)
            else:
                result = solve(costs, the_cluster, options)
        result.save(out)
    except (UsageError, PlanError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except OSError as exc:
        typer.echo(f"error: cannot write {out}: {exc}", err=True)
        raise typer.Exit(2) from None
    from rich.console import Console

    console = Console(width=None if Console().is_terminal else 120)
    print_plan(result, console)
    if result.tp * result.dp * result.cp > 1 or result.model_flops:
        print_layout(result, console)
    # the baselines partition onto the ranks, one stage each, as the solver costs them
    skipped = [(b.name, b.reason) for b in run_baselines(costs, len(result.ranks))
               if b.cuts is None]
    if skipped:
        console.print(skipped_baselines_table(skipped))
    print_certificate(result, console)
    typer.echo(f"wrote {out}")
