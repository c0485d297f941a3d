"""The ``autopart`` command line."""

from __future__ import annotations

from pathlib import Path

import typer

from autopart.cli_plan import plan as _plan
from autopart.cli_profile import profile as _profile

__all__ = ["app", "main"]

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="autopart: automatic pipeline partitioning for PyTorch models.")


@app.command()
def demo(out_dir: Path = typer.Option(Path("autopart-out"), help="where the plan and stage "
                                      "sources are written"),
         steps: int = typer.Option(3, min=1, help="training steps to run"),
         num_stages: int = typer.Option(4, min=1, help="pipeline stages (all on cpu)")) -> None:
    """Compile GPT-2 (124M, random weights) into pipeline stages and train it beside the plain model."""
    from autopart.demo import run_demo

    losses = run_demo(out_dir, steps=steps, num_stages=num_stages)
    worst = max(abs(a - b) for a, b in losses)
    if worst > 1e-4:
        typer.echo(f"pipeline and unpartitioned losses differ by {worst:.2e} (> 1e-4)", err=True)
        raise typer.Exit(1)


@app.command()
def show(plan: Path = typer.Argument(..., exists=True, dir_okay=False, help="a plan JSON file")) -> None:
    """Print a saved plan as a table, with its baselines and the solver's certificate."""
    from autopart.core.errors import PlanError
    from autopart.core.plan import Plan
    from autopart.report import print_certificate, print_plan

    try:
        loaded = Plan.load(plan)
        print_plan(loaded)
        print_certificate(loaded)
    except PlanError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


app.command(name="profile")(_profile)
app.command(name="plan")(_plan)


def main() -> None:
    """Console-script entry point."""
    app()
