"""The ``autopart`` command line."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

from autopart.apps.cli_bench import bench as _bench
from autopart.apps.cli_devices import devices as _devices
from autopart.apps.cli_plan import plan as _plan
from autopart.apps.cli_profile import profile as _profile

__all__ = ["app", "main", "version_line"]


#: optional packages -> the extra of pyproject.toml that installs them
_EXTRAS = {"transformers": "hf", "matplotlib": "plot"}


class _OneLineErrors(TyperGroup):
    """Every user error is one line on stderr and exit code 2, never a traceback: a bad
    argument or option (click's usage errors), an :class:`~autopart.core.errors.AutopartError`
    a command did not catch, a file that cannot be read or written (``OSError``), or an
    optional package that is not installed (``ModuleNotFoundError`` naming the extra)."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             windows_expand_args: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode,
                                windows_expand_args, **extra)
        from autopart.core.errors import AutopartError

        try:
            rv = super().main(args, prog_name, complete_var, False, windows_expand_args, **extra)
        except typer.TyperException as exc:  # click's errors, as typer vendors them
            ctx = getattr(exc, "ctx", None)
            if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
                typer.echo(ctx.get_help())  # a bare group or command: its help, as before
                sys.exit(2)
            where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            typer.echo(f"error: {_one_line(exc.format_message())}{where}", err=True)
            sys.exit(2)
        except typer.Abort:
            typer.echo("error: aborted", err=True)
            sys.exit(1)
        except ModuleNotFoundError as exc:
            top = (exc.name or "").partition(".")[0]
            if not top or top == "autopart":
                raise  # autopart's own module missing: a broken install, keep the traceback
            needed = _EXTRAS.get(top)
            fix = (f"install the {needed!r} extra: pip install 'autopart[{needed}]'" if needed
                   else f"install it: pip install {top}")
            typer.echo(f"error: this command needs the {top!r} package, which is not "
                       f"installed; {fix}", err=True)
            sys.exit(2)
        except (AutopartError, OSError) as exc:
            typer.echo(f"error: {_one_line(str(exc))}", err=True)
            sys.exit(2)
        sys.exit(rv if isinstance(rv, int) else 0)


def _one_line(text: str) -> str:
    return " ".join(text.split())


app = typer.Typer(add_completion=False, no_args_is_help=True, cls=_OneLineErrors,
                  help="autopart: automatic pipeline partitioning for PyTorch models.")


def version_line() -> str:
    """``autopart X.Y.Z (python A.B.C, torch ..., ortools ...)``: what a bug report needs.

    Versions come from the installed distributions' metadata, so nothing heavy is imported;
    a distribution that is not installed shows as ``not installed``.
    """
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from autopart.core.version import __version__

    parts = [f"python {platform.python_version()}"]
    for dist in ("torch", "ortools", "transformers"):
        try:
            parts.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            parts.append(f"{dist} not installed")
    return f"autopart {__version__} ({', '.join(parts)})"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_line())
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True,
                                       callback=_print_version,
                                       help="print the versions of autopart, python, torch, "
                                            "ortools and transformers, and exit")) -> None:
    """autopart: automatic pipeline partitioning for PyTorch models."""


@app.command()
def demo(out_dir: Path = typer.Option(Path("autopart-out"), help="where the plan, stage "
                                      "sources, trace and timeline PNG are written"),
         steps: int | None = typer.Option(None, min=1, help="timed steps per arm, their "
                                          "median reported (default 7); with "
                                          "--numerics-only, training steps (default 5)"),
         numerics_only: bool = typer.Option(False, "--numerics-only", help="only compile "
                                            "GPT-2 (124M) into --num-stages stages in this "
                                            "process and compare losses with the plain model"),
         num_stages: int = typer.Option(4, min=1, help="with --numerics-only: stages")) -> None:
    """Measure the win on this machine: a GPT-2-like model planned for 2 ranks and run on 2
    processes against one process and the equal-layers split; a memory-capped plan; losses
    against the plain model."""
    if numerics_only:
        from autopart.apps.demo import run_demo

        losses = run_demo(out_dir, steps=steps or 5, num_stages=num_stages)
        worst = max(abs(a - b) for a, b in losses)
    else:
        from autopart.apps.showcase import run_measured_demo

        worst = run_measured_demo(out_dir, steps=steps or 7)["max_loss_diff"]
    if worst > 1e-4:
        typer.echo(f"pipeline and unpartitioned losses differ by {worst:.2e} (> 1e-4)", err=True)
        raise typer.Exit(1)


@app.command()
def show(plan: Path = typer.Argument(..., help="a plan JSON file")) -> None:
    """Print a saved plan as a table, with its baselines and the solver's certificate."""
    from autopart.apps.report import print_certificate, print_layout, print_plan
    from autopart.core.errors import PlanError
    from autopart.core.plan import Plan

    try:
        loaded = Plan.load(plan)
        print_plan(loaded)
        if loaded.tp * loaded.dp > 1 or loaded.model_flops:
            print_layout(loaded)
        print_certificate(loaded)
    except PlanError as exc:
        typer.echo(f"error: {_one_line(str(exc))}", err=True)
        raise typer.Exit(2) from None


app.command(name="profile")(_profile)
app.command(name="plan")(_plan)
app.command(name="bench")(_bench)
app.command(name="devices")(_devices)


def main() -> None:
    """Console-script entry point.

    Kineto (torch's profiler library, used to measure CPU memory) prints a
    ``USDT: ... profiler_start`` line to stderr for every profiled call; in a command's
    output that is noise, so level 6 (above every level it logs at) is set unless
    ``$KINETO_LOG_LEVEL`` says otherwise. Child processes inherit it.
    """
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    app()
