"""Data parallelism across coordinators (coordinator.multinode, docs/multi-node.md).

Two coordinators on loopback form one gloo group, each with its own CPU worker; a job
submitted to rank 0 runs on both, each node training half of every global batch. The
exported model must equal the single-process oracle over the whole global batch (which
is what one coordinator with that batch produces: tests/test_end_to_end.py) within 1e-5.
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
import time
import types
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from runtime_helpers import TINY_QWEN3, assert_params_match, load_output, oracle_train, tiny_spec

from roundpipe.client import RoundPipeError
from roundpipe.cluster import local_group
from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.training.group_member import GroupMember
from roundpipe.coordinator.training.job_errors import JobCancelled, JobPaused
from roundpipe.coordinator.training.multinode import (
    JobGroup,
    node_microbatches,
    settings_from_args,
)
from roundpipe.coordinator.training.timeline import NETWORK_TID, read_trace

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
MOE_WITH_AUX = {k: v for k, v in TINY_QWEN3.items() if k != "head_dim"} | {
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.5,
}


def oracle(spec, lora: bool) -> dict[str, torch.Tensor]:
    out = oracle_train(spec)
    return {n: t for n, t in out.items() if "lora_" in n} if lora else out


def test_a_heartbeat_that_fails_once_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """One failed heartbeat (a connection reset) stopped this node's beats for good: the
    others found it silent and paused its jobs. It is tried again; the store is lost
    only once no beat has gone through for the group's timeout."""
    from roundpipe.coordinator.training import multinode

    monkeypatch.setattr(multinode, "HEARTBEAT_INTERVAL_S", 0.001)

    class Store:
        def __init__(self, failures: int) -> None:
            self.failures, self.beats = failures, 0

        def add(self, key: str, amount: int) -> int:
            if self.failures:
                self.failures -= 1
                raise RuntimeError("Connection reset by peer")
            self.beats += amount
            if self.beats == 3:
                group._stop.set()
            return self.beats

    settings = multinode.GroupSettings(host="h", port=1, rank=1, world_size=2, timeout_s=600)
    group = multinode.NodeGroup(settings, Store(failures=2))
    group._beat()  # returns once the store counted three beats
    assert group.store_lost is None and group.store.beats == 3
    settings = multinode.GroupSettings(host="h", port=1, rank=1, world_size=2, timeout_s=0.05)
    group = multinode.NodeGroup(settings, Store(failures=10**9))
    group._beat()  # returns once no beat went through for 0.05 s
    assert "rank 0's store at h:1 stopped answering: Connection reset" in group.store_lost


def test_settings_from_flags_and_torchrun_environment() -> None:
    s = settings_from_args("tcp://10.0.0.1:29500", 1, 2, 30.0, environ={})
    assert (s.host, s.port, s.rank, s.world_size, s.timeout_s) == ("10.0.0.1", 29500, 1, 2, 30.0)
    env = {"MASTER_ADDR": "node0", "MASTER_PORT": "29400", "RANK": "0", "WORLD_SIZE": "3"}
    s = settings_from_args(None, None, None, environ=env)
    assert (s.host, s.port, s.rank, s.world_size) == ("node0", 29400, 0, 3)
    assert settings_from_args(None, None, None, environ={}) is None
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        settings_from_args("env://", 0, 2, environ={})
    with pytest.raises(ValueError, match="--rank must be in 0..1"):
        settings_from_args("tcp://h:1", 2, 2, environ={})
    with pytest.raises(ValueError, match="--world-size is required"):
        settings_from_args("tcp://h:1", 0, None, environ={})
    with pytest.raises(ValueError, match="need --dist-init"):
        settings_from_args(None, 0, 2, environ={})


def test_each_node_takes_an_equal_share_of_the_microbatches() -> None:
    assert [node_microbatches(6, r, 3) for r in range(3)] == [range(0, 2), range(2, 4), range(4, 6)]
    with pytest.raises(ValueError, match="multiple of the number of nodes"):
        node_microbatches(3, 0, 2)


