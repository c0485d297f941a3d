"""The ``autopart`` command line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

from autopart.cli_plan import plan as _plan
from autopart.cli_profile import profile as _profile

__all__ = ["app", "main"]



class _OneLineErrors(TyperGroup):
    """Every user error is one line on stderr and exit code 2, never a traceback: a bad
    argument or option (click's usage errors), an :class:`~autopart.core.errors.AutopartError`
    a command did not catch, or a file that cannot be read or written (``OSError``)."""

    def main(self, args: Any = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        from autopart.core.errors import AutopartError

        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
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
        except (AutopartError, OSError) as exc:
            typer.echo(f"error: {_one_line(str(exc))}", err=True)
            sys.exit(2)
        sys.exit(rv if isinstance(rv, int) else 0)


def _one_line(text: str) -> str:
    return " ".join(text.split())


app = typer.Typer(add_completion=False, no_args_is_help=True, cls=_OneLineErrors,
                  help="autopart: automatic pipeline partitioning for PyTorch models.")


@app.command()
def demo(out_dir: Path = typer.Option(Path("autopart-out"), help="where the plan, stage "
                                      "sources, trace and timeline PNG are written"),
         steps: int = typer.Option(5, min=1, help="timed steps per arm"),
         numerics_only: bool = typer.Option(False, "--numerics-only", help="only compile "
                                            "GPT-2 (124M) into --num-stages stages in this "
                                            "process and compare losses with the plain model"),
         num_stages: int = typer.Option(4, min=1, help="with --numerics-only: stages")) -> None:
    """Measure the win on this machine: a GPT-2-like model planned for 2 ranks and run on 2
    processes against one process and the equal-layers split; a memory-capped plan; losses
    against the plain model."""
    if numerics_only:
        from autopart.demo import run_demo

        losses = run_demo(out_dir, steps=steps, num_stages=num_stages)
        worst = max(abs(a - b) for a, b in losses)
    else:
        from autopart.showcase import run_measured_demo

        worst = run_measured_demo(out_dir, steps=steps)["max_loss_diff"]
    if worst > 1e-4:
        typer.echo(f"pipeline and unpartitioned losses differ by {worst:.2e} (> 1e-4)", err=True)
        raise typer.Exit(1)


@app.command()
def show(plan: Path = typer.Argument(..., help="a plan JSON file")) -> None:
    """Print a saved plan as a table, with its baselines and the solver's certificate."""
    from autopart.core.errors import PlanError
    from autopart.core.plan import Plan
    from autopart.report import print_certificate, print_plan

    try:
        loaded = Plan.load(plan)
        print_plan(loaded)
        print_certificate(loaded)
    except PlanError as exc:
        typer.echo(f"error: {_one_line(str(exc))}", err=True)
        raise typer.Exit(2) from None


app.command(name="profile")(_profile)
app.command(name="plan")(_plan)


def main() -> None:
    """Console-script entry point."""
    app()
