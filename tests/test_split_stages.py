"""Microbatch-split stages (Note [microbatch-split stages] in roundpipe.shared.plan): the
plan syntax, the tasks, the second gradient buffer, the optimizer's sum, the planner's
choice at staleness 0, and the numbers: bitwise the unsplit plan's where the split point
says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runtime_helpers import (
    TINY_QWEN3,
    assert_params_match,
    oracle_train,
    tiny_spec,
    trained_in_process,
)

from roundpipe.coordinator.planning.costs import estimate_costs
from roundpipe.coordinator.planning.hardware import cpu_hardware
from roundpipe.coordinator.planning.search import evaluate_plan, plan_stages, split_variants
from roundpipe.coordinator.training.layout import JobLayout
from roundpipe.coordinator.training.memory import host_memory_needed
from roundpipe.coordinator.training.trainer import Trainer
from roundpipe.shared.model import LayeredModel
from roundpipe.shared.plan import Plan, Stage

UNSPLIT = "F[0:4] T[4:6] B[0:4]"
DEMO_SHAPE = dict(  # the demo job's shape: the planner splits it at staleness 0
    config=dict(TINY_QWEN3, hidden_size=128, intermediate_size=384),
    microbatch_size=4,
    seq_len=128,
    staleness=0,
)
SPLIT = "F[0:4/1] T[4:6] B[0:4/2]"  # 3 microbatches: the backward's second part is the last


# -- plan data ------------------------------------------------------------------------


def test_split_plans_print_parse_and_compare() -> None:
    plan = Plan.parse("F[0:2/1,2:4] T[4:6] B[2:4,0:2/2]")
    assert str(plan) == "F[0:2/1,2:4] T[4:6] B[2:4,0:2/2]"
    assert plan.forward_split == (1, 0) and plan.backward_split == (0, 2)
    assert plan.stages()[0] == Stage("F", 0, 2, 1) and str(plan.stages()[-1]) == "B[0:2/2]"
    assert plan.num_tasks == 7 and plan.is_split
    assert plan.split_gradient_layers() == {0, 1}
    assert plan.unsplit() == Plan.parse("F[0:2,2:4] T[4:6] B[2:4,0:2]")
    # "No split" has one spelling: a zero split is none.
    assert Plan.parse("F[0:4/0] T[4:6] B[0:4]") == Plan.parse(UNSPLIT)
    assert not Plan.parse(UNSPLIT).is_split and Plan.parse(UNSPLIT).num_tasks == 3
    plan.validate(6)
    plan.validate_microbatches(3)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("F[0:4] T[4:6/1] B[0:4]", "the tail cannot be split"),
        ("F[0:4/x] T[4:6] B[0:4]", "start:stop/split"),
        ("F[0:4/-1] T[4:6] B[0:4]", "start:stop/split"),
    ],
)
def test_bad_splits_do_not_parse(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Plan.parse(text)


@pytest.mark.parametrize("split", [3, 7])
def test_a_split_must_leave_each_task_a_microbatch(split: int) -> None:
    plan = Plan.parse(f"F[0:4] T[4:6] B[0:4/{split}]")
    plan.validate(6)  # the layers are fine
    with pytest.raises(ValueError, match=r"B\[0:4/\d\] splits its microbatches at \d.*1\.\.2"):
        plan.validate_microbatches(3)


def test_split_lengths_are_checked() -> None:
    with pytest.raises(ValueError, match="one entry per forward stage"):
        Plan(forward=((0, 2), (2, 4)), tail=(4, 6), backward=((0, 4),), forward_split=(1,))


# -- tasks and layout -----------------------------------------------------------------


def _trainer(tmp_path: Path, arena_dir: Path, plan: str | None, **kw) -> Trainer:
    spec = tiny_spec(tmp_path, plan=plan, **kw)
    return Trainer(
        "job-split",
        spec,
        arena_dir=arena_dir,
        namespace="splittest",
        output_dir=tmp_path,
        wait_timeout_s=30,
    )


def test_a_split_stage_is_two_tasks_over_its_microbatches(tmp_path, arena_dir) -> None:
    trainer = _trainer(tmp_path, arena_dir, "F[0:4/1] T[4:6] B[2:4,0:2/2]")
    try:
        trainer.prepare(2)
        layout, c = trainer.layout, trainer.layout.counters
        tasks = trainer.schedule.tasks(3, 100, 40)
        assert [t.task_id for t in tasks] == list(range(40, 46))
        shape = [(t.kind, t.layer_start, [mb.index for mb in t.microbatches]) for t in tasks]
        assert shape == [
            ("forward", 0, [0]),
            ("forward", 0, [1, 2]),
            ("tail", 4, [0, 1, 2]),
            ("backward", 2, [0, 1, 2]),
            ("backward", 0, [0, 1]),
            ("backward", 0, [2]),
        ]
        assert [t.grad_part for t in tasks] == [0, 0, 0, 0, 0, 1]
        first, second = tasks[4], tasks[5]
        assert [s.counter for s in first.grad_signals] == [c.wgrad(0), c.wgrad(1)]
        assert [s.counter for s in second.grad_signals] == [c.wgrad_part(0), c.wgrad_part(1)]
        # Each part waits for the optimizer to have consumed its buffer's last gradient.
        assert {(w.counter, w.at_least) for w in second.grad_waits} == {
            (c.version(0), 2),
            (c.version(1), 2),
        }
        # Only the split layers have second slots, each one of its own.
        assert set(layout.grads_part) == {0, 1}
        refs = [
            r
            for slots in (*layout.grads.values(), *layout.grads_part.values())
            for r in slots.values()
        ]
        assert len({r.offset for r in refs}) == len(refs)
        setup = {lay.layer: lay for lay in trainer.job_setup().layers}
        assert [g.name for g in setup[1].grads_part] == [g.name for g in setup[1].grads]
        assert setup[2].grads_part == []
        # The coordinator's sums are counted in the job's host memory.
        need = host_memory_needed(layout, trainer.spec)
        part_bytes = sum(
            4 * r.numel() for slots in layout.grads_part.values() for r in _views(layout, slots)
        )
        assert need.split_sums == part_bytes > 0
        # A re-plan may split only where second slots exist.
        assert layout.fits(Plan.parse("F[0:4] T[4:6] B[2:4,0:2/1]"))
        assert not layout.fits(Plan.parse("F[0:4] T[4:6] B[2:4/2,0:2]"))
        assert not layout.fits(Plan.parse("F[0:4] T[4:6] B[2:4,0:2/3]"))
        with pytest.raises(ValueError, match="second slots exist for layers \\[0, 1\\]"):
            layout.assign(Plan.parse("F[0:4] T[4:6] B[2:4/2,0:2]"))
    finally:
        trainer.close()


def _views(layout: JobLayout, slots) -> list[torch.Tensor]:
    return [layout.view(r) for r in slots.values()]


def test_a_train_plan_that_splits_past_the_microbatches_is_a_bad_spec(tmp_path) -> None:
    from roundpipe.coordinator.spec.errors import JobSpecError

    with pytest.raises(JobSpecError, match=r"train.plan.*splits that fit batch.num_microbatches"):
        tiny_spec(tmp_path, plan="F[0:4] T[4:6] B[0:4/3]")
    with pytest.raises(ValueError, match=r"B\[0:4/3\] splits its microbatches at 3"):
        costs, hw = _costs()
        evaluate_plan(Plan.parse("F[0:4] T[4:6] B[0:4/3]"), costs, hw, 3)


# -- numbers --------------------------------------------------------------------------


def _train(
    tmp_path: Path, arena_dir: Path, name: str, workers: int = 2, **kw
) -> dict[str, torch.Tensor]:
    spec = tiny_spec(tmp_path / name, **kw)
    with trained_in_process(
        spec, arena_dir, workers, job_id="job-split", namespace="splittest"
    ) as t:
        if kw.get("plan"):
            assert str(t.plan) == kw["plan"]
        return {n: x for layer in t.final_weights().values() for n, x in layer.items()}


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [n for n in a if not torch.equal(a[n], b[n])]
    assert not differ, differ


@pytest.mark.parametrize(
    ("staleness", "dtype", "clip"),
    [(0, "float32", None), (0, "bfloat16", 0.5), (1, "float32", None)],
)
def test_split_before_the_last_microbatch_is_bitwise_the_unsplit_plan(
    tmp_path, arena_dir, staleness, dtype, clip
) -> None:
    kw = dict(steps=4, staleness=staleness, dtype=dtype, grad_clip=clip)
    unsplit = _train(tmp_path, arena_dir, "unsplit", plan=UNSPLIT, **kw)
    split = _train(tmp_path, arena_dir, "split", plan=SPLIT, **kw)
    _assert_bitwise(split, unsplit)
    if dtype == "float32":
        assert_params_match(split, oracle_train(tiny_spec(tmp_path, **kw)))


def test_a_split_stage_over_a_tied_embedding_is_bitwise_the_unsplit_plan(
    tmp_path, arena_dir
) -> None:
    """The embedding's gradient is (first part + second part) + the tail's LM-head
    contribution, in the unsplit plan's order."""
    kw = dict(steps=3, staleness=0, config=dict(TINY_QWEN3, tie_word_embeddings=True))
    unsplit = _train(tmp_path, arena_dir, "unsplit", plan=UNSPLIT, **kw)
    split = _train(tmp_path, arena_dir, "split", plan=SPLIT, **kw)
    _assert_bitwise(split, unsplit)