@pytest.mark.slow
def test_two_coordinators_equal_one_with_the_global_batch(tmp_path: Path) -> None:
    """Full fine-tuning at staleness 0 (with stages split by microbatch: both gradient
    parts are summed over the nodes) and 1, LoRA, and a job resumed from a one-node
    checkpoint, submitted to rank 0 at once; each runs on both nodes and equals the
    oracle of the whole global batch (the resumed one: of the uninterrupted run)."""
    from runtime_helpers import trained_in_process

    specs = {
        "exact": tiny_spec(
            tmp_path / "exact", steps=4, num_microbatches=4, plan="F[0:2/1,2:4] T[4:6] B[2:4,0:2/1]"
        ),
        # One collective per layer here; the others bucket every layer into one
        # (Note [gradient buckets]).
        "stale": tiny_spec(
            tmp_path / "stale",
            steps=4,
            staleness=1,
            num_microbatches=4,
            train={"grad_bucket_mb": 0},
        ),
        "lora": tiny_spec(tmp_path / "lora", steps=4, num_microbatches=4, lora=LORA),
        # Decoder layers 1 and 3, 2 and 4 take turns in a gradient slot (Note [gradient
        # buffer]): a bucket of them would wait for itself, so one per layer.
        "slots": tiny_spec(
            tmp_path / "slots",
            steps=4,
            num_microbatches=4,
            plan="F[0:3,3:4] T[4:6] B[3:4,2:3,1:2,0:1]",
            train={"grad_buffer_stages": 1},
        ),
        # The router auxiliary loss weighs each microbatch by its share of the *global*
        # batch's tokens (each node holds half of them).
        "moe": tiny_spec(
            tmp_path / "moe",
            steps=2,
            num_microbatches=4,
            architecture="qwen3_moe",
            config=MOE_WITH_AUX,
            packing="none",
        ),
        # Dropout masks follow the global microbatch index: node 1's first microbatch
        # draws microbatch 2's mask, as on one coordinator (compared below).
        "dropout": tiny_spec(
            tmp_path / "dropout", steps=2, num_microbatches=4, lora=LORA | {"dropout": 0.5}
        ),
    }
    # One coordinator (in-process) writes checkpoints of steps 2 and 4; the group
    # resumes from step 2 (Note [checkpoint cut]: topology-free).
    single = with_output(
        tiny_spec(tmp_path / "single", steps=4, num_microbatches=4, staleness=1),
        checkpoint_every=2,
    )
    dropout_alone = tiny_spec(
        tmp_path / "dropout-alone", steps=2, num_microbatches=4, lora=LORA | {"dropout": 0.5}
    )
    arena_dir = Path("/dev/shm") / f"rp-mn-single-{os.getpid()}"
    arena_dir.mkdir()
    try:
        for alone in (single, dropout_alone):
            with trained_in_process(alone, arena_dir, 1) as trainer:
                if alone is dropout_alone:
                    trainer.export()
    finally:
        shutil.rmtree(arena_dir, ignore_errors=True)
    resumed = single.to_dict()
    resumed["model"]["resume_from"] = str(tmp_path / "single" / "checkpoints" / "step-00000002")
    resumed["output"] = {"dir": str(tmp_path / "resumed")}
    specs["resumed"] = JobSpec.from_dict(resumed)
    with local_group(tmp_path, "mn-exact") as (rank0, rank1):
        handles = {name: rank0.client.submit(spec) for name, spec in specs.items()}
        for name, handle in handles.items():
            events = list(handle.progress(timeout_s=300))
            status = handle.wait(timeout_s=300)
            assert status.state == "succeeded", f"{name}: {status.message}\n{rank0.logs()}"
            # (the resumed job's steps 1-2 come from its checkpoint's progress)
            assert [e.step for e in events] == list(range(1, specs[name].train.steps + 1)), name
        # The other node ran every job, its half of each batch (it records the end of
        # its share a moment after rank 0 reported the job's: wait for it).
        for handle in handles.values():
            wait_for_state(rank1, handle.job_id, "succeeded")
        ran = {j.job_id: j.state for j in rank1.client.jobs()}
        assert ran == {h.job_id: "succeeded" for h in handles.values()}, rank1.logs()
        # Each node's timeline (node 1's below its state directory) has a network lane:
        # every step's gradient reductions and all-gathers of the updated weights
        # (sharded state, the default), one per layer or one per bucket, its loss, and
        # the time waited for the other node.
        per_layer = {f"{c}/{layer}" for layer in range(6) for c in ("grad", "weights")}
        bucketed = {"grad/0-5", "weights/0-5"}
        for name, expected in (("stale", per_layer), ("exact", bucketed), ("slots", per_layer)):
            expected = expected | {"loss"}
            outputs = [
                Path(specs[name].output.dir),
                Path(rank1.client.status(handles[name].job_id).output_dir),
            ]
            lanes = []
            for output in outputs:
                trace = read_trace(output / "timeline")
                network = [e for e in trace.tasks if e["tid"] == NETWORK_TID]
                lanes.append({(e["args"]["step"], e["name"]) for e in network})
                assert all(e["args"]["wait_s"] >= 0 and e["dur"] > 0 for e in network)
            assert lanes[0] == {(k, c) for k in range(1, 5) for c in expected}, name
            assert lanes[0] == lanes[1], name
        # Cancelling at rank 0 cancels on every node.
        long = rank0.client.submit(tiny_spec(tmp_path / "long", steps=500, num_microbatches=4))
        next(iter(long.progress(timeout_s=120)))
        long.cancel()
        assert long.wait(timeout_s=60).state == "cancelled"
        wait_for_state(rank1, long.job_id, "cancelled")
        # The global batch must split evenly over the nodes: refused at submission.
        with pytest.raises(RoundPipeError, match="multiple of the number of nodes"):
            rank0.client.submit(tiny_spec(tmp_path / "odd", num_microbatches=3))
        # Jobs are taken by rank 0 only, so only rank 0 runs a spec-checking process.
        with pytest.raises(RoundPipeError, match="submit and resume jobs at rank 0"):
            rank1.client.submit(specs["exact"])
        assert spec_checkers(rank0) == 1 and spec_checkers(rank1) == 0
    for name, spec in specs.items():
        lora = name in ("lora", "dropout")
        if name == "dropout":  # the oracle draws no masks of ours: one coordinator does
            expected = load_output(Path(dropout_alone.output.dir), lora)
        else:
            expected = oracle(single if name == "resumed" else spec, lora)
        assert_params_match(load_output(Path(spec.output.dir), lora), expected)


