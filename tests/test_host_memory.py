"""Host memory per parameter: the bounded gradient buffer (Note [gradient buffer] in
roundpipe.coordinator.training.layout) changes no bit of training, and the figures admission and
``roundpipe plan`` give follow the layout."""

from __future__ import annotations

from dataclasses import replace
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

from roundpipe.coordinator.spec.jobspec import JobSpec, model_config_from_spec
from roundpipe.coordinator.training.checkpoint import CheckpointDir
from roundpipe.coordinator.training.layout import JobLayout
from roundpipe.coordinator.training.memory import host_memory_needed, least_host_memory
from roundpipe.shared.model import LayeredModel
from roundpipe.shared.plan import Plan

# One-layer backward stages: with a buffer of one stage (the 2-layer tail is the widest)
# the 4 decoder layers share 2 gradient slots, so every backward task waits for a slot.
NARROW = "F[0:2,2:4] T[4:6] B[3:4,2:3,1:2,0:1]"


def _train(spec, arena_dir: Path, num_workers: int = 3):
    with trained_in_process(
        spec, arena_dir, num_workers, job_id="job-mem", namespace="hostmem"
    ) as trainer:
        layout = trainer.layout
        weights = {n: t for layer in trainer.final_weights().values() for n, t in layer.items()}
        return weights, dict(layout.sizes), dict(layout.grad_slot)


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_shared_gradient_buffer_changes_no_bit(tmp_path, arena_dir, staleness) -> None:
    def spec(stages: int, where: str):
        return tiny_spec(
            tmp_path / where,
            staleness=staleness,
            steps=4,
            plan=NARROW,
            train={"grad_buffer_stages": stages},
        )

    shared, sizes, slots = _train(spec(1, "shared"), arena_dir)
    full, full_sizes, full_slots = _train(spec(0, "full"), arena_dir)
    # Decoder layers 1..4 take slots 0, 1, 0, 1 of one class; embedding and head their own.
    decoder_class = slots[1][0]
    assert [slots[layer] for layer in (1, 2, 3, 4)] == [(decoder_class, s) for s in (0, 1, 0, 1)]
    assert len(set(full_slots.values())) == len(full_slots)  # 0: one slot per layer
    per_layer = (full_sizes["grads"] - sizes["grads"]) // 2  # two decoder slots saved
    assert per_layer > 0 and sizes["grads"] < full_sizes["grads"]
    assert shared.keys() == full.keys()
    for name in full:
        assert torch.equal(shared[name], full[name]), name
    assert_params_match(shared, oracle_train(spec(1, "oracle")))


def _layout(model: LayeredModel, plan: str, buffer: int | None = None) -> JobLayout:
    return JobLayout.plan_layout(
        model,
        Plan.parse(plan),
        compute_dtype=torch.float32,
        microbatch_rows=1,
        seq_len=8,
        num_microbatches=2,
        grad_buffer_layers=buffer,
    )


def test_a_stage_that_would_write_one_slot_twice_does_not_fit(tmp_path) -> None:
    spec = tiny_spec(tmp_path, plan=NARROW)
    model = LayeredModel(model_config_from_spec(spec.model), None)

    def layout(plan: str, buffer: int | None) -> JobLayout:
        return _layout(model, plan, buffer)

    narrow = layout(NARROW, 2)
    wide = Plan.parse("F[0:4] T[4:6] B[1:4,0:1]")  # layers 1 and 3 share a slot
    assert not narrow.fits(wide)
    with pytest.raises(ValueError, match="distinct gradient slots"):
        narrow.assign(wide)
    with pytest.raises(ValueError, match="gradient buffer of 2 layers"):
        layout("F[0:4] T[4:6] B[1:4,0:1]", 2)
    assert narrow.grad_sharers(1) == [3] and narrow.grad_sharers(0) == []
    # The figures follow the layout: the gradient buffer is the grads arena.
    need = host_memory_needed(narrow, spec)
    assert need.grads == narrow.sizes["grads"] < host_memory_needed(layout(NARROW, None)).grads
    assert need.arenas == narrow.total_bytes
    assert need.masters == 4 * model.parameter_count(trainable_only=True)
    assert need.moments == 8 * model.parameter_count(trainable_only=True)
    # Admission's floor is below any real plan's figure.
    least = least_host_memory(model, spec)
    assert least.total <= need.total and least.grads <= need.grads


