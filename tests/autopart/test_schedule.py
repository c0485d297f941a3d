import pytest

from autopart.errors import PlanError
from autopart.schedule import Action, execution_order, gpipe_schedule, validate_schedule


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
