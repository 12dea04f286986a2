"""The schedule simulator: hand-computed cases, sanity properties, bound schedules."""

from __future__ import annotations

import pytest

from roundpipe.coordinator.planning.baselines import bound_baseline
from roundpipe.coordinator.planning.costs import LayerCost
from roundpipe.coordinator.planning.hardware import HardwareSpec
from roundpipe.coordinator.planning.search import plan_stages
from roundpipe.coordinator.planning.simulator import (
    BoundStage,
    SimStage,
    simulate_bound,
    simulate_roundpipe,
)


def three_stages(**kw: float) -> list[SimStage]:
    return [
        SimStage("F", 0, 2, 1.0, **kw),
        SimStage("T", 2, 3, 2.0),
        SimStage("B", 0, 2, 1.0),
    ]


# ----------------------------------------------------------------- hand-computed cases


def test_two_workers_two_microbatches_by_hand() -> None:
    # w0: F m0 [0,1] m1 [1,2]; w1: T m0 [1,3] m1 [3,5]; w0: B m0 [3,4] m1 [5,6].
    r = simulate_roundpipe(three_stages(), num_workers=2, num_microbatches=2)
    assert r.iteration_s == pytest.approx(6.0)
    assert r.bubble_fraction == pytest.approx(1 - 8 / 12)
    assert r.utilisation == pytest.approx([4 / 6, 4 / 6])
    assert r.grid() == "w0: F0m0 F0m1 | B0m0 B0m1\nw1: Tm0 Tm1"
    starts = {e.label: (e.start, e.end) for e in r.events if e.what == "compute"}
    assert starts == {
        "F0m0": (0, 1),
        "F0m1": (1, 2),
        "Tm0": (1, 3),
        "Tm1": (3, 5),
        "B0m0": (3, 4),
        "B0m1": (5, 6),
    }


def test_uploads_are_prefetched_and_downloads_follow_compute() -> None:
    stages = [
        SimStage("F", 0, 2, 1.0, upload_s=0.5),
        SimStage("T", 2, 3, 2.0),
        SimStage("B", 0, 2, 1.0, upload_s=0.5, download_s=0.25),
    ]
    r = simulate_roundpipe(stages, num_workers=2, num_microbatches=2)
    # F waits for its own upload (0.5); B's upload runs during F ([0.5, 1.0]), so B
    # starts when w0 is free and its inputs are there: m0 [3.5,4.5], m1 [5.5,6.5];
    # then the gradient download [6.5, 6.75].
    ups = [(e.label, e.start, e.end) for e in r.events if e.what == "upload"]
    assert ups == [("up:F0", 0.0, 0.5), ("up:B0", 0.5, 1.0)]
    downs = [(e.start, e.end) for e in r.events if e.what == "download"]
    assert downs == [(6.5, 6.75)]
    assert r.iteration_s == pytest.approx(6.75)


def test_handoff_latency_delays_each_dependent_microbatch() -> None:
    stages = [SimStage("F", 0, 1, 1.0), SimStage("T", 1, 2, 1.0, handoff_s=0.5)]
    r = simulate_roundpipe(stages, num_workers=2, num_microbatches=2)
    t = [(e.start, e.end) for e in r.worker_events(1)]
    assert t == [(1.5, 2.5), (2.5, 3.5)]


def test_iteration_gate_and_persistent_counter() -> None:
    # One stage per iteration, four workers: iteration k is sent only once k-2 is done,
    # so at most two iterations run at a time; task j goes to worker j mod 4.
    r = simulate_roundpipe(
        [SimStage("T", 0, 1, 1.0)], num_workers=4, num_microbatches=1, iterations=4
    )
    assert r.iteration_ends == pytest.approx([1, 1, 2, 2])
    assert [e.worker for e in sorted(r.events, key=lambda e: e.iteration)] == [0, 1, 2, 3]
    # Counter persists: with 3 stages on 2 workers, iteration 2 starts on worker 1.
    r = simulate_roundpipe(three_stages(), num_workers=2, num_microbatches=2, iterations=2)
    first_of_2 = [e for e in r.events if e.iteration == 2 and e.stage == 0][0]
    assert first_of_2.worker == 1