def test_split_tasks_replay_the_unsplit_dropout_masks(tmp_path, arena_dir) -> None:
    """LoRA dropout is drawn per (layer, microbatch): the second task of a split stage
    seeds with the iteration's microbatch index, not its own position. One worker: the
    in-process workers are threads of one process, which share its CPU generator (real
    workers are processes), and the split tasks still run apart."""
    lora = {"r": 4, "alpha": 8, "dropout": 0.3, "target_modules": ["q_proj", "v_proj"]}
    kw = dict(steps=3, staleness=0, lora=lora, workers=1)
    unsplit = _train(tmp_path, arena_dir, "unsplit", plan=UNSPLIT, **kw)
    split = _train(tmp_path, arena_dir, "split", plan="F[0:4/2] T[4:6] B[0:4/2]", **kw)
    _assert_bitwise(split, unsplit)


def test_another_split_point_sums_the_same_gradient_to_float_noise(tmp_path, arena_dir) -> None:
    """(g0) + (g1 + g2) instead of (g0 + g1) + g2: not bitwise, still the oracle's."""
    kw = dict(steps=4, staleness=0)
    split = _train(tmp_path, arena_dir, "split1", plan="F[0:2/2,2:4] T[4:6] B[2:4/1,0:2/1]", **kw)
    assert_params_match(split, oracle_train(tiny_spec(tmp_path, **kw)))