def test_grad_clip_keeps_one_gradient_slot_per_layer(tmp_path) -> None:
    from roundpipe.coordinator.training.memory import grad_buffer_layers

    plan = Plan.parse(NARROW)
    assert grad_buffer_layers(tiny_spec(tmp_path, plan=NARROW), plan) == 4  # 2 x widest stage
    assert grad_buffer_layers(tiny_spec(tmp_path, plan=NARROW, grad_clip=1.0), plan) is None
    off = tiny_spec(tmp_path, plan=NARROW, train={"grad_buffer_stages": 0})
    assert grad_buffer_layers(off, plan) is None


def test_one_weight_copy_at_staleness_0_changes_no_bit(tmp_path, arena_dir, monkeypatch) -> None:
    """Note [weight copies]: staleness 0 keeps one compute-dtype copy per trainable
    weight; the result equals the two-copy layout's bit for bit (bf16 compute, so the
    copies are real casts)."""
    import roundpipe.coordinator.training.checkpointer as checkpointer_module
    import roundpipe.coordinator.training.job_planner as job_planner_module

    def spec(where: str):
        return tiny_spec(tmp_path / where, staleness=0, steps=4, plan=NARROW, dtype="bfloat16")

    one, one_sizes, _ = _train(spec("one"), arena_dir)
    # The layout the planner sizes, and the manifest that says which version prev holds.
    monkeypatch.setattr(job_planner_module, "weight_copies", lambda _spec: 2)
    monkeypatch.setattr(checkpointer_module, "weight_copies", lambda _spec: 2)
    two, two_sizes, _ = _train(spec("two"), arena_dir)
    model = LayeredModel(model_config_from_spec(spec("x").model), None)
    trainable = sum(
        s.numel
        for layer in range(model.num_layers)
        for s in model.layer_params(layer)
        if s.trainable and s.tied_to is None
    )
    assert two_sizes["params"] - one_sizes["params"] >= 2 * trainable  # one bf16 copy less
    assert one.keys() == two.keys()
    for name in two:
        assert torch.equal(one[name], two[name]), name


def test_checkpoints_say_which_weight_version_prev_holds(tmp_path, arena_dir) -> None:
    import json

    for staleness, expected in ((0, 2), (1, 1)):
        spec = tiny_spec(tmp_path / f"s{staleness}", staleness=staleness, steps=2)
        with trained_in_process(spec, arena_dir, 2, job_id="job-ck", namespace="hostmem"):
            pass
        manifests = sorted((tmp_path / f"s{staleness}" / "checkpoints").glob("*/checkpoint.json"))
        manifest = json.loads(manifests[-1].read_text())
        assert manifest["prev_version"] == expected, staleness


# --------------------------------------------------------------------------- 8-bit states


def _optimizers(state_dtype: str, seed: int = 0):
    from roundpipe.coordinator.training.optimizer import LayerwiseOptimizer, LRSchedule

    gen = torch.Generator().manual_seed(seed)
    # Sizes off the block and chunk grid, so partial blocks are exercised.
    masters = {
        0: {"w": torch.randn(300, 7, generator=gen)},
        1: {"a": torch.randn(1000, generator=gen), "b": torch.randn(1 << 20 | 5, generator=gen)},
    }
    return masters, LayerwiseOptimizer(
        masters, schedule=LRSchedule(lr=1e-3), state_dtype=state_dtype
    )


