import pytest

from autopart.core.errors import PlanError
from autopart.core.schedule import Action, execution_order, gpipe_schedule, validate_schedule


def _text(schedule: tuple[tuple[Action, ...], ...]) -> list[str]:
    return [" ".join(str(a) for a in rank) for rank in schedule]


def test_gpipe_table_two_stages_three_microbatches() -> None:
    assert _text(gpipe_schedule(2, 3)) == [
        "0F0 0F1 0F2 0B2 0B1 0B0",
        "1F0 1F1 1F2 1B2 1B1 1B0",
    ]
    assert _text(gpipe_schedule(2, 2, training=False)) == ["0F0 0F1", "1F0 1F1"]


def test_execution_order_respects_dependencies() -> None:
    order = [str(a) for a in execution_order(gpipe_schedule(2, 2), 2)]
    assert order == ["0F0", "0F1", "1F0", "1F1", "1B1", "1B0", "0B1", "0B0"]


@pytest.mark.parametrize("text", ["2F0", "0B13", "11W2", "3I0"])
def test_action_text_round_trip(text: str) -> None:
    assert str(Action.parse(text)) == text


@pytest.mark.parametrize("text", ["F0", "2X0", "2F", "-1F0", "2 F 0"])
def test_bad_action_text(text: str) -> None:
    with pytest.raises(PlanError, match="cannot parse action"):
        Action.parse(text)


def test_validator_rejects_missing_duplicate_and_deadlock() -> None:
    good = gpipe_schedule(2, 2)
    validate_schedule(good, 2, 2)
    with pytest.raises(PlanError, match="never runs 1B0"):
        validate_schedule((good[0], good[1][:-1]), 2, 2)
    with pytest.raises(PlanError, match="appears twice"):
        validate_schedule((good[0] + (Action(0, "F", 0),), good[1]), 2, 2)
    # stage 1 tries its backward before its own forward: it waits on itself
    stuck = (good[0], (Action(1, "B", 0), Action(1, "F", 0), Action(1, "F", 1), Action(1, "B", 1)))
    with pytest.raises(PlanError, match="deadlocks"):
        validate_schedule(stuck, 2, 2)
    with pytest.raises(PlanError, match="out of range"):
        validate_schedule((good[0], good[1] + (Action(1, "F", 5),)), 2, 2)


def test_one_f_one_b_table_three_stages_four_microbatches() -> None:
    from autopart.core.schedule import one_f_one_b_schedule

    assert _text(one_f_one_b_schedule(3, 4)) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]


def test_zero_bubble_splits_each_backward_into_input_then_weight() -> None:
    from autopart.core.schedule import zero_bubble_schedule

    assert _text(zero_bubble_schedule(2, 2)) == [
        "0F0 0F1 0I0 0W0 0I1 0W1",
        "1F0 1I0 1W0 1F1 1I1 1W1",
    ]


def test_interleaved_table_two_ranks_two_chunks() -> None:
    from autopart.core.schedule import interleaved_1f1b_schedule

    assert _text(interleaved_1f1b_schedule(2, 4, 2)) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]
    with pytest.raises(PlanError, match="multiple of the number of ranks"):
        interleaved_1f1b_schedule(2, 3, 2)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
@pytest.mark.parametrize(("ranks", "m"), [(1, 1), (2, 2), (2, 4), (3, 3), (4, 8)])
def test_every_kind_validates_and_round_trips_through_csv(kind: str, ranks: int, m: int) -> None:
    from autopart.core.schedule import build_schedule, from_csv, to_csv

    v = 2 if kind == "interleaved_1f1b" else 1
    schedule = build_schedule(kind, ranks, m, v)
    validate_schedule(schedule, ranks * v, m)
    assert from_csv(to_csv(schedule)) == schedule


def test_in_flight_counts_follow_the_schedule() -> None:
    from autopart.core.schedule import build_schedule, in_flight_counts

    assert in_flight_counts(build_schedule("gpipe", 4, 8), 4) == [8, 8, 8, 8]
    assert in_flight_counts(build_schedule("1f1b", 4, 8), 4) == [4, 3, 2, 1]
    assert in_flight_counts(build_schedule("zero_bubble", 4, 8), 4) == [4, 3, 2, 1]
    assert in_flight_counts(build_schedule("1f1b", 4, 2), 4) == [2, 2, 2, 1]


def test_timeline_shows_waiting_slots() -> None:
    from autopart.core.schedule import format_timeline

    assert format_timeline(gpipe_schedule(2, 2), 2).splitlines() == [
        "rank 0 | 0F0 0F1  .   .   .   .  0B1 0B0",
        "rank 1 |  .   .  1F0 1F1 1B1 1B0  .   . ",
    ]


def test_split_and_full_backward_cannot_mix() -> None:
    schedule = ((Action(0, "F", 0), Action(0, "B", 0), Action(0, "I", 0), Action(0, "W", 0)),)
    with pytest.raises(PlanError, match="both B and I/W"):
        validate_schedule(schedule, 1, 1)
