"""Prometheus metrics of the coordinator (``roundpipe-coordinator --metrics-address``).

Nothing is counted on the hot paths for this: a custom collector reads the
coordinator's state when Prometheus scrapes (the job's progress, its
``TimelineRecorder``, its task tracker, the worker table), so a coordinator nobody
scrapes pays nothing. ``job_figures`` is the same reading for ``roundpipe status``.

Metrics (all gauges unless ``_total``; docs/observability.md lists them with meanings):

    roundpipe_jobs{state}                              jobs the coordinator knows, by state
    roundpipe_arena_bytes                              shared-memory arenas of the running job
    roundpipe_host_memory_total_bytes / _available_bytes
    roundpipe_coordinator_resident_bytes               the coordinator process's RSS
    roundpipe_job_step{job}, _total_steps, _loss, _learning_rate
    roundpipe_job_tokens_per_second{job}, roundpipe_job_step_seconds{job}
    roundpipe_job_optimizer_lag_steps{job}, roundpipe_job_optimizer_lag_seconds{job}
    roundpipe_job_bubble_fraction{job}
    roundpipe_job_task_retries_total{job}
    roundpipe_job_worker_upload_bytes_total{job,worker}, ..._download_bytes_total
    roundpipe_worker_busy_fraction{worker,name}
    roundpipe_worker_tasks_done_total{worker,name}
    roundpipe_worker_heartbeat_age_seconds{worker,name}
    roundpipe_worker_state{worker,name,state}          1 for the worker's state

Per-job metrics exist for the running job (the one whose state lives in memory).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil

from roundpipe.coordinator.training.timeline import stage_label
from roundpipe.protocol import JOB_STATES

if TYPE_CHECKING:
    from roundpipe.coordinator.service.daemon import Coordinator
    from roundpipe.coordinator.training.trainer import Trainer

__all__ = ["JobFigures", "MetricsServer", "current_tasks", "job_figures", "parse_address"]

log = logging.getLogger(__name__)

WORKER_STATES = ("idle", "busy", "lost")


@dataclass
class JobFigures:
    """A running job's figures, read at one moment."""

    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    lr: float | None = None
    tokens_per_s: float | None = None
    step_s: float | None = None
    """Seconds between the last two reported steps."""
    optimizer_lag_steps: int = 0
    """Steps the pipeline has finished that the optimizer has not yet applied."""
    optimizer_lag_s: float | None = None
    """For the newest step the optimizer applied: seconds from the pipeline finishing
    it to the optimizer finishing it (0 when the optimizer kept up)."""
    bubble_fraction: float | None = None
    """Measured bubble fraction of the newest settled step."""
    busy: dict[int, float] = field(default_factory=dict)
    """Per worker: busy fraction over the newest settled step."""
    upload_bytes: dict[int, int] = field(default_factory=dict)
    download_bytes: dict[int, int] = field(default_factory=dict)
    task_retries: int = 0
    """Tasks sent again: after a failure or with a lost worker's tasks."""


def job_figures(trainer: Trainer) -> JobFigures:
    """Read a trainer's figures (any thread; no locks held long)."""
    spec = trainer.spec
    figures = JobFigures(step=trainer.step, total_steps=spec.train.steps, loss=trainer.last_loss)
    last_two = trainer.recent_progress(2)
    if last_two:
        figures.lr = last_two[-1].lr
        figures.tokens_per_s = last_two[-1].tokens_per_s
        if len(last_two) == 2:
            figures.step_s = max(0.0, last_two[1].time - last_two[0].time)
        elif last_two[-1].tokens_per_s > 0:
            tokens = spec.global_batch_size * spec.data.seq_len
            figures.step_s = tokens / last_two[-1].tokens_per_s
    timeline = trainer.timeline
    if trainer.prepared:
        figures.optimizer_lag_steps = max(0, trainer.step - timeline.optimizer_step)
    figures.optimizer_lag_s = timeline.latest_optimizer_lag_s
    figures.bubble_fraction = timeline.latest_bubble
    figures.busy = dict(timeline.latest_busy)
    for worker, (_, up, down) in timeline.worker_totals().items():
        figures.upload_bytes[worker] = up
        figures.download_bytes[worker] = down
    tracker = getattr(trainer, "tracker", None)
    if tracker is not None:
        failures = list(tracker.failures.values())
        recoveries = list(tracker.recoveries)
        figures.task_retries = sum(failures) + sum(len(r["tasks"]) for r in recoveries)
    return figures


def current_tasks(trainer: Trainer | None) -> dict[int, str]:
    """Per worker, the oldest task it was sent and has not finished (the one it runs:
    a worker runs its tasks in order), e.g. ``"step 12 B1 [0:2]"``."""
    tracker = getattr(trainer, "tracker", None)
    if trainer is None or tracker is None or trainer.layout is None:
        return {}
    oldest: dict[int, object] = {}
    for entry in list(tracker.in_flight.values()):
        held = oldest.get(entry.worker_id)
        if held is None or entry.task.task_id < held.task.task_id:  # type: ignore[attr-defined]
            oldest[entry.worker_id] = entry
    plan = trainer.plan
    out = {}
    for worker, entry in oldest.items():
        t = entry.task  # type: ignore[attr-defined]
        label = stage_label(plan, t.kind, t.layer_start, t.layer_stop)
        out[worker] = f"step {t.iteration} {label} [{t.layer_start}:{t.layer_stop}]"
    return out


# --------------------------------------------------------------------------- collector