def spec_checkers(node) -> int:
    """How many spec-checking processes (coordinator.service.admission) ``node``'s
    coordinator runs: its children other than multiprocessing's resource tracker (a
    checker is forked, Note [forked spec checker], or spawned)."""
    children = psutil.Process(node.coordinator.proc.pid).children()
    return sum("resource_tracker" not in " ".join(c.cmdline()) for c in children)


def wait_for_state(node, job_id: str, state: str, timeout_s: float = 30) -> None:
    """Wait until ``node`` (a LocalCluster of the group) lists ``job_id`` as ``state``."""
    deadline = time.monotonic() + timeout_s
    while {j.job_id: j.state for j in node.client.jobs()}.get(job_id) != state:
        assert time.monotonic() < deadline, node.logs()
        time.sleep(0.2)


def with_output(spec, **output) -> JobSpec:
    d = spec.to_dict()
    d["output"].update(output)
    return JobSpec.from_dict(d)


def checkpoints_of(spec) -> list[str]:
    root = Path(spec.output.dir) / "checkpoints"
    return sorted(p.name for p in root.glob("step-*")) if root.is_dir() else []


@pytest.mark.slow
def test_a_lost_node_pauses_the_job_which_resumes_on_the_rest(tmp_path: Path) -> None:
    """Node 1's worker freezes in step 4 (so the job cannot get past step 3) and then its
    coordinator is killed: rank 0 pauses the job within the group timeout, naming node 1;
    `resume` continues from the 2-node checkpoint of step 2 on rank 0 alone, exactly."""
    spec = with_output(tiny_spec(tmp_path / "out", steps=6, num_microbatches=4), checkpoint_every=2)
    with local_group(
        tmp_path, "mn-fault", timeout_s=5, faults={1: "stop@iteration=4"}, check_exit=False
    ) as (rank0, rank1):
        handle = rank0.client.submit(spec)
        deadline = time.monotonic() + 120
        while "step-00000002" not in checkpoints_of(spec):
            assert time.monotonic() < deadline, rank0.logs()
            time.sleep(0.1)
        rank1.coordinator.proc.kill()
        killed = time.monotonic()
        status = handle.wait(timeout_s=60)
        noticed_s = time.monotonic() - killed
        assert status.state == "paused", status.message
        assert "node 1" in status.message and "roundpipe resume" in status.message
        assert noticed_s < 30, noticed_s  # the group timeout (5 s) plus polling
        assert status.step <= 3
        handle.resume()
        status = handle.wait(timeout_s=300)
        assert status.state == "succeeded", f"{status.message}\n{rank0.logs()}"
        assert rank0.coordinator.alive()
    assert rank0.coordinator.proc.returncode == 0, rank0.logs()
    assert_params_match(load_output(Path(spec.output.dir), False), oracle(spec, False))