def test_mixed_speeds_scale_compute_only() -> None:
    stages = [SimStage("F", 0, 1, 1.0, upload_s=0.5), SimStage("T", 1, 2, 1.0)]
    r = simulate_roundpipe(stages, num_workers=2, num_microbatches=1, speeds=[1.0, 0.5])
    # F on w0: upload [0, .5], compute [.5, 1.5]; T on the half-speed w1: [1.5, 3.5].
    assert r.iteration_s == pytest.approx(3.5)


def test_staleness_zero_waits_for_the_optimizer() -> None:
    stages = [SimStage("F", 0, 2, 1.0), SimStage("T", 2, 3, 1.0, optimizer_s=2.0)]
    stages.append(SimStage("B", 0, 2, 1.0, optimizer_s=2.0))
    kw = dict(num_workers=3, num_microbatches=4, iterations=5)
    fast = simulate_roundpipe(stages, staleness=1, **kw)
    exact = simulate_roundpipe(stages, staleness=0, **kw)
    assert exact.iteration_s > fast.iteration_s
    # Staleness 0: the next forward reads layers 0:2, updated by the optimizer after the
    # last backward's gradient: iteration 2's F starts after optimizer step 1 ends.
    f2 = min(e.start for e in exact.events if e.iteration == 2 and e.what == "compute")
    assert f2 >= exact.iteration_ends[0] + 2.0 - 1e-9


def test_microbatch_split_stage_by_hand() -> None:
    """Note [microbatch-split stages]: F[0:2] as tasks over {0} and {1} on two workers
    run side by side from the iteration's start; the tail's microbatch 1 waits for the
    part that ran it. w0: Fa m0 [0,1], T m0 [1,3] m1 [3,5]; w1: Fb m1 [0,1], B m0 [3,4]
    m1 [5,6]."""
    f, t, b = three_stages()
    stages = [
        SimStage("F", 0, 2, 1.0, microbatches=(0,), label="Fa"),
        SimStage("F", 0, 2, 1.0, microbatches=(1,), label="Fb"),
        t,
        b,
    ]
    r = simulate_roundpipe(stages, num_workers=2, num_microbatches=2)
    assert r.grid() == "w0: Fam0 | Tm0 Tm1\nw1: Fbm1 | B0m0 B0m1"
    spans = {e.label: (e.start, e.end) for e in r.events if e.what == "compute"}
    assert [spans[x] for x in ("Fam0", "Fbm1", "Tm1", "B0m1")] == [(0, 1), (0, 1), (3, 5), (5, 6)]
    assert r.iteration_s == pytest.approx(6.0)


def test_split_stages_on_one_worker_cost_only_their_overhead() -> None:
    """Splitting a stage changes nothing but the extra task's overhead on one worker."""
    whole = [SimStage("F", 0, 3, 0.3), SimStage("T", 3, 4, 0.7), SimStage("B", 0, 3, 0.9)]
    split = [
        whole[0],
        whole[1],
        SimStage("B", 0, 3, 0.9, microbatches=(0, 1, 2)),
        SimStage("B", 0, 3, 0.9, microbatches=(3,)),
    ]
    kw = dict(num_workers=1, num_microbatches=4, iterations=3)
    assert simulate_roundpipe(split, **kw).iteration_s == pytest.approx(
        simulate_roundpipe(whole, **kw).iteration_s
    )


