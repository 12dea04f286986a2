"""Sharded optimizer state across coordinators (``train.optimizer_sharding: sharded``,
roundpipe.coordinator.training.sharded_optimizer, docs/multi-node.md).

Two coordinators on loopback train each job twice, replicated and sharded: the exported
models and the checkpoints must be bitwise equal (staleness 0 with a microbatch-split
stage, staleness 1, LoRA). A sharded job's checkpoint holds the whole state (rank 0
gathers the shards), so it resumes exactly on 2 nodes, sharded or not, and on 1.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from runtime_helpers import assert_params_match, load_output, tiny_spec
from safetensors.torch import load_file

from roundpipe.cluster import local_group
from roundpipe.coordinator.spec.errors import JobSpecError
from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.training.checkpoint import PROGRESS_FILE

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def variant(spec: JobSpec, out: Path, staging: str | int = "auto", **train) -> JobSpec:
    """``spec`` writing to ``out`` with a checkpoint every 2 steps, in the background
    where the machine has memory to spare (``staging`` 0: drained)."""
    d = spec.to_dict()
    d["train"].update(train)
    d["output"] = {"dir": str(out), "checkpoint_every": 2, "checkpoint_staging": staging}
    return JobSpec.from_dict(d)


def resumed(spec: JobSpec, checkpoint: Path, out: Path, **train) -> JobSpec:
    d = variant(spec, out, **train).to_dict()
    d["model"]["resume_from"] = str(checkpoint)
    return JobSpec.from_dict(d)


def checkpoint_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model files and training state) but the RNG's and
    the progress history's (its times and tokens/s are the run's own)."""
    out = {}
    for f in sorted(step_dir.rglob("*.safetensors")):
        if f.relative_to(step_dir).as_posix() == PROGRESS_FILE:
            continue
        for key, t in load_file(str(f)).items():
            if not key.startswith("rng/"):
                out[f"{f.relative_to(step_dir)}:{key}"] = t
    return out


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    differ = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not differ, f"{what}: {len(differ)} tensors differ, e.g. {differ[:3]}"


def test_sharding_is_validated() -> None:
    with pytest.raises(JobSpecError, match="train.optimizer_sharding: got 'zero1'"):
        tiny_spec(Path("/tmp/unused"), train={"optimizer_sharding": "zero1"})
    # Clipping is combined with sharding (Note [clipping a sharded gradient]).
    tiny_spec(Path("/tmp/unused"), train={"optimizer_sharding": "sharded"}, grad_clip=1.0)
    with pytest.raises(JobSpecError, match="train.grad_transport: got 'fp8'"):
        tiny_spec(Path("/tmp/unused"), train={"grad_transport": "fp8"})
    # The default, auto, shards wherever sharding is implemented; int8 states stay
    # replicated under auto, and are refused when sharding is asked for.
    from roundpipe.coordinator.spec.choices import optimizer_state_sharded
    from roundpipe.coordinator.training.multinode import _sharded

    default = tiny_spec(Path("/tmp/unused"))
    assert default.train.optimizer_sharding == "auto" and _sharded(default.to_dict())
    int8 = tiny_spec(Path("/tmp/unused"), optimizer={"state_dtype": "int8"})
    assert not _sharded(int8.to_dict())
    assert not optimizer_state_sharded("replicated", "float32")
    assert optimizer_state_sharded("sharded", "float32")
    with pytest.raises(JobSpecError, match="'sharded' is not implemented for optimizer.state"):
        tiny_spec(
            Path("/tmp/unused"),
            train={"optimizer_sharding": "sharded"},
            optimizer={"state_dtype": "int8"},
        )


