"""Observability with real daemons: Prometheus metrics scraped over HTTP during a job and
checked against the job's own figures, the timeline trace and its picture, TensorBoard
scalars read back, and the status / workers commands (docs/observability.md)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from runtime_helpers import oracle_train, run_in_process, tiny_spec

from roundpipe.cli import main as cli_main
from roundpipe.cluster import LocalCluster, cpu_cluster
from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.training.hold_point import hold_env
from roundpipe.coordinator.training.timeline import TRACE_DIR, read_trace, trace_files

pytestmark = pytest.mark.slow

STEPS = 10
HOLD_STEP = 6
"""The job waits before this iteration until the test has asked its questions of a
running job (``ROUNDPIPE_TRAIN_HOLD``, coordinator/training/hold_point.py): no race with
how fast a loaded machine trains."""
_SAMPLE = re.compile(r"^(?P<name>[a-z_]+)(\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """Created by the test to let the held job go on."""
    return tmp_path_factory.mktemp("obs-hold") / "go"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, release: Path) -> Iterator[LocalCluster]:
    with cpu_cluster(
        tmp_path_factory.mktemp("obs"),
        "obs",
        ["--wait-timeout", "120", "--metrics-address", "127.0.0.1:0"],
        num_workers=2,
        worker_args=["--emulate-pcie", "4GB/s"],  # so that bytes and bandwidth are real
        env=hold_env(HOLD_STEP, release),
    ) as c:
        yield c


def metrics_url(cluster: LocalCluster) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = re.search(
            r"Prometheus metrics on (http://\S+/metrics)", cluster.coordinator.tail(20000)
        )
        if m:
            return m.group(1)
        time.sleep(0.1)
    raise AssertionError(f"the coordinator did not log its metrics address\n{cluster.logs()}")


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """{(metric name, labels): value} of one scrape."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, line
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group("labels") or ""))
        samples[(m.group("name"), labels)] = float(m.group("value"))
    return samples