@pytest.mark.slow
def test_nodes_whose_plans_differ_agree_on_the_gradient_buckets(tmp_path: Path) -> None:
    """Each node plans for its own workers. Node 1's three workers get narrow stages whose
    decoder layers take turns in gradient slots (``grad_buffer_stages: 1``, Note
    [gradient buffer]), so it must reduce one layer at a time (Note [gradient
    buckets]); rank 0's single worker runs the whole model as one stage and would
    bucket every layer into one collective. The nodes agree: both take one layer at a
    time (a mismatch would leave each waiting at a collective the other never
    reaches), and the job equals the oracle."""
    from runtime_helpers import TINY_QWEN3

    spec = tiny_spec(
        tmp_path / "out",
        steps=3,
        num_microbatches=4,
        config={**TINY_QWEN3, "num_hidden_layers": 8},
        train={"grad_buffer_stages": 1},
    )
    with local_group(tmp_path, "mn-plans", workers_per_node=[1, 3]) as (rank0, rank1):
        handle = rank0.client.submit(spec)
        status = handle.wait(timeout_s=300)
        assert status.state == "succeeded", f"{status.message}\n{rank0.logs()}"
        wait_for_state(rank1, handle.job_id, "succeeded")
    for node in ("node0", "node1"):
        log_text = (tmp_path / node / "coordinator.log").read_text()
        assert "10 layers' gradients reduced in 10 collective(s) per step" in log_text, node
    assert_params_match(load_output(Path(spec.output.dir), False), oracle(spec, False))


@pytest.mark.slow
def test_rank_0_says_which_node_it_waits_for(tmp_path: Path) -> None:
    """Node 1 has no worker: the job waits, and rank 0's status and log name node 1 and
    why. Cancelled at rank 0, it is cancelled at node 1 too (which was waiting for a
    worker, not training); once a worker joins node 1 the next job runs to the end."""
    spec = tiny_spec(tmp_path / "out", steps=2, num_microbatches=2)
    with local_group(tmp_path, "mn-wait", workers_per_node=[1, 0]) as (rank0, rank1):
        waiting = rank0.client.submit(spec)
        deadline = time.monotonic() + 60
        while "not there yet" not in (status := waiting.status()).message:
            assert status.state in ("queued", "running"), status.message
            assert time.monotonic() < deadline, rank0.logs()
            time.sleep(0.5)
        assert "every node to prepare the job" in status.message, status.message
        assert "node 1 (" in status.message, status.message
        assert "no worker connected to its coordinator" in status.message, status.message
        log_text = (tmp_path / "node0" / "coordinator.log").read_text()
        assert "(rank 0): waiting" in log_text and "no worker connected" in log_text
        waiting.cancel()
        assert waiting.wait(timeout_s=60).state == "cancelled"
        wait_for_state(rank1, waiting.job_id, "cancelled")
        rank1.add_worker("n1w1")
        status = rank0.client.submit(spec).wait(timeout_s=120)
        assert status.state == "succeeded", f"{status.message}\n{rank0.logs()}"
        # Node 1 cannot even start the next job (its job directory cannot be made): it
        # still joins the job's group and leaves it, so rank 0 learns why, and the job
        # after it runs on both nodes (before, node 1's job thread died, and every later
        # job's process groups paired with the wrong ones: each paused).
        jobs = rank1.state_dir / "jobs"
        jobs.rename(jobs.with_name("jobs.moved"))
        jobs.write_text("not a directory")
        status = rank0.client.submit(spec).wait(timeout_s=120)
        assert status.state != "succeeded", rank0.logs()
        assert "node 1 cannot run it" in status.message, status.message
        jobs.unlink()
        jobs.with_name("jobs.moved").rename(jobs)
        after = rank0.client.submit(spec)
        status = after.wait(timeout_s=120)
        assert status.state == "succeeded", f"{status.message}\n{rank0.logs()}"
        wait_for_state(rank1, after.job_id, "succeeded")


