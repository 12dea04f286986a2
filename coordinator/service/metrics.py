"""Prometheus metrics of the coordinator (``roundpipe-coordinator --metrics-address``).

Nothing is counted on the hot paths for this: when Prometheus scrapes, a custom collector
asks the daemon for a ``MetricsSnapshot`` (the job states, the running job's figures from
roundpipe.coordinator.service.figures, the worker table) and formats it, so a coordinator
nobody scrapes pays nothing. This module knows the snapshot only: neither the daemon nor
the trainer.

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
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import psutil

from roundpipe.coordinator.service.connections import METRICS_CONNECTIONS
from roundpipe.coordinator.service.figures import JobFigures
from roundpipe.protocol import JOB_STATES

__all__ = ["MetricsServer", "MetricsSnapshot", "WorkerFigures", "parse_address"]

log = logging.getLogger(__name__)

WORKER_STATES = ("idle", "busy", "lost")


@dataclass(frozen=True)
class WorkerFigures:
    """One connected worker, as the metrics show it."""

    worker_id: int
    name: str
    heartbeat_age_s: float
    """Seconds since the worker was last heard."""
    tasks_done: int
    busy_fraction: float
    """Share of the newest settled step it spent computing (0 without a running job)."""
    state: str
    """One of WORKER_STATES: "busy" while it runs a task, else "idle"."""


@dataclass(frozen=True)
class MetricsSnapshot:
    """Everything the coordinator exports, read at one moment. The daemon builds it
    (roundpipe.coordinator.service.daemon, ``Coordinator.metrics_snapshot``) under its
    lock; the collector only formats it, so this module reads no coordinator state."""

    jobs_by_state: Mapping[str, int]
    """How many jobs the coordinator knows in each state."""
    arena_bytes: int
    """Bytes of shared-memory arenas the running job holds (0: none)."""
    job_id: str | None = None
    """The running job, if its trainer is prepared (then ``job`` holds its figures)."""
    job: JobFigures | None = None
    workers: tuple[WorkerFigures, ...] = ()
    """The connected workers, by worker id."""


# --------------------------------------------------------------------------- collector


class CoordinatorCollector:
    """A prometheus_client collector that formats the daemon's snapshot at scrape time."""

    def __init__(self, read_snapshot: Callable[[], MetricsSnapshot]) -> None:
        self.read_snapshot = read_snapshot
        self._process = psutil.Process(os.getpid())

    def describe(self) -> list:
        return []  # dynamic label sets: skip registration-time collection

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snapshot = self.read_snapshot()
        jobs = GaugeMetricFamily(
            "roundpipe_jobs", "Jobs the coordinator knows, by state", labels=["state"]
        )
        for state in JOB_STATES:
            jobs.add_metric([state], snapshot.jobs_by_state.get(state, 0))
        yield jobs
        yield GaugeMetricFamily(
            "roundpipe_arena_bytes",
            "Bytes of shared-memory arenas the running job holds",
            value=snapshot.arena_bytes,
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

        figures = snapshot.job
        if figures is not None:
            assert snapshot.job_id is not None
            job = [snapshot.job_id]

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
            yield from gauge(
                "roundpipe_job_loss_scale",
                "float16 loss scaling: the newest scale (the steps assigned one from now on "
                "seed their backward with it)",
                figures.loss_scale,
            )

            def count(name: str, doc: str, value: int) -> CounterMetricFamily:
                counter = CounterMetricFamily(name, doc, labels=["job"])
                counter.add_metric(job, value)
                return counter

            if figures.loss_scale is not None:
                yield count(
                    "roundpipe_job_skipped_steps",
                    "Steps float16 loss scaling skipped (gradients overflowed), this run",
                    figures.skipped_steps,
                )
            yield count(
                "roundpipe_job_task_retries",
                "Tasks sent again after a failure or a lost worker",
                figures.task_retries,
            )
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
        for worker in snapshot.workers:
            labels = [str(worker.worker_id), worker.name[:64]]
            busy_g.add_metric(labels, worker.busy_fraction)
            done_c.add_metric(labels, worker.tasks_done)
            age_g.add_metric(labels, worker.heartbeat_age_s)
            for s in WORKER_STATES:
                state_g.add_metric([*labels, s], 1.0 if s == worker.state else 0.0)
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


METRICS_TIMEOUT_S = 10.0
"""A metrics connection that sends nothing for this long is closed."""

# Note [bounded metrics endpoint]
# prometheus_client's own server starts a thread per connection and never closes an idle
# one: anyone who reaches the port (no key needed) held a thread and a descriptor of the
# coordinator per connection, outside the connection budget (Note [connection budget]),
# until the process ran out of descriptors (a running job paused; on ipc:// libzmq
# aborted the coordinator). Here the endpoint serves at most METRICS_CONNECTIONS at once
# and closes any beyond them as soon as they are accepted, and a connection idle for
# METRICS_TIMEOUT_S is closed. A flood of the metrics port can fail scrapes, nothing
# else; the connection budget leaves the endpoint's descriptors out.


class _QuietHandler(WSGIRequestHandler):
    timeout = METRICS_TIMEOUT_S  # StreamRequestHandler: the socket's timeout

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per scrape on stderr: noise in the coordinator's journal


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """A threaded WSGI server holding at most METRICS_CONNECTIONS connections."""

    daemon_threads = True
    request_queue_size = 64  # the kernel's queue: no descriptor of ours until accepted

    def __init__(self, address: tuple[str, int], family: int) -> None:
        self.address_family = family
        self._slots = threading.BoundedSemaphore(METRICS_CONNECTIONS)
        self.refused = 0
        super().__init__(address, _QuietHandler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: it will not give the slot back
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        pass  # a peer that hung up or timed out: nothing to report


class MetricsServer:
    """Serves ``/metrics`` over HTTP on its own thread, holding a bounded number of
    connections (Note [bounded metrics endpoint])."""

    def __init__(self, read_snapshot: Callable[[], MetricsSnapshot], address: str) -> None:
        from prometheus_client import CollectorRegistry, make_wsgi_app

        host, port = parse_address(address)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(CoordinatorCollector(read_snapshot))
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._server = _BoundedServer((host, port), family)
        self._server.set_app(make_wsgi_app(self.registry))
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="rp-metrics", daemon=True
        )
        self._thread.start()
        self.port = self._server.server_port
        log.info("[metrics] serving Prometheus metrics on http://%s:%d/metrics", host, self.port)

    @property
    def refused(self) -> int:
        """Connections closed at once because METRICS_CONNECTIONS were open."""
        return self._server.refused

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