def test_splitting_the_last_backward_stage_shares_the_drain_at_staleness_zero() -> None:
    """Staleness 0 pays one microbatch of the last backward stage alone on one worker
    (the drain); split {0, 1} / {2} over both workers, the next iteration starts sooner,
    and the optimizer still waits for both parts."""
    f = SimStage("F", 0, 4, 1.0)
    t = SimStage("T", 4, 6, 1.3)
    b = SimStage("B", 0, 4, 3.0, optimizer_s=0.1)
    split = [
        SimStage("F", 0, 4, 1.0, microbatches=(0,)),
        SimStage("F", 0, 4, 1.0, microbatches=(1, 2)),
        t,
        SimStage("B", 0, 4, 3.0, microbatches=(0, 1), optimizer_s=0.1),
        SimStage("B", 0, 4, 3.0, microbatches=(2,), optimizer_s=0.1),
    ]
    kw = dict(num_workers=2, num_microbatches=3, iterations=6, staleness=0)
    whole_r = simulate_roundpipe([f, t, b], **kw)
    split_r = simulate_roundpipe(split, **kw)
    assert split_r.iteration_s < 0.9 * whole_r.iteration_s
    for k in range(2, 7):  # each forward of k waits for both parts' optimizer updates
        first = min(e.start for e in split_r.events if e.iteration == k)
        opt = [e.end for e in split_r.optimizer_events if e.iteration == k - 1]
        assert len(opt) == 2 and first >= max(opt) - 1e-9


def test_a_split_stage_writes_its_slot_again_only_after_the_optimizer_step() -> None:
    """Staleness 1: a split backward stage's first part downloads iteration k's gradient
    only once the optimizer has consumed k-1's, which it does after the *last* part
    (Note 4 of the weight-update ordering), however little the first part carries."""
    stages = [
        SimStage("F", 0, 2, 0.1),
        SimStage("T", 2, 3, 0.1, download_s=0.01),
        SimStage("B", 0, 2, 0.1, download_s=0.01, microbatches=(0,), optimizer_s=0.0),
        SimStage("B", 0, 2, 0.1, download_s=0.01, microbatches=(1,), optimizer_s=5.0),
    ]
    r = simulate_roundpipe(stages, num_workers=2, num_microbatches=2, iterations=3, staleness=1)
    for k in (2, 3):
        optimized = max(e.end for e in r.optimizer_events if e.iteration == k - 1 and e.stage == 3)
        download = next(
            e for e in r.events if e.what == "download" and e.iteration == k and e.stage == 2
        )
        assert download.start >= optimized - 1e-9, (k, download, optimized)


def test_split_microbatches_are_checked() -> None:
    bad = [SimStage("F", 0, 2, 1.0, microbatches=(0, 2)), SimStage("T", 2, 3, 1.0)]
    with pytest.raises(ValueError, match=r"microbatches \[0, 2\]: expected distinct"):
        simulate_roundpipe(bad, num_workers=1, num_microbatches=2)


# ------------------------------------------------------------------ sanity properties


@pytest.mark.parametrize("iterations", [1, 3])
def test_one_worker_iteration_time_is_the_sum_of_work(iterations: int) -> None:
    stages = [
        SimStage("F", 0, 3, 0.3),
        SimStage("F", 3, 5, 0.2),
        SimStage("T", 5, 6, 0.7),
        SimStage("B", 3, 5, 0.6),
        SimStage("B", 0, 3, 0.9),
    ]
    m = 5
    r = simulate_roundpipe(stages, num_workers=1, num_microbatches=m, iterations=iterations)
    work = m * sum(s.compute_s for s in stages)
    assert r.iteration_s == pytest.approx(work)
    assert r.bubble_fraction == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_enough_microbatches_leave_small_bubbles(n: int) -> None:
    # Balanced stages (what the planner aims for), S = 2n + 1 of them, M = N + 1.
    stages = [SimStage("F", i, i + 1, 3.0) for i in range(n)]
    stages.append(SimStage("T", n, n + 1, 3.0))
    stages += [SimStage("B", i, i + 1, 3.0) for i in reversed(range(n))]
    r = simulate_roundpipe(stages, num_workers=n, num_microbatches=n + 1, iterations=2 + n)
    assert r.bubble_fraction < 0.05
    work = (n + 1) * sum(s.compute_s for s in stages)
    assert r.iteration_s == pytest.approx(work / n, rel=0.05)
    # With one microbatch the same plan is mostly bubbles.
    one = simulate_roundpipe(stages, num_workers=n, num_microbatches=1, iterations=2 + n)
    assert one.bubble_fraction > 0.3