def test_plan_predicts_the_step_of_several_nodes(capsys) -> None:
    """`roundpipe plan --nodes 2 --network-bandwidth ... --optimizer-sharding replicated`:
    a ring all-reduce of the fp32 gradients, hidden behind the step at staleness 1, added
    to it at staleness 0."""
    from roundpipe.coordinator.planning.data_parallel import predict_data_parallel
    from roundpipe.plan_command import plan_main

    predict = functools.partial(
        predict_data_parallel,
        iteration_s=1.0,
        tokens_per_iteration=1000,
        trainable_params=250_000_000,
        bandwidth_bytes_per_s=1e9,
    )
    p = predict(nodes=2, staleness=1)
    assert p.gradient_bytes == 1_000_000_000 and p.allreduce_s == pytest.approx(1.0)
    assert p.step_s == pytest.approx(1.0) and p.tokens_per_s == pytest.approx(2000)
    p0 = predict(nodes=4, staleness=0)
    assert p0.allreduce_s == pytest.approx(1.5) and p0.step_s == pytest.approx(2.5)
    # Collectives on the workers' own cores (CPU workers on one host): nothing hidden.
    shared = predict(nodes=2, staleness=1, shared_cores=True)
    assert shared.step_s == pytest.approx(2.0)
    args = ["--architecture", "qwen3", "--set", "hidden_size=64", "--set", "intermediate_size=128"]
    args += ["--set", "num_hidden_layers=4", "--set", "num_attention_heads=4"]
    args += ["--set", "num_key_value_heads=2", "--set", "vocab_size=1000"]
    args += ["--workers", "2", "--seq-len", "128", "--flops", "1T"]
    nodes = ["--nodes", "2", "--network-bandwidth", "100MB/s"]
    assert plan_main([*args, *nodes, "--optimizer-sharding", "replicated"]) == 0
    out = capsys.readouterr().out
    assert "2 nodes over 0.1 GB/s: all-reduce of" in out and "tokens/s for all nodes" in out
    # The job spec's default, auto, shards the optimizer state: so does the plan's.
    assert plan_main([*args, *nodes]) == 0
    out = capsys.readouterr().out
    assert "reduce-scatter of the gradients and all-gather of the weights" in out
    import json

    doc = {}
    for flags in ([], ["--collectives-share-cores"]):
        assert plan_main([*args, *nodes, "--staleness", "1", "--json", *flags]) == 0
        doc[bool(flags)] = json.loads(capsys.readouterr().out)["multinode"]
    overlapped, serial = doc[False], doc[True]
    assert serial["allreduce_s"] == pytest.approx(overlapped["allreduce_s"])
    assert serial["step_s"] > overlapped["step_s"]
    iteration = serial["step_s"] - serial["allreduce_s"]
    assert overlapped["step_s"] == pytest.approx(max(iteration, overlapped["allreduce_s"]))