class CoordinatorCollector:
    """A prometheus_client collector that reads a Coordinator at scrape time."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self._process = psutil.Process(os.getpid())

    def describe(self) -> list:
        return []  # dynamic label sets: skip registration-time collection

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = self.coordinator
        with c._lock:
            states = [j.state for j in c.book.jobs.values()]
            active = c.book.active
            trainer = active.trainer if active is not None else None
            workers = [(w.worker_id, w.hello.worker_name, w.last_seen) for w in c.workers.values()]
            tasks_done = {w.worker_id: w.tasks_done for w in c.workers.values()}
        now = time.monotonic()

        jobs = GaugeMetricFamily(
            "roundpipe_jobs", "Jobs the coordinator knows, by state", labels=["state"]
        )
        for state in JOB_STATES:
            jobs.add_metric([state], states.count(state))
        yield jobs
        layout = trainer.layout if trainer is not None else None
        yield GaugeMetricFamily(
            "roundpipe_arena_bytes",
            "Bytes of shared-memory arenas the running job holds",
            value=layout.total_bytes if layout is not None else 0,
        )
        vm = psutil.virtual_memory()
        yield GaugeMetricFamily("roundpipe_host_memory_total_bytes", "Host memory", value=vm.total)
        yield GaugeMetricFamily(
            "roundpipe_host_memory_available_bytes", "Host memory available", value=vm.available
        )
        yield GaugeMetricFamily(
            "roundpipe_coordinator_resident_bytes",
            "Resident memory of the coordinator process",
            value=self._process.memory_info().rss,
        )

        figures = job_figures(trainer) if trainer is not None and trainer.prepared else None
        busy = figures.busy if figures is not None else {}
        if figures is not None:
            assert active is not None
            job = [active.job_id]

            def gauge(name: str, doc: str, value: float | None) -> Iterator:
                if value is not None:
                    g = GaugeMetricFamily(name, doc, labels=["job"])
                    g.add_metric(job, value)
                    yield g

            yield from gauge("roundpipe_job_step", "Optimizer steps completed", figures.step)
            yield from gauge(
                "roundpipe_job_total_steps", "Optimizer steps planned", figures.total_steps
            )
            yield from gauge("roundpipe_job_loss", "Training loss of the latest step", figures.loss)
            yield from gauge(
                "roundpipe_job_learning_rate", "Learning rate of the latest step", figures.lr
            )
            yield from gauge(
                "roundpipe_job_tokens_per_second",
                "Training throughput of the latest step",
                figures.tokens_per_s,
            )
            yield from gauge(
                "roundpipe_job_step_seconds", "Seconds between the last two steps", figures.step_s
            )
            yield from gauge(
                "roundpipe_job_optimizer_lag_steps",
                "Steps the pipeline finished that the optimizer has not applied yet",
                figures.optimizer_lag_steps,
            )
            yield from gauge(
                "roundpipe_job_optimizer_lag_seconds",
                "Seconds from the pipeline finishing the newest applied step to the optimizer finishing it",
                figures.optimizer_lag_s,
            )
            yield from gauge(
                "roundpipe_job_bubble_fraction",
                "Measured share of worker time not computing, newest settled step",
                figures.bubble_fraction,
            )
            retries = CounterMetricFamily(
                "roundpipe_job_task_retries",
                "Tasks sent again after a failure or a lost worker",
                labels=["job"],
            )
            retries.add_metric(job, figures.task_retries)
            yield retries
            for direction, values in (
                ("upload", figures.upload_bytes),
                ("download", figures.download_bytes),
            ):
                counter = CounterMetricFamily(
                    f"roundpipe_job_worker_{direction}_bytes",
                    f"Bytes {direction}ed by the job's tasks, per worker",
                    labels=["job", "worker"],
                )
                for worker, nbytes in sorted(values.items()):
                    counter.add_metric([*job, str(worker)], nbytes)
                yield counter

        running = current_tasks(trainer)
        busy_g = GaugeMetricFamily(
            "roundpipe_worker_busy_fraction",
            "Share of the newest settled step the worker spent computing",
            labels=["worker", "name"],
        )
        done_c = CounterMetricFamily(
            "roundpipe_worker_tasks_done", "Tasks completed", labels=["worker", "name"]
        )
        age_g = GaugeMetricFamily(
            "roundpipe_worker_heartbeat_age_seconds",
            "Seconds since the worker was last heard",
            labels=["worker", "name"],
        )
        state_g = GaugeMetricFamily(
            "roundpipe_worker_state", "1 for the worker's state", labels=["worker", "name", "state"]
        )
        for worker_id, name, last_seen in sorted(workers):
            labels = [str(worker_id), name[:64]]
            busy_g.add_metric(labels, busy.get(worker_id, 0.0))
            done_c.add_metric(labels, tasks_done.get(worker_id, 0))
            age_g.add_metric(labels, max(0.0, now - last_seen))
            state = "busy" if worker_id in running else "idle"
            for s in WORKER_STATES:
                state_g.add_metric([*labels, s], 1.0 if s == state else 0.0)
        yield busy_g
        yield done_c
        yield age_g
        yield state_g


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9464`` for IPv6; ``:9464`` for every interface)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--metrics-address {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9464")
    return host.strip("[]") or "0.0.0.0", int(port)


class MetricsServer:
    """Serves ``/metrics`` over HTTP on its own thread (prometheus_client's server)."""

    def __init__(self, coordinator: Coordinator, address: str) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        host, port = parse_address(address)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(CoordinatorCollector(coordinator))
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_port
        log.info("[metrics] serving Prometheus metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
