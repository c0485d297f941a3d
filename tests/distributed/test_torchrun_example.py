"""examples/torchrun_gpt2.py under torchrun on 2 CPU ranks: rank 0 profiles and solves,
every rank trains, and the plan's predicted step is printed beside the measured median."""

from __future__ import annotations

import re
from pathlib import Path

from tests.distributed.torchrun_launch import torchrun


def test_the_example_trains_and_prints_predicted_against_measured(tmp_path: Path) -> None:
    out = torchrun("examples/torchrun_gpt2.py", 2, tmp_path,
                   args=["--steps", "3", "--layers", "2", "--n-embd", "64", "--batch-size", "8",
                         "--seq-len", "32", "--num-microbatches", "4"]).stdout
    assert re.search(r"plan: \d+ stages, \w+, m=4, cuts at \[", out), out
    losses = [float(x) for x in re.findall(r"step \d: loss ([\d.]+), [\d.]+ s", out)]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses), out
    line = re.search(r"step time: predicted ([\d.]+) s, measured ([\d.]+) s \(median of 2 "
                     r"after the first\), predicted ([+-][\d.]+)%", out)
    assert line is not None, out
    predicted, measured, error = (float(g) for g in line.groups())
    assert predicted > 0 and measured > 0
    # the printed error is the ratio's, up to the seconds' rounding to 1 ms
    slack = 100 * 0.0005 * (1 / measured + predicted / measured**2) + 0.05
    assert abs(error - 100 * (predicted / measured - 1)) <= slack