def test_plan_predicts_sharded_traffic_and_host_memory_per_node(capsys) -> None:
    """`roundpipe plan --nodes 2 --optimizer-sharding sharded`: a reduce-scatter of the
    gradients, which moves what an all-reduce moves on gloo (Note [sharded collectives over
    gloo]), and an all-gather of the weights, and each node's host memory with half the
    fp32 masters and optimizer states."""
    import json

    from roundpipe.coordinator.planning.data_parallel import predict_data_parallel
    from roundpipe.plan_command import plan_main

    p = predict_data_parallel(
        iteration_s=1.0, tokens_per_iteration=1000, trainable_params=250_000_000,
        bandwidth_bytes_per_s=1e9, nodes=4, staleness=0, sharded=True,
        weight_bytes=2, grad_bytes=2,
    )  # fmt: skip
    # (2 (W-1)/W x 2 bytes of gradient + (W-1)/W x 2 bytes of weight) x 250M = 1.125 GB
    assert p.allreduce_s == pytest.approx(1.125) and p.step_s == pytest.approx(2.125)
    args = ["--architecture", "qwen3", "--set", "hidden_size=64", "--set", "intermediate_size=128"]
    args += ["--set", "num_hidden_layers=4", "--set", "num_attention_heads=4"]
    args += ["--set", "num_key_value_heads=2", "--set", "vocab_size=1000"]
    args += ["--workers", "2", "--seq-len", "128", "--flops", "1T", "--nodes", "2"]
    # The default buckets put this tiny model in one (Note [gradient buckets]): buffers
    # larger than what sharding saves on it; one collective per layer needs less.
    bucketed = {}
    for mb in ("25", "0"):
        sharded = [*args, "--optimizer-sharding", "sharded", "--grad-bucket-mb", mb]
        assert plan_main([*sharded, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        bucketed[mb] = doc["host_memory_per_node_sharded"]["collectives"]
    assert bucketed["25"] > bucketed["0"] > 0
    whole, per_node = doc["host_memory"], doc["host_memory_per_node_sharded"]
    assert per_node["masters"] == -(-whole["masters"] // 2)
    assert per_node["moments"] == -(-whole["moments"] // 2)
    assert per_node["weights"] == whole["weights"] and per_node["total"] < whole["total"]
    # Rank 0 gathers the whole masters while it writes a checkpoint, the states a layer
    # at a time (Note [streamed checkpoint state]).
    writing = doc["host_memory_rank0_writing_sharded"]
    assert whole["masters"] < writing["gathered"] < whole["masters"] + whole["moments"]
    assert writing["total"] == per_node["total"] + writing["gathered"]
    assert doc["multinode"]["sharded"] is True
    assert plan_main([*args, "--optimizer-sharding", "sharded"]) == 0
    out = capsys.readouterr().out
    assert "reduce-scatter of the gradients and all-gather of the weights" in out
    assert "with the optimizer state sharded over 2 nodes, each node needs" in out
    assert (
        "rank 0, while it writes a checkpoint," in out and "state gathered for checkpoints" in out
    )


def test_a_second_coordinator_with_a_rank_already_in_the_group_is_refused() -> None:
    """Two coordinators both started with --rank 1: the second was let in, overwrote
    rank 1's address and heartbeats in the store, and failed only at its first
    collective, pausing the job on every node."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    member = Path(__file__).parent / "procs" / "group_member.py"

    def start(rank: int, **env: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, str(member), "--rank", str(rank), "--world-size", "2",
             "--port", str(port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **env},
        )  # fmt: skip

    members = [start(0)]
    try:
        # A rank whose first start failed after its claim (here gloo cannot use the
        # interface it was told to, while rank 0 waits) may start again.
        failed, _ = start(1, GLOO_SOCKET_IFNAME="no-such-if0").communicate(timeout=120)
        assert "refused: cannot join the data-parallel group" in failed, failed
        members.append(start(1))
        for proc in members:
            assert proc.stdout.readline().strip() == "joined"
        duplicate = start(1)
        out, _ = duplicate.communicate(timeout=120)
        assert duplicate.returncode == 3, out
        assert "rank 1 is already in the data-parallel group" in out, out
        assert "its own --rank" in out
    finally:
        for proc in members:
            proc.stdin.close()
            proc.wait(timeout=60)


def _follower_of_three(store) -> GroupMember:
    """Rank 1 of a 3-node group over ``store`` (a real store; only the node group's
    heartbeats and host names are stand-ins, and the job's process groups are not made)."""
    nodes = types.SimpleNamespace(
        store_lost=None, world_size=3, timeout_s=60, silent_nodes=lambda: [],
        describe=lambda r: f"node {r} (host{r})",
    )  # fmt: skip
    group = object.__new__(JobGroup)
    group.__dict__.update(
        nodes=nodes, rank=1, world_size=3, job_id="job-x", lost=None, left_as=None,
        left_by=None, left_why=None, _last_check=0.0, _problem_lock=threading.Lock(),
        waiting=None, store=dist.PrefixStore("rp/job/1/", store),
    )  # fmt: skip
    output = types.SimpleNamespace(cancelled=threading.Event(), checkpoint_step=10)
    return GroupMember("job-x", None, group, output=output, cancelled=threading.Event(), wake=print)


@pytest.mark.parametrize("left_as", ["queued: interrupted by a coordinator shutdown", "cancelled"])
def test_a_follower_waiting_for_rank_0_is_not_stopped_by_another_follower(left_as: str) -> None:
    """Note [a group's job ends as rank 0's]: rank 1 of 3 has trained all its steps and
    waits for rank 0's word while rank 0 writes its model; rank 2 leaves meanwhile (its
    coordinator stopped, or an admin cancelled it there). Rank 0 waits for no one then
    and succeeds, so rank 1 does too: it was paused (advising a resume that rank 0
    refuses) or "cancelled at rank 0". Before the end, rank 2 leaving cancelled pauses
    rank 1 naming node 2; only rank 0's cancel cancels it."""
    store = dist.HashStore()
    member = _follower_of_three(store)
    member.group.store.set("stop/2", left_as)  # rank 2 left, before rank 0's word
    answers = iter([False, False])  # rank 0 says "finished" at the third look
    member.group._says_finished = lambda what: next(answers, True)
    member.end()  # returns: rank 0 succeeded
    member = _follower_of_three(store)
    with pytest.raises(JobPaused, match="node 2 .host2. left the job"):
        member.check_stopped()
    member = _follower_of_three(store)
    member.group.store.set("stop/0", "cancelled: cancelled by request")
    with pytest.raises(JobCancelled, match="cancelled"):
        member.check_stopped()
