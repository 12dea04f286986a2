"""Plan data: validation messages, string form, generators."""

from __future__ import annotations

import random

import pytest
from model_helpers import random_plan

from roundpipe.shared.plan import Plan, Stage


def test_string_form_round_trips() -> None:
    text = "F[0:3,3:5] T[5:8] B[4:5,0:4]"
    plan = Plan.parse(text)
    assert plan == Plan(forward=[(0, 3), (3, 5)], tail=(5, 8), backward=[(4, 5), (0, 4)])
    assert str(plan) == text
    plan.validate(8)
    whole = Plan(forward=(), tail=(0, 8), backward=())
    assert str(whole) == "F[] T[0:8] B[]"
    assert Plan.parse(str(whole)) == whole
    assert Plan.parse("  F[ 0:2 , 2:3 ]  T[3:4] B[0:3] ") == Plan(
        forward=((0, 2), (2, 3)), tail=(3, 4), backward=((0, 3),)
    )
    assert hash(plan) == hash(Plan.parse(text))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "F[0:3] T[3:8]",
        "F[0-3] T[3:8] B[0:3]",
        "F[0:3] T[3:8,8:9] B[0:3]",
        "T[3:8] F[0:3] B[0:3]",
    ],
)
def test_parse_rejects_bad_syntax(text: str) -> None:
    with pytest.raises(ValueError, match="parse plan|bad"):
        Plan.parse(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("F[0:3,3:5] T[5:7] B[4:5,0:4]", r"must end at the last layer \(stop == 8\)"),
        ("F[0:3,4:5] T[5:8] B[4:5,0:4]", "forward stage 4:5 must start at 3"),
        ("F[1:3,3:5] T[5:8] B[4:5,0:4]", "forward stage 1:3 must start at 0"),
        ("F[0:3,3:4] T[5:8] B[4:5,0:4]", "forward stages end at 4 but the tail starts at 5"),
        ("F[0:3,3:5] T[5:8] B[0:4,4:5]", "backward stage 0:4 must stop at 5"),
        ("F[0:3,3:5] T[5:8] B[4:5,1:4]", "stop short of layer 0"),
        ("F[0:3,3:5] T[5:8] B[3:5,0:4]", "backward stage 0:4 must stop at 3"),
        ("F[0:3,3:3,3:5] T[5:8] B[4:5,0:4]", "forward stage 3:3 is empty"),
        ("F[0:5] T[5:8] B[]", "backward stages must cover layers 0:5"),
        ("F[] T[5:8] B[0:5]", "forward stages must cover layers 0:5"),
        ("F[0:2] T[0:8] B[0:2]", "tail covers the whole model"),
        ("F[] T[8:8] B[]", "tail 8:8 must be a non-empty range"),
    ],
)
def test_validate_names_the_problem(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Plan.parse(text).validate(8)


def test_backward_boundaries_and_stages() -> None:
    plan = Plan.parse("F[0:3,3:5] T[5:8] B[4:5,1:4,0:1]")
    assert plan.backward_boundaries() == {4, 1, 0}
    assert plan.stages() == [
        Stage("F", 0, 3),
        Stage("F", 3, 5),
        Stage("T", 5, 8),
        Stage("B", 4, 5),
        Stage("B", 1, 4),
        Stage("B", 0, 1),
    ]
    assert [str(s) for s in plan.stages()][2] == "T[5:8]"
    assert Plan.parse("F[] T[0:4] B[]").backward_boundaries() == frozenset()


def test_uniform() -> None:
    plan = Plan.uniform(10, num_forward=3, num_backward=4, tail_layers=2)
    plan.validate(10)
    assert plan.tail == (8, 10)
    assert [b - a for a, b in plan.forward] == [3, 2, 3]
    assert [b - a for a, b in plan.backward] == [2, 2, 2, 2]
    assert Plan.uniform(4, num_forward=1, num_backward=1, tail_layers=4) == Plan.parse(
        "F[] T[0:4] B[]"
    )
    with pytest.raises(ValueError, match="num_backward"):
        Plan.uniform(4, num_forward=1, num_backward=5)


def test_random_plans_are_valid_and_varied() -> None:
    rng = random.Random(0)
    plans = [random_plan(7, rng) for _ in range(300)]
    for p in plans:
        p.validate(7)
        assert Plan.parse(str(p)) == p
    tails = {p.tail[0] for p in plans}
    assert tails == set(range(7))
    assert any(p.forward != tuple(reversed(p.backward)) for p in plans)  # asymmetric
    assert any(all(b - a == 1 for a, b in p.forward) and len(p.forward) == 6 for p in plans)