def test_round_robin_beats_bound_stages_with_a_heavy_head() -> None:
    # 16 equal decoder layers and an LM head as heavy as 6 of them (a 150k vocabulary).
    layer = LayerCost(1.0, 3.0, 0, 0, 0, 0)
    costs = [LayerCost(0.01, 0.03, 0, 0, 0, 0)] + [layer] * 16 + [LayerCost(6.0, 18.0, 0, 0, 0, 0)]
    hw = HardwareSpec(num_workers=4, memory_limit_bytes=1 << 40, reserved_bytes=0)
    m = 5
    rp = plan_stages(costs, hw, m)
    for schedule in ("gpipe", "1f1b"):
        bound = bound_baseline(costs, hw, m, schedule=schedule)
        assert bound.split[-1][1] == len(costs)
        assert rp.predicted_iteration_s < 0.85 * bound.iteration_s, schedule


# ---------------------------------------------------------------------- GPipe / 1F1B


def test_gpipe_and_1f1b_by_hand() -> None:
    stages = [BoundStage(1.0, 2.0), BoundStage(1.0, 2.0)]
    gp = simulate_bound(stages, schedule="gpipe", num_microbatches=4)
    ob = simulate_bound(stages, schedule="1f1b", num_microbatches=4)
    # (M + N - 1) x (f + b) for equal stages: 5 x 3.
    assert gp.iteration_s == pytest.approx(15.0)
    assert ob.iteration_s == pytest.approx(15.0)
    assert gp.bubble_fraction == pytest.approx(1 - 24 / 30)
    assert ob.grid() == "w0: F0 F1 B0 F2 B1 F3 B2 B3\nw1: F0 B0 F1 B1 F2 B2 F3 B3"
    assert gp.grid().splitlines()[0] == "w0: F0 F1 F2 F3 B0 B1 B2 B3"


def test_bound_heavy_last_stage_dominates() -> None:
    light = BoundStage(1.0, 2.0, handoff_s=0.0)
    heavy = BoundStage(4.0, 8.0)
    m = 8
    r = simulate_bound([light, light, light, heavy], schedule="1f1b", num_microbatches=m)
    # The heavy stage alone needs M x 12; everyone else waits on it.
    assert r.iteration_s >= m * 12.0
    assert r.utilisation[3] > 0.9 and r.utilisation[0] < 0.3


def test_bound_iterations_flush_and_add_the_optimizer() -> None:
    stages = [BoundStage(1.0, 2.0)] * 2
    r = simulate_bound(stages, schedule="gpipe", num_microbatches=4, iterations=3, optimizer_s=1.0)
    assert r.iteration_ends == pytest.approx([16.0, 32.0, 48.0])
    assert r.iteration_s == pytest.approx(16.0)


# --------------------------------------------------------------------------- output


def test_grid_and_gantt_render() -> None:
    r = simulate_roundpipe(three_stages(), num_workers=2, num_microbatches=2, iterations=2)
    grid = r.grid()
    assert grid.splitlines()[0].startswith("w0: 1:F0m0 1:F0m1 | 1:B0m0")
    assert r.grid(iteration=2).splitlines()[1].startswith("w1: F0m0")
    chart = r.gantt(width=30)
    assert chart.splitlines()[0].startswith("w0: F")
    assert len(chart.splitlines()) == 3


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="speeds has 1 entries for 2 workers"):
        simulate_roundpipe(three_stages(), num_workers=2, num_microbatches=1, speeds=[1.0])
    with pytest.raises(ValueError, match="staleness"):
        simulate_roundpipe(three_stages(), num_workers=2, num_microbatches=1, staleness=2)
    with pytest.raises(ValueError, match="num_microbatches"):
        simulate_roundpipe(three_stages(), num_workers=2, num_microbatches=0)
    with pytest.raises(ValueError, match="schedule"):
        simulate_bound([BoundStage(1, 1)], schedule="zb", num_microbatches=1)  # type: ignore[arg-type]