def one(samples: dict, name: str, **labels: str) -> float:
    want = frozenset(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_metrics_status_timeline_tensorboard(
    cluster: LocalCluster, release: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    url = metrics_url(cluster)
    spec = tiny_spec(tmp_path / "out", steps=STEPS, staleness=1).to_dict()
    spec["output"]["tensorboard"] = True
    # One plan for the whole run: a re-plan from times measured under load would change
    # the number of tasks per step, which the trace check below counts.
    spec["train"]["replan"] = False
    handle = cluster.client.submit(JobSpec.from_dict(spec))
    job = handle.job_id

    # Scrape while the job runs, until a step's bubble and optimizer lag are measured.
    during = None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        status = handle.status()
        assert status.state in ("queued", "running"), status
        samples = scrape(url)
        measured = ("roundpipe_job_bubble_fraction", "roundpipe_job_optimizer_lag_seconds")
        if all((name, frozenset({("job", job)})) in samples for name in measured):
            during = samples
            status_after = handle.status()
            break
        time.sleep(0.05)
    assert during is not None, cluster.logs()
    assert one(during, "roundpipe_jobs", state="running") == 1
    step = one(during, "roundpipe_job_step", job=job)
    assert 1 <= step <= status_after.step
    assert one(during, "roundpipe_job_total_steps", job=job) == STEPS
    bubble = one(during, "roundpipe_job_bubble_fraction", job=job)
    assert 0.0 <= bubble < 1.0
    assert 0 <= one(during, "roundpipe_job_optimizer_lag_steps", job=job) <= 2  # staleness 1
    assert one(during, "roundpipe_job_optimizer_lag_seconds", job=job) >= 0
    assert one(during, "roundpipe_job_task_retries_total", job=job) == 0
    assert one(during, "roundpipe_job_step_seconds", job=job) > 0
    assert one(during, "roundpipe_arena_bytes") > 0
    assert one(during, "roundpipe_host_memory_total_bytes") > one(
        during, "roundpipe_host_memory_available_bytes"
    )
    workers = {w.worker_id: w for w in cluster.client.workers()}
    for worker_id in workers:
        labels = {"worker": str(worker_id)}
        assert one(during, "roundpipe_worker_heartbeat_age_seconds", **labels) < 5
        assert one(during, "roundpipe_worker_tasks_done_total", **labels) >= 0
        assert 0.0 <= one(during, "roundpipe_worker_busy_fraction", **labels) <= 1.0
        states = [
            one(during, "roundpipe_worker_state", **labels, state=s)
            for s in ("idle", "busy", "lost")
        ]
        assert sorted(states) == [0.0, 0.0, 1.0]
    assert (
        sum(
            one(during, "roundpipe_job_worker_upload_bytes_total", job=job, worker=str(w))
            for w in workers
        )
        > 0
    )

    # `roundpipe status` and `roundpipe workers` while it runs, as the cluster's admin.
    for name, value in cluster.key_env("admin").items():
        monkeypatch.setenv(name, value)
    assert cli_main(["status", job, "--address", cluster.address]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^state: +running$", out, re.M), out
    assert re.search(r"^speed: +[\d.]+k? tok/s$", out, re.M), out
    assert re.search(r"^bubble: +[\d.]+% \(measured", out, re.M), out
    assert re.search(r"^opt lag: +\d+ step", out, re.M), out
    assert re.search(r"^busy: +w\d+ \d+%, w\d+ \d+%$", out, re.M), out
    assert cli_main(["workers", "--address", cluster.address]) == 0
    out = capsys.readouterr().out
    assert "4.0 / 4.0 GB/s" in out, out
    assert handle.status().step < HOLD_STEP  # all of the above saw the job running

    release.touch()
    status = handle.wait(timeout_s=300)
    assert status.state == "succeeded", f"{status.message}\n{cluster.logs()}"
    events = {e.step: e for e in handle.progress(timeout_s=30)}
    assert sorted(events) == list(range(1, STEPS + 1))
    # The scraped loss and rate are those of a step the job reported.
    loss = one(during, "roundpipe_job_loss", job=job)
    assert events[int(step)].loss == loss
    rate = one(during, "roundpipe_job_tokens_per_second", job=job)
    assert rate in {events[s].tokens_per_s for s in (int(step), int(step) - 1) if s in events}

    # The trace: complete JSON, one lane per worker plus the optimizer, every step.
    out_dir = Path(status.output_dir)
    files = trace_files(out_dir / TRACE_DIR)
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    lanes = {e["tid"] for e in slices}
    assert lanes == {0} | {w + 1 for w in workers}, lanes
    names = {e["name"] for e in slices if e["tid"] != 0}
    assert {"F0", "T", "B0"} <= names, names
    trace = read_trace(out_dir / TRACE_DIR)
    assert sorted(trace.steps) == list(range(1, STEPS + 1))
    assert all("bubble_fraction" in trace.steps[s] for s in range(1, STEPS + 1))
    assert bubble in {trace.steps[s]["bubble_fraction"] for s in trace.steps}
    for s, info in trace.steps.items():
        assert info["loss"] == events[s].loss
    per_step_tasks = {}
    for e in trace.tasks:
        if e["tid"] != 0:
            per_step_tasks[e["args"]["step"]] = per_step_tasks.get(e["args"]["step"], 0) + 1
    assert len(set(per_step_tasks.values())) == 1  # every step: all of its tasks

    # The picture, through the CLI, by job id.
    png = tmp_path / "timeline.png"
    assert (
        cli_main(["timeline", job, "--steps", "5:7", "-o", str(png), "--address", cluster.address])
        == 0
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "steps 5-7" in capsys.readouterr().out

    # TensorBoard scalars, read back.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {
        "train/loss",
        "train/learning_rate",
        "train/tokens_per_s",
        "train/grad_norm",
        "pipeline/bubble_fraction",
    } <= tags
    losses = {s.step: s.value for s in acc.Scalars("train/loss")}
    assert sorted(losses) == list(range(1, STEPS + 1))
    for s, value in losses.items():
        assert value == pytest.approx(events[s].loss, rel=1e-6)
    norms = [s.value for s in acc.Scalars("train/grad_norm")]
    assert len(norms) == STEPS and all(n > 0 for n in norms)


def test_tensorboard_grad_norm_matches_the_oracle(tmp_path: Path) -> None:
    """The logged gradient norm is the plain loop's global norm of each step (before
    clipping), with clipping on and off."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for clip in (None, 0.5):
        raw = tiny_spec(tmp_path / f"out-{clip}", steps=3, grad_clip=clip).to_dict()
        raw["output"]["tensorboard"] = True
        spec = JobSpec.from_dict(raw)
        expected: list[float] = []
        oracle_train(spec, grad_norms=expected)
        arena_dir = Path("/dev/shm") / f"rp-tbnorm-{os.getpid()}"
        arena_dir.mkdir(exist_ok=True)
        try:
            run_in_process(spec, arena_dir)
        finally:
            arena_dir.rmdir()
        acc = EventAccumulator(str(Path(spec.output.dir) / "tensorboard"))
        acc.Reload()
        logged = [s.value for s in acc.Scalars("train/grad_norm")]
        assert logged == pytest.approx(expected, rel=1e-4), clip


def test_a_full_disk_under_tensorboard_stops_its_scalars_not_the_job(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """TensorBoard is an aid: a disk that fills under its files mid-run (SummaryWriter's
    thread met ENOSPC and raises it at the next scalar and at close) is logged once and
    the job trains on. It failed the job ("optimizer failed: No space left on device")
    and, raising again in the trainer's close, left its arenas in /dev/shm."""
    import errno

    from torch.utils.tensorboard import SummaryWriter

    calls = {"n": 0}
    real_add = SummaryWriter.add_scalar

    def add_scalar(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 5:  # step 2 on: the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_add(self, *args, **kwargs)

    def close(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SummaryWriter, "add_scalar", add_scalar)
    monkeypatch.setattr(SummaryWriter, "close", close)
    raw = tiny_spec(tmp_path / "out", steps=4).to_dict()
    raw["output"]["tensorboard"] = True
    spec = JobSpec.from_dict(raw)
    arena_dir = Path("/dev/shm") / f"rp-tbfull-{os.getpid()}"
    arena_dir.mkdir(exist_ok=True)
    try:
        with caplog.at_level("WARNING"):
            progress = run_in_process(spec, arena_dir)
        assert [e.step for e in progress] == [1, 2, 3, 4]  # it trained on
        warned = [r.getMessage() for r in caplog.records if "TensorBoard" in r.getMessage()]
        assert len(warned) == 1 and "No space left on device" in warned[0], warned
        assert str(tmp_path / "out" / "tensorboard") in warned[0]  # the user's path
        assert list(arena_dir.iterdir()) == []  # the arenas went with the job
    finally:
        shutil.rmtree(arena_dir, ignore_errors=True)


def test_a_trainer_lets_go_of_its_arenas_when_a_part_fails_to_close(tmp_path: Path) -> None:
    """Trainer.close gives back every part even when one before it raises (logged): an
    exception from the timeline skipped the output directory and the arenas."""
    from runtime_helpers import trained_in_process

    spec = tiny_spec(tmp_path / "out", steps=2)
    arena_dir = Path("/dev/shm") / f"rp-close-{os.getpid()}"
    arena_dir.mkdir(exist_ok=True)
    try:
        with trained_in_process(spec, arena_dir, 1) as trainer:

            def broken() -> None:
                raise RuntimeError("the timeline could not close")

            trainer.timeline.close = broken
            assert list(arena_dir.iterdir())  # the job's arenas, until it closes
        assert list(arena_dir.iterdir()) == []
        assert trainer.layout is None
    finally:
        shutil.rmtree(arena_dir, ignore_errors=True)


def test_a_resumed_runs_tensorboard_steps_replace_the_ones_it_repeats(tmp_path: Path) -> None:
    """A run stopped after step 5, its checkpoint at step 3: the resumed run logs steps
    4.. again into the same directory. TensorBoard showed both (two points per step, the
    curve going back); the resumed run's writer now hides the old ones past its start."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from roundpipe.coordinator.training.timeline import TimelineRecorder

    directory = tmp_path / "tensorboard"
    # ... and a run resumed without a checkpoint (from step 1) replaces them all.
    for run, (first, last, scale) in enumerate(((1, 5, 0.5), (1, 5, 1.0), (4, 6, 10.0))):
        recorder = TimelineRecorder("j", None, directory, first_step=first)
        assert recorder._tensorboard is not None
        for step in range(first, last + 1):
            recorder._tensorboard.scalar("train/loss", step * scale, step)
        recorder.close()
        # TensorBoard reads event files in name order: the second and a writer count
        # name them, so within one second a count of 9 then 10 would misorder the runs.
        (made,) = [f for f in directory.iterdir() if not f.name.startswith("events.run")]
        made.rename(directory / f"events.run{run}.tfevents")
    acc = EventAccumulator(str(directory))
    acc.Reload()
    logged = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert logged == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]


def test_the_metrics_endpoint_holds_few_connections_and_drops_idle_ones(monkeypatch) -> None:
    """Note [bounded metrics endpoint]: idle connections to the metrics port (no key
    needed) each held a thread and a descriptor of the coordinator for ever. Now at most
    METRICS_CONNECTIONS are served at once, those beyond are closed as they are accepted,
    an idle one is closed after METRICS_TIMEOUT_S (2 s here), and scrapes work again."""
    import errno
    import select
    import socket
    import threading

    from roundpipe.coordinator.service import metrics
    from roundpipe.coordinator.service.connections import METRICS_CONNECTIONS

    monkeypatch.setattr(metrics._QuietHandler, "timeout", 2.0)
    server = metrics.MetricsServer(lambda: metrics.MetricsSnapshot({"running": 1}, 0), ":0")
    url = f"http://127.0.0.1:{server.port}/metrics"
    threads = threading.active_count()
    idle = []
    for _ in range(40):  # connects in flight: the listen backlog is short
        s = socket.socket()
        s.setblocking(False)
        assert s.connect_ex(("127.0.0.1", server.port)) in (0, errno.EINPROGRESS)
        idle.append(s)
    try:
        most = 0
        deadline = time.monotonic() + 120
        open_ = list(idle)
        while open_:  # every connection is closed by the server, at once or once idle
            assert time.monotonic() < deadline, f"{len(open_)} connections still open"
            most = max(most, threading.active_count() - threads)
            readable, _, _ = select.select(open_, [], [], 0.05)
            for s in readable:
                try:
                    gone = s.recv(1) == b""
                except OSError:  # refused or reset: closed too
                    gone = True
                if gone:
                    open_.remove(s)
        assert 0 < most <= METRICS_CONNECTIONS, most
        assert server.refused > 0
        assert one(scrape(url), "roundpipe_jobs", state="running") == 1.0
    finally:
        for s in idle:
            s.close()
        server.close()
