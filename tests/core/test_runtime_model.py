"""RuntimeDescription: defaults, keyword construction, and every check of __post_init__."""

from __future__ import annotations

import dataclasses

import pytest

from autopart.core.errors import PlanError
from autopart.core.runtime_model import RuntimeDescription


def test_the_default_runtime_costs_nothing_and_allocates_buffers_as_values_arrive() -> None:
    rt = RuntimeDescription()
    assert (rt.name, rt.receive_buffers_per_microbatch, rt.transfer_overhead_us,
            rt.split_backward_us_per_node, rt.split_backward_points) == ("local", False, 0.0,
                                                                         0.0, ())
    assert hash(rt) == hash(RuntimeDescription())  # frozen: a default value of SolveOptions
    with pytest.raises(dataclasses.FrozenInstanceError):
        rt.transfer_overhead_us = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        RuntimeDescription("distributed")  # type: ignore[misc]  # keywords only


def test_split_points_are_kept_as_a_tuple_of_pairs() -> None:
    rt = RuntimeDescription(split_backward_points=[(2, 1.0), (8, 4.0)])  # type: ignore[arg-type]
    assert rt.split_backward_points == ((2, 1.0), (8, 4.0))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"split_backward_us_per_node": -1.0}, r"split_backward_us_per_node=-1.0 must be >= 0"),
    ({"split_backward_us_per_node": float("nan")}, r"split_backward_us_per_node=nan must be"),
    ({"transfer_overhead_us": -1.0}, r"transfer_overhead_us=-1.0 must be >= 0 \(a transfer"),
    ({"split_backward_points": ((0, 1.0),)}, r"split_backward_points=\(\(0, 1.0\),\) must be"),
    ({"split_backward_points": ((2, 1.0), (2, 2.0))}, r"split_backward_points=.* distinct rows"),
    ({"split_backward_points": ((2, -1.0),)}, r"split_backward_points=.* µs per node >= 0"),
])
def test_bad_figures_raise(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        RuntimeDescription(**kwargs)  # type: ignore[arg-type]
