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
         ) -> None:
    """Solve a profile onto a cluster; print the plan, the baselines beside it and the gap."""
    from autopart.apps.report import print_certificate, print_plan, skipped_baselines_table
    from autopart.core.errors import PlanError
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
            time_limit_s=time_limit, library_versions=_versions())
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
    # the baselines partition onto the ranks, one stage each, as the solver costs them
    skipped = [(b.name, b.reason) for b in run_baselines(costs, len(result.ranks))
               if b.cuts is None]
    if skipped:
        console.print(skipped_baselines_table(skipped))
    print_certificate(result, console)
    typer.echo(f"wrote {out}")