def _grads(step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    return {
        0: {"w": torch.randn(300, 7, generator=gen)},
        1: {"a": torch.randn(1000, generator=gen), "b": torch.randn(1 << 20 | 5, generator=gen)},
    }


def test_int8_states_follow_fp32_adamw_and_resume_bit_for_bit() -> None:
    masters8, opt8 = _optimizers("int8")
    masters32, opt32 = _optimizers("float32")
    start = {layer: {n: t.clone() for n, t in d.items()} for layer, d in masters8.items()}
    for step in range(1, 6):
        opt8.step_layers(_grads(step), step)
        opt32.step_layers(_grads(step), step)
    for layer in masters8:
        for name in masters8[layer]:
            moved8 = masters8[layer][name] - start[layer][name]
            moved32 = masters32[layer][name] - start[layer][name]
            # The update direction and size follow fp32 AdamW to the moments' rounding.
            err = (moved8 - moved32).norm() / moved32.norm()
            assert err < 0.05, (layer, name, float(err))
    state = opt8.state_dict()
    assert {k.rsplit(".", 1)[1] for k in state["tensors"]} == {
        "exp_avg",
        "exp_avg_absmax",
        "exp_avg_sqrt",
        "exp_avg_sqrt_absmax",
    }
    assert state["tensors"]["1.b.exp_avg"].dtype == torch.uint8
    # A fresh optimizer loaded from the state continues exactly as the original does.
    saved = {k: t.clone() for k, t in state["tensors"].items()}
    resumed_masters, resumed = _optimizers("int8")
    for layer in masters8:
        for name in masters8[layer]:
            resumed_masters[layer][name].copy_(masters8[layer][name])
    resumed.load_state_dict({**state, "tensors": saved})
    opt8.step_layers(_grads(6), 6)
    resumed.step_layers(_grads(6), 6)
    for layer in masters8:
        for name in masters8[layer]:
            assert torch.equal(masters8[layer][name], resumed_masters[layer][name])


def test_int8_state_dtype_is_checked(tmp_path) -> None:
    from roundpipe.coordinator.spec.errors import JobSpecError

    with pytest.raises(JobSpecError, match="optimizer.state_dtype"):
        tiny_spec(tmp_path, optimizer={"state_dtype": "int4"})
    with pytest.raises(JobSpecError, match="optimizer.state_dtype"):
        tiny_spec(tmp_path, optimizer={"name": "sgd", "state_dtype": "int8"})
    spec = tiny_spec(tmp_path, optimizer={"state_dtype": "int8"})
    model = LayeredModel(model_config_from_spec(spec.model), None)
    layout = _layout(model, NARROW)
    trainable = model.parameter_count(trainable_only=True)
    moments = host_memory_needed(layout, spec).moments
    assert 2 * trainable < moments < 2.1 * trainable  # codes + a scale per 256


def test_int8_job_trains_close_to_fp32_states_and_resumes_exactly(tmp_path, arena_dir) -> None:
    """A job with 8-bit states through the trainer: its losses stay close to fp32
    states', and a new job resumed from its step-2 checkpoint ends bit for bit where the
    uninterrupted one does (the codes and scales are the whole state)."""

    def run(where: str, state_dtype: str, resume_from: Path | None = None):
        doc = tiny_spec(
            tmp_path / where, staleness=1, steps=5, optimizer={"state_dtype": state_dtype}
        ).to_dict()
        doc["output"].update(checkpoint_every=2, keep_last=5)
        if resume_from is not None:
            doc["model"]["resume_from"] = str(resume_from)
        spec = JobSpec.from_dict(doc)
        with trained_in_process(spec, arena_dir, 2, job_id=where, namespace="hostmem8") as t:
            weights = {n: w for d in t.final_weights().values() for n, w in d.items()}
            return weights, [e.loss for e in t.progress]

    fp32 = run("fp32", "float32")
    int8 = run("int8", "int8")
    for a, b in zip(int8[1], fp32[1]):
        assert abs(a - b) <= 0.01 * abs(b), (int8[1], fp32[1])
    saved = CheckpointDir(tmp_path / "int8" / "checkpoints").complete("int8")
    step2 = next(info for info in saved if info.step == 2)
    resumed = run("resumed", "int8", resume_from=step2.path)
    assert resumed[1][2:] == int8[1][2:]
    for name in int8[0]:
        assert torch.equal(resumed[0][name], int8[0][name]), name


def test_sharded_optimizer_state_counts_each_ranks_pieces(tmp_path) -> None:
    """With ``train.optimizer_sharding: sharded`` over W nodes a node's figure holds its
    pieces of the fp32 masters and moments (Note [shard boundaries]): together the ranks
    hold each element once; rank 0 also counts what it gathers while it writes a
    checkpoint (Note [streamed checkpoint state]). Replicated and one-node figures are
    unchanged."""
    from roundpipe.coordinator.training.memory import sharded_elements
    from roundpipe.coordinator.training.sharded_optimizer import span

    spec = tiny_spec(tmp_path, plan=NARROW, train={"optimizer_sharding": "sharded"})
    replicated = tiny_spec(tmp_path, plan=NARROW, train={"optimizer_sharding": "replicated"})
    model = LayeredModel(model_config_from_spec(spec.model))
    layout = _layout(model, NARROW)
    trainable = model.parameter_count(trainable_only=True)
    tensors = sum(
        1
        for layer in range(model.num_layers)
        for p in model.layer_params(layer)
        if p.trainable and p.tied_to is None
    )
    whole = host_memory_needed(layout, spec)  # one node: its shard is the whole state
    assert (whole.masters, whole.moments, whole.gathered) == (4 * trainable, 8 * trainable, 0)
    # Replicated over 3 nodes: the whole state, and the largest bucket's gradient packed
    # for its all-reduce (Note [one layout for both reductions]): by default the tiny
    # model is one bucket (Note [gradient buckets]); with grad_bucket_mb 0 each layer.
    packed = [
        3 * sum(span(p.numel, 3) for p in model.layer_params(layer) if p.trainable)
        for layer in range(model.num_layers)
    ]
    in_group = host_memory_needed(layout, replicated, nodes=3, rank=1)
    assert in_group == replace(whole, collectives=4 * sum(packed))
    assert "collective buffers" in in_group.describe()
    per_layer = tiny_spec(
        tmp_path,
        plan=NARROW,
        train={"optimizer_sharding": "replicated", "grad_bucket_mb": 0},
    )
    in_group = host_memory_needed(layout, per_layer, nodes=3, rank=1)
    assert in_group == replace(whole, collectives=4 * max(packed))
    for nodes in (2, 3):
        per_rank = [host_memory_needed(layout, spec, nodes=nodes, rank=r) for r in range(nodes)]
        assert sum(sharded_elements(model, nodes, r) for r in range(nodes)) == trainable
        assert sum(m.masters for m in per_rank) == 4 * trainable
        assert sum(m.moments for m in per_rank) == 8 * trainable
        # Rank 0, writing a checkpoint: the whole masters, and the largest layer's
        # states twice (Note [streamed checkpoint state]), never the whole states.
        largest = max(
            sum(p.numel for p in model.layer_params(layer) if p.trainable and p.tied_to is None)
            for layer in range(model.num_layers)
        )
        assert per_rank[0].gathered == 4 * trainable + 2 * 8 * largest < 12 * trainable
        assert all(m.gathered == 0 for m in per_rank[1:])
        # The others, starting: the layer rank 0 sends them (Note [sharded start-up])
        assert per_rank[0].start_up == 0
        assert all(m.start_up == (4 + 8) * largest for m in per_rank[1:])
        assert "a layer of rank 0's state at start-up" in per_rank[1].describe()
        for m in per_rank:
            assert m.arenas == whole.arenas
            # 1/W, but for each tensor's piece rounded up to 256 elements
            assert m.masters <= 4 * (-(-trainable // nodes) + 256 * tensors)
        # (the collectives' scratch aside: the tiny model is one bucket, larger than
        # what sharding saves on it; Note [gradient buckets] caps it on real models)
        assert per_rank[1].total - per_rank[1].collectives < whole.total
        assert "state gathered for checkpoints" in per_rank[0].describe()


def test_a_sharded_node_other_than_rank_0_keeps_only_its_pieces_as_it_loads(
    tmp_path, arena_dir
) -> None:
    """Note [sharded start-up]: rank 1 of 2 holds its pieces of the fp32 masters (about
    half) and the whole ones' shapes only, never the whole masters; rank 0 (and a node
    alone) the whole masters, which are its masters too."""
    from roundpipe.coordinator.training.initial_weights import place_initial_weights
    from roundpipe.coordinator.training.sharded_optimizer import ZeroShards

    spec = tiny_spec(tmp_path, plan=NARROW)
    model = LayeredModel(model_config_from_spec(spec.model))
    layout = _layout(model, NARROW)
    layout.create(arena_dir, "pieces")
    try:
        masters, whole = place_initial_weights(model, layout, spec)
        assert masters is whole and all(
            not t.is_meta for per in whole.values() for t in per.values()
        )
        shards = ZeroShards(None, 1, 2, "float32")
        pieces, shapes = place_initial_weights(model, layout, spec, pieces_of=shards)
        assert all(t.is_meta for per in shapes.values() for t in per.values())
        for layer, per in masters.items():
            for name, t in per.items():
                assert shapes[layer][name].shape == t.shape
                assert torch.equal(pieces[layer][name], shards.own(t)), name
        held = sum(t.numel() for per in pieces.values() for t in per.values())
        total = sum(t.numel() for per in masters.values() for t in per.values())
        assert held < 0.6 * total
    finally:
        layout.destroy()


def test_sharded_background_checkpoints_stage_each_ranks_pieces(tmp_path) -> None:
    """Note [sharded background checkpoint]: a node stages its pieces of the masters and
    states, and rank 0 alone the whole previous weights; together the ranks stage one
    replicated node's checkpoint."""
    from roundpipe.coordinator.training.memory import checkpoint_staging_needed, sharded_elements

    d = tiny_spec(tmp_path, plan=NARROW, steps=4, train={"optimizer_sharding": "sharded"}).to_dict()
    d["output"]["checkpoint_every"] = 2
    spec = JobSpec.from_dict(d)
    model = LayeredModel(model_config_from_spec(spec.model))
    layout = _layout(model, NARROW)
    trainable = model.parameter_count(trainable_only=True)
    prev = layout.compute_dtype.itemsize * trainable
    whole = checkpoint_staging_needed(layout, spec)  # one node: the whole state
    assert whole == 12 * trainable + prev
    for nodes in (2, 3):
        per = [checkpoint_staging_needed(layout, spec, nodes=nodes, rank=r) for r in range(nodes)]
        assert sum(per) == whole
        assert per[0] == 12 * sharded_elements(model, nodes, 0) + prev
        assert all(p == 12 * sharded_elements(model, nodes, r) for r, p in enumerate(per) if r)


def test_a_tied_weights_gradient_sum_is_counted(tmp_path, arena_dir) -> None:
    """The optimizer thread adds a tied embedding's two gradients in an fp32 tensor of
    its own, as large as the embedding (0.58 GiB for a Qwen3-0.6B shape): it was in no
    figure of host_memory_needed. What the running job holds is what is counted."""
    spec = tiny_spec(tmp_path / "out", steps=2, config={**TINY_QWEN3, "tie_word_embeddings": True})
    with trained_in_process(spec, arena_dir, 2, job_id="job-tied", namespace="tied") as trainer:
        held = sum(
            t.numel() * t.element_size() for t in trainer.optimizer_thread._tied_scratch.values()
        )
        need = host_memory_needed(trainer.layout, trainer.spec)
    embedding = TINY_QWEN3["vocab_size"] * TINY_QWEN3["hidden_size"]
    assert held == 4 * embedding
    assert need.split_sums == held  # no stage is split here


def test_the_data_rows_are_counted(tmp_path, arena_dir) -> None:
    """The coordinator holds the job's rows (ids, labels, positions: 12 bytes a padded
    token) for the whole job, and the admission child builds them too: with
    ``packing: none`` at a long seq_len, gigabytes that no figure counted."""
    spec = tiny_spec(tmp_path / "out", steps=2, packing="none")
    with trained_in_process(spec, arena_dir, 2, job_id="job-rows", namespace="rows") as trainer:
        ds = trainer.dataset
        held = sum(
            t.numel() * t.element_size() for t in (ds.tokens, ds.labels, ds.positions, ds.lengths)
        )
        need = trainer.planner.host_memory(trainer.layout)
    assert held == ds.nbytes > 12 * ds.num_rows * spec.data.seq_len - 1
    assert need.dataset == held
    assert need.total == need.arenas + need.masters + need.moments + need.split_sums + held


def test_the_check_leaves_out_the_data_rows_already_held(monkeypatch) -> None:
    """Every check runs after the data rows were built: the memory available then is
    already without them, and counting them again refused jobs that fit (gigabytes
    with packing none at a long seq_len)."""
    from roundpipe.coordinator.training import memory
    from roundpipe.coordinator.training.memory import HostMemory, InsufficientMemory

    need = HostMemory(weights=100, grads=50, activations=10, masters=40, moments=80, dataset=900)
    for available, fits in ((need.total - 900, True), (need.total - 901, False)):
        monkeypatch.setattr(
            memory.psutil, "virtual_memory", lambda a=available: type("VM", (), {"available": a})()
        )
        if fits:
            memory.check_host_memory(need, None)
        else:
            with pytest.raises(InsufficientMemory, match="data rows"):
                memory.check_host_memory(need, None)