@pytest.mark.slow
def test_sharded_state_trains_bitwise_the_replicated_model(tmp_path: Path) -> None:
    base = {
        "exact": tiny_spec(
            tmp_path / "x", steps=4, num_microbatches=4, plan="F[0:2/1,2:4] T[4:6] B[2:4,0:2/1]"
        ),
        "stale": tiny_spec(tmp_path / "x", steps=4, staleness=1, num_microbatches=4),
        "lora": tiny_spec(tmp_path / "x", steps=4, num_microbatches=4, lora=LORA),
        # float16 loss scaling skips steps 1 and 2 (the group's norm overflows on every
        # node alike): a skipped step gathers no weights, which hung the sharded job at
        # its next all-gather.
        "fp16": tiny_spec(
            tmp_path / "x",
            steps=4,
            staleness=1,
            num_microbatches=4,
            dtype="float16",
            train={"loss_scale_initial": 2**20, "loss_scale_growth_interval": 1},
        ),
        # Plain SGD keeps no optimizer state: its training-state file holds none (before,
        # the sharded checkpoint gathered the masters a second time and stored them there).
        "sgd": tiny_spec(
            tmp_path / "x", steps=4, num_microbatches=4, optimizer={"name": "sgd", "momentum": 0}
        ),
    }
    specs = {}
    for name, spec in base.items():
        for mode in ("replicated", "sharded"):
            specs[f"{name}-{mode}"] = variant(
                spec, tmp_path / f"{name}-{mode}", optimizer_sharding=mode
            )
    # Checkpoints drained at the cut instead of written in the background (Note [sharded
    # background checkpoint]): the same files.
    specs["stale-sharded-drained"] = variant(
        base["stale"], tmp_path / "stale-sharded-drained", staging=0, optimizer_sharding="sharded"
    )
    # Gradients cross the network in bf16: half the bytes, close to fp32's results.
    specs["stale-bf16"] = variant(
        base["stale"],
        tmp_path / "stale-bf16",
        optimizer_sharding="sharded",
        grad_transport="bfloat16",
    )
    # Global-norm clipping tight enough to scale every step: the norm is summed from
    # the nodes' pieces, so equal to the replicated job's up to rounding, not bitwise.
    for mode in ("replicated", "sharded"):
        specs[f"clip-{mode}"] = variant(
            tiny_spec(tmp_path / "x", steps=4, staleness=1, num_microbatches=4, grad_clip=0.05),
            tmp_path / f"clip-{mode}",
            optimizer_sharding=mode,
        )
    stale_ckpt = tmp_path / "stale-sharded" / "checkpoints" / "step-00000002"
    # (a longer client timeout: coordinators start slowly on a busy machine)
    with local_group(tmp_path, "mn-shard", client_timeout_s=120) as (rank0, rank1):
        handles = {name: rank0.client.submit(spec) for name, spec in specs.items()}
        for name, handle in handles.items():
            status = handle.wait(timeout_s=300)
            assert status.state == "succeeded", f"{name}: {status.message}\n{rank0.logs()}"
        # A sharded checkpoint resumes on 2 nodes, sharded or replicated.
        again = {
            mode: rank0.client.submit(
                resumed(
                    base["stale"], stale_ckpt, tmp_path / f"again-{mode}", optimizer_sharding=mode
                )
            )
            for mode in ("replicated", "sharded")
        }
        for mode, handle in again.items():
            status = handle.wait(timeout_s=300)
            assert status.state == "succeeded", f"{mode}: {status.message}\n{rank0.logs()}"
        log_text = (tmp_path / "node1" / "coordinator.log").read_text()
        rank0_text = (tmp_path / "node0" / "coordinator.log").read_text()
    scattered = [int(n) for n in re.findall(r"reduce-scatter: (\d+) bytes", log_text)]
    assert any(2 * b in scattered for b in scattered), scattered  # bf16: half of fp32's
    bf16, fp32 = load_output(tmp_path / "stale-bf16"), load_output(tmp_path / "stale-sharded")
    assert any(not torch.equal(bf16[n], fp32[n]) for n in fp32)
    assert_params_match(bf16, fp32, rtol=1e-3)
    for step in ("step-00000002", "step-00000004"):
        assert_bitwise(
            checkpoint_tensors(tmp_path / "stale-sharded-drained" / "checkpoints" / step),
            checkpoint_tensors(tmp_path / "stale-replicated" / "checkpoints" / step),
            f"drained {step}",
        )
    # Every node staged and sent its pieces in the background, or none did.
    for name, background in (("stale-sharded", True), ("stale-sharded-drained", False)):
        written = re.findall(
            rf"checkpoint step \d+ written to \S*/{name}/checkpoints/\S+ in \S+s( \(in the background\))?",
            rank0_text,
        )
        assert len(written) == 2 and all(bool(w) == background for w in written), (name, written)
    for name in base:
        lora = name == "lora"
        replicated = Path(specs[f"{name}-replicated"].output.dir)
        sharded = Path(specs[f"{name}-sharded"].output.dir)
        assert_bitwise(load_output(sharded, lora), load_output(replicated, lora), name)
        for step in ("step-00000002", "step-00000004"):
            assert_bitwise(
                checkpoint_tensors(sharded / "checkpoints" / step),
                checkpoint_tensors(replicated / "checkpoints" / step),
                f"{name} {step}",
            )
    clipped = {mode: load_output(tmp_path / f"clip-{mode}") for mode in ("replicated", "sharded")}
    assert_params_match(clipped["sharded"], clipped["replicated"], rtol=1e-6)
    unclipped = load_output(tmp_path / "stale-replicated")
    assert any(not torch.allclose(clipped["replicated"][n], unclipped[n]) for n in unclipped)
    uninterrupted = load_output(tmp_path / "stale-replicated")
    for mode in ("replicated", "sharded"):
        assert_bitwise(load_output(tmp_path / f"again-{mode}"), uninterrupted, f"resumed {mode}")
    # The sharded jobs ran sharded: node 1 held a part of the state, and reduce-scattered.
    assert "optimizer state sharded over 2 nodes: rank 1 holds" in log_text
    assert "reduce-scatter:" in log_text
    # Each node's memory check counted what it holds (Note [sharded checkpoint]): rank 1
    # its pieces, rank 0 its pieces and the whole state it gathers for checkpoints.
    assert "(rank 1 of 2) needs" in log_text and "(rank 0 of 2) needs" in rank0_text
    assert "state gathered for checkpoints" in rank0_text
    assert "state gathered for checkpoints" not in log_text
    assert rank0_text.count("gradients overflowed at loss scale") >= 2 * 2  # both fp16 jobs
    # ... and on one node (in process): as the replicated job's checkpoint does.
    from runtime_helpers import trained_in_process

    arena_dir = Path("/dev/shm") / f"rp-mn-shard-1-{os.getpid()}"
    arena_dir.mkdir()
    try:
        one = {}
        for mode in ("replicated", "sharded"):
            ckpt = tmp_path / f"stale-{mode}" / "checkpoints" / "step-00000002"
            spec = resumed(base["stale"], ckpt, tmp_path / f"one-{mode}", optimizer_sharding=mode)
            with trained_in_process(spec, arena_dir, 1, job_id=f"one-{mode}") as trainer:
                assert trainer.start_step == 2
                one[mode] = {
                    n: t.clone() for per in trainer.final_weights().values() for n, t in per.items()
                }
    finally:
        shutil.rmtree(arena_dir, ignore_errors=True)
    assert_bitwise(one["sharded"], one["replicated"], "resumed on one node")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("gather", "staging"),
    [("checkpoint/4", 0), ("checkpoint/4/states", 0), ("checkpoint/4/states", "1GiB")],
    ids=["masters", "streamed-states", "in-the-background"],
)
def test_a_node_lost_in_the_checkpoint_gather_leaves_the_previous_one(
    tmp_path: Path, gather: str, staging: int | str
) -> None:
    """Node 1 dies in the middle of sending its shards of checkpoint step 4, of the
    masters or of the optimizer states (rank 0 has then written the model files and the
    start of the state file: Note [streamed checkpoint state]), at a drained cut or from
    the writer threads of background checkpoints: rank 0 pauses the job naming node 1,
    keeps nothing of step 4 (step 2 stays the latest, no temporary directory is left),
    and `resume` continues from step 2 on rank 0 alone to the end (the oracle's model)."""
    from runtime_helpers import assert_params_match, oracle_train

    spec = variant(
        tiny_spec(tmp_path / "x", steps=4, num_microbatches=4),
        tmp_path / "out",
        staging=staging,
        optimizer_sharding="sharded",
    )
    checkpoints = tmp_path / "out" / "checkpoints"
    with local_group(
        tmp_path,
        "mn-shard-fault",
        timeout_s=5,
        check_exit=False,
        env={1: {"ROUNDPIPE_GATHER_FAULT": f"kill@{gather}"}},
        client_timeout_s=120,
    ) as (rank0, rank1):
        handle = rank0.client.submit(spec)
        status = handle.wait(timeout_s=120)
        assert status.state == "paused", f"{status.message}\n{rank0.logs()}"
        assert "node 1" in status.message and "roundpipe resume" in status.message
        assert rank1.coordinator.proc.wait(timeout=30) == -9
        assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-00000002"]
        assert (checkpoints / "latest").read_text().strip() == "step-00000002"
        log_text = (tmp_path / "node0" / "coordinator.log").read_text()
        assert ("step 2 written to" in log_text) and (
            ("(in the background)" in log_text) == bool(staging)
        )
        handle.resume()
        status = handle.wait(timeout_s=300)
        assert status.state == "succeeded", f"{status.message}\n{rank0.logs()}"
    assert_params_match(load_output(tmp_path / "out"), oracle_train(spec))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("collective", "bucket_mb"),
    [("grad/3#3", 0), ("weights/0-5#3", 25)],
    ids=["in-a-reduce-scatter", "in-a-weights-all-gather"],
)
def test_a_node_lost_inside_a_training_collective_pauses_and_resumes_exactly(
    tmp_path: Path, collective: str, bucket_mb: float
) -> None:
    """Node 1 dies where rank 0 is inside step 3's reduce-scatter of layer 3's gradient
    (one collective per layer), or inside the all-gather of the updated weights of the
    bucket of every layer (Note [gradient buckets]) (ROUNDPIPE_COLLECTIVE_FAULT): rank 0
    pauses the job naming node 1 instead of hanging, and `resume` continues from the
    checkpoint of step 2 on rank 0 alone to the oracle's model. (Drained checkpoints: a
    background checkpoint of step 2 could still be in its gathers when node 1 dies, and
    is then lost, as test_a_node_lost_in_the_checkpoint_gather_leaves_the_previous_one
    shows; Note [sharded background checkpoint].)"""
    from runtime_helpers import oracle_train

    spec = variant(
        tiny_spec(tmp_path / "x", steps=4, num_microbatches=4),
        tmp_path / "out",
        staging=0,
        optimizer_sharding="sharded",
        grad_bucket_mb=bucket_mb,
    )
    with local_group(
        tmp_path,
        "mn-shard-coll",
        timeout_s=5,
        check_exit=False,
        env={1: {"ROUNDPIPE_COLLECTIVE_FAULT": f"kill@{collective}"}},
        client_timeout_s=120,
    ) as (rank0, rank1):
        handle = rank0.client.submit(spec)
        status = handle.wait(timeout_s=120)
        assert status.state == "paused", f"{status.message}\n{rank0.logs()}"
        assert "node 1" in status.message and "roundpipe resume" in status.message
        assert rank1.coordinator.proc.wait(timeout=30) == -9
        assert "killed entering" in rank1.coordinator.tail(200_000)
        latest = (tmp_path / "out" / "checkpoints" / "latest").read_text().strip()
        assert latest == "step-00000002"
        handle.resume()
        status = handle.wait(timeout_s=300)
        assert status.state == "succeeded", f"{status.message}\n{rank0.logs()}"
    assert_params_match(load_output(tmp_path / "out"), oracle_train(spec))