# -- planner --------------------------------------------------------------------------


def _costs(num_workers: int = 2):
    from runtime_helpers import TINY_QWEN3

    from roundpipe.coordinator.spec.jobspec import model_config_from_spec

    spec = tiny_spec(
        Path("unused"), config=dict(TINY_QWEN3, hidden_size=128, intermediate_size=384)
    )
    model = LayeredModel(model_config_from_spec(spec.model))
    hw = cpu_hardware(num_workers)
    costs = estimate_costs(
        model, microbatch_rows=4, seq_len=128, compute_dtype="float32", flops_per_s=hw.flops_per_s
    )
    return costs, hw


def test_the_planner_splits_stages_only_at_staleness_zero() -> None:
    costs, hw = _costs()
    sync = plan_stages(costs, hw, 3, staleness=0)
    unsplit_best = plan_stages(costs, hw, 3, staleness=0, fits=lambda p: not p.is_split)
    assert sync.plan.is_split, sync.plan
    assert sync.predicted_iteration_s < 0.98 * unsplit_best.predicted_iteration_s
    assert any("split by microbatch" in n for n in sync.notes)
    # Its backward splits keep the gradient sum bitwise: the second part is the last mb.
    assert all(j in (0, 2) for j in sync.plan.backward_split)
    assert not plan_stages(costs, hw, 3, staleness=1).plan.is_split
    # One worker: nothing to share the fill and drain with.
    costs1, hw1 = _costs(1)
    assert not plan_stages(costs1, hw1, 3, staleness=0).plan.is_split


def test_split_variants_cover_the_fill_and_the_drain() -> None:
    base = Plan.parse("F[0:2,2:4] T[4:6] B[3:4,2:3,0:2]")
    variants = {str(p) for p in split_variants(base, 3)}
    assert "F[0:2/1,2:4] T[4:6] B[3:4,2:3,0:2]" in variants  # the fill
    assert "F[0:2,2:4] T[4:6] B[3:4,2:3,0:2/2]" in variants  # the drain
    assert "F[0:2,2:4] T[4:6] B[3:4,2:3/2,0:2/2]" in variants  # the last two
    assert "F[0:2/2,2:4] T[4:6] B[3:4,0:3/2]" in variants  # the last two merged
    assert "F[0:2/1,2:4] T[4:6] B[0:4/2]" in variants  # all merged
    assert all(p.is_split for p in split_variants(base, 3))
    assert all(j in (0, 2) for p in split_variants(base, 3) for j in p.backward_split)
    assert split_variants(base, 1) == []


def test_a_host_without_room_for_split_stages_gets_the_unsplit_plan(
    tmp_path, arena_dir, monkeypatch
) -> None:
    """The planner's split plan needs a second gradient buffer and the sums; when the
    host cannot hold them, the job starts on the best unsplit plan instead of failing."""
    import roundpipe.coordinator.training.job_planner as job_planner_module
    from roundpipe.coordinator.training.job_errors import JobFailed
    from roundpipe.coordinator.training.memory import InsufficientMemory

    real = job_planner_module.check_host_memory

    def no_room_for_splits(need, directory):
        if need.split_sums:
            raise InsufficientMemory(f"test: no room for {need.split_sums} bytes of sums")
        return real(need, directory)

    monkeypatch.setattr(job_planner_module, "check_host_memory", no_room_for_splits)
    trainer = _trainer(tmp_path, arena_dir, None, **DEMO_SHAPE)
    try:
        trainer.prepare(2)
        assert not trainer.plan.is_split and not trainer.layout.grads_part
    finally:
        trainer.close()
    # Without the limit the same job is split (so the test above can fail).
    monkeypatch.setattr(job_planner_module, "check_host_memory", real)
    trainer = _trainer(tmp_path, arena_dir, None, **DEMO_SHAPE)
    try:
        trainer.prepare(2)
        assert trainer.plan.is_split and trainer.layout.grads_part
    finally:
        trainer.close()
    # A split train.plan is the user's: no fallback, the job fails with the figures.
    monkeypatch.setattr(job_planner_module, "check_host_memory", no_room_for_splits)
    trainer = _trainer(tmp_path, arena_dir, SPLIT, staleness=0)
    try:
        with pytest.raises(JobFailed, match="no room for"):
            trainer.prepare(2)
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_worker_killed_in_a_split_task_changes_no_result(tmp_path) -> None:
    """Real daemons: the worker running the second part of the split backward stage (its
    microbatch 2) is killed at that microbatch; the task goes to the other worker, which
    writes the second gradient slots, and the job ends equal to its oracle, and equal to
    the same job without the kill."""
    from runtime_helpers import load_output

    from roundpipe.cluster import cpu_cluster

    kill = "kill@iteration=2,kind=backward,layer=0,mb=2"
    results = {}
    for name, fault in (("killed", kill), ("clean", None)):
        spec = tiny_spec(tmp_path / name, steps=4, staleness=0, plan=SPLIT)
        with cpu_cluster(tmp_path / f"c-{name}", f"split-{name}") as cluster:
            cluster.add_worker("w1", fault=fault)
            cluster.add_worker("w2", fault=fault)
            cluster.wait_for_workers(2)
            status = cluster.client.submit(spec).wait(timeout_s=300)
            assert status.state == "succeeded", f"{status.message}\n{cluster.logs()}"
            alive = [w for w in cluster.client.workers()]
            if fault:
                assert len(alive) == 1, cluster.logs()  # the fault fired: one worker died
        results[name] = load_output(Path(spec.output.dir))
    _assert_bitwise(results["killed"], results["clean"])
    assert_params_match(results["killed"], oracle_train(spec))
