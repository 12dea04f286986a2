"""What the end-to-end benchmarks share: the runtime as real daemons, a single-process
reference loop, and per-process GPU memory sampling.

Imported by ``benchmarks/cpu_overhead.py`` and ``benchmarks/gpu_throughput.py`` (run as
scripts, so this directory is on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from roundpipe.client import RoundPipeError
from roundpipe.cluster import LocalCluster
from roundpipe.coordinator.spec.data import DataLoader, build_dataset_from_spec
from roundpipe.coordinator.spec.jobspec import JobSpec, model_config_from_spec
from roundpipe.coordinator.spec.paths import DEMO_DATA_DIR, spec_read_dirs
from roundpipe.protocol import ProgressEvent
from roundpipe.shared.model import LayeredModel, count_label_tokens


@dataclass
class RuntimeRun:
    """What one job through the daemons measured."""

    tokens_per_s: float
    step_s: list[float]
    """Seconds of each timed step (after warm-up), from the job's progress events."""
    plan: str
    job_log: Path
    """The job's log in the coordinator's state directory."""
    gpu_peak_mib: dict[int, float] = field(default_factory=dict)
    """Peak GPU memory per worker process (MiB, from nvidia-smi; empty without a GPU)."""
    losses: dict[int, float] = field(default_factory=dict)
    """Loss of every reported step."""


class GpuMemorySampler:
    """Samples ``nvidia-smi``'s per-process GPU memory every ``period_s`` in a thread and
    keeps each process's peak. Does nothing where nvidia-smi is missing."""

    def __init__(self, period_s: float = 0.2):
        self.period_s = period_s
        self.peak_mib: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.available = shutil.which("nvidia-smi") is not None

    def __enter__(self) -> GpuMemorySampler:
        if self.available:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"]
        while not self._stop.wait(self.period_s):
            try:
                out = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                continue
            for line in out.splitlines():
                parts = [p.strip() for p in line.split(",")]
                if len(parts) != 2 or not parts[0].isdigit():
                    continue
                mib = float(parts[1].split()[0]) if parts[1].split() else 0.0
                pid = int(parts[0])
                self.peak_mib[pid] = max(self.peak_mib.get(pid, 0.0), mib)


def demo_data_spec(
    config: dict,
    out: Path,
    *,
    steps: int,
    seq_len: int,
    microbatch_size: int,
    num_microbatches: int,
    staleness: int = 1,
    train: dict | None = None,
    output: dict | None = None,
) -> JobSpec:
    """A Qwen3-shaped job of ``config`` on the shipped demo corpus and tokenizer, fp32,
    constant lr 1e-4 (the benchmarks' common job); ``train`` / ``output`` add keys. The
    corpus is the installed package's (``DEMO_DATA_DIR``, which its coordinator may read),
    not this checkout's: they differ where the checkout is installed elsewhere, as
    scripts/gpu_check.sh does on the GPU machine."""
    return JobSpec.from_dict(
        {
            "model": {
                "architecture": "qwen3",
                "config": config,
                "init_seed": 0,
                "tokenizer": str(DEMO_DATA_DIR / "tokenizer"),
            },
            "data": {
                "path": str(DEMO_DATA_DIR / "demo_corpus.jsonl"),
                "seq_len": seq_len,
                "seed": 1,
            },
            "batch": {"microbatch_size": microbatch_size, "num_microbatches": num_microbatches},
            "train": {
                "steps": steps,
                "staleness": staleness,
                "dtype": "float32",
                "seed": 0,
                **(train or {}),
            },
            "optimizer": {"lr": 1e-4, "schedule": "constant"},
            "output": {"dir": str(out), **(output or {})},
        }
    )


def run_runtime(
    spec: JobSpec,
    worker_args: Sequence[Sequence[str]],
    *,
    warmup: int,
    root: Path,
    coordinator_threads: int,
    env: dict[str, str] | None = None,
    timeout_s: float = 3600,
    stop_after: int | None = None,
    coordinator_args: Sequence[str] = (),
    while_running: Callable[[LocalCluster], None] | None = None,
) -> RuntimeRun:
    """Start a ``LocalCluster`` with one worker per entry of ``worker_args`` (device
    options, e.g. ``["--cpu", "--threads", "1"]`` or ``["--gpu", "0", "--memory-limit",
    "24GiB"]``), run ``spec`` on it (:func:`run_job`) and stop it: fresh processes for
    one job, as a GPU memory peak must be measured. ``coordinator_args`` go to the
    coordinator."""
    with runtime_cluster(
        worker_args,
        root=root,
        coordinator_threads=coordinator_threads,
        env=env,
        coordinator_args=coordinator_args,
        allow_read=spec_read_dirs(spec),
        allow_write=[Path(spec.output.dir or root).parent],
    ) as cluster:
        return run_job(
            cluster,
            spec,
            warmup=warmup,
            timeout_s=timeout_s,
            stop_after=stop_after,
            while_running=while_running,
        )


@contextlib.contextmanager
def runtime_cluster(
    worker_args: Sequence[Sequence[str]],
    *,
    root: Path,
    coordinator_threads: int,
    env: dict[str, str] | None = None,
    coordinator_args: Sequence[str] = (),
    allow_read: Sequence[Path] = (),
    allow_write: Sequence[Path] = (),
) -> Iterator[LocalCluster]:
    """A coordinator and one worker per entry of ``worker_args``, connected, stopped
    afterwards: for several jobs in a row where a benchmark times steps only (workers are
    stateless; each job's warm-up steps absorb what an earlier job left warm). Its jobs
    may read below ``allow_read`` and write below ``allow_write``."""
    arena_dir = Path(tempfile.mkdtemp(prefix="rp-bench-", dir="/dev/shm"))
    cluster = LocalCluster(
        root,
        arena_dir,
        coordinator_args=[
            "--threads",
            str(coordinator_threads),
            "--log-level",
            "WARNING",
            *coordinator_args,
        ],
        client_timeout_s=60,
        env=env,
        allow_read=allow_read,
        allow_write=allow_write,
    )
    try:
        for i, device in enumerate(worker_args):
            cluster.add_worker(f"w{i}", device=device)
        cluster.wait_for_workers(len(worker_args), timeout_s=300)
        yield cluster
    finally:
        cluster.stop(timeout_s=60)
        shutil.rmtree(arena_dir, ignore_errors=True)


def run_job(
    cluster: LocalCluster,
    spec: JobSpec,
    *,
    warmup: int,
    timeout_s: float = 3600,
    stop_after: int | None = None,
    while_running: Callable[[LocalCluster], None] | None = None,
    on_progress: Callable[[ProgressEvent], None] | None = None,
) -> RuntimeRun:
    """Run ``spec`` on ``cluster`` and measure the steps after ``warmup``: to the end, or
    with ``stop_after`` until that step, then cancel the job (a large model's final
    checkpoint would cost minutes and tens of GB of disk). ``while_running(cluster)`` is
    called once the job is submitted (e.g. to start a metrics scraper), ``on_progress``
    with each progress event as it arrives."""
    with GpuMemorySampler() as memory:
        job = cluster.client.submit(spec)
        if while_running is not None:
            while_running(cluster)
        events = []
        for event in job.progress(timeout_s=timeout_s):
            events.append(event)
            if on_progress is not None:
                on_progress(event)
            if stop_after is not None and event.step >= stop_after:
                try:
                    job.cancel()
                except RoundPipeError as exc:  # it ended meanwhile (its last step)
                    if exc.code != "bad_state":
                        raise
                break
        status = job.wait(timeout_s=600)
    ended_well = {"succeeded", "cancelled"} if stop_after is not None else {"succeeded"}
    if status.state not in ended_well:
        raise RuntimeError(
            f"benchmark job {status.state}: {status.message}; logs in {cluster.root}"
        )
    times = {e.step: e.time for e in events}
    timed = [k for k in sorted(times) if k > warmup and k - 1 in times]
    if not timed:
        raise RuntimeError(f"no step after the {warmup} warm-up steps was reported")
    step_s = [times[k] - times[k - 1] for k in timed]
    tokens = spec.global_batch_size * spec.data.seq_len * len(step_s)
    worker_pids = {d.proc.pid for d in cluster.workers.values()}
    return RuntimeRun(
        tokens_per_s=tokens / sum(step_s),
        step_s=step_s,
        plan=status.plan,
        gpu_peak_mib={pid: v for pid, v in memory.peak_mib.items() if pid in worker_pids},
        losses={e.step: e.loss for e in events},
        job_log=cluster.state_dir / "jobs" / job.job_id / "job.log",
    )


def plain_loop(
    spec: JobSpec,
    *,
    warmup: int,
    device: str = "cpu",
    threads: int | None = None,
    activation_checkpointing: bool = True,
) -> float:
    """Tokens/s of a plain single-process loop on ``spec``'s model, data and batch: one
    transformers (peft) model with random weights in ``train.dtype`` on ``device``,
    gradient checkpointing (the same full recomputation the runtime does), microbatch
    accumulation and torch's fused AdamW. Raises torch.OutOfMemoryError if it does not
    fit."""
    if threads is not None:
        torch.set_num_threads(threads)
    lora = spec.lora.model_settings() if spec.lora is not None else None
    layered = LayeredModel(model_config_from_spec(spec.model), lora)
    dtype = getattr(torch, spec.train.dtype)
    model = layered.hf_model(seed=0).to(device=device, dtype=dtype)
    if activation_checkpointing:
        model.gradient_checkpointing_enable()
        if lora is not None:
            model.enable_input_require_grads()
    model.config.use_cache = False
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=spec.optimizer.lr, fused=True)
    loader = DataLoader.from_spec(spec, build_dataset_from_spec(spec))
    tokens = spec.global_batch_size * spec.data.seq_len
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    start = None
    for k in range(1, spec.train.steps + 1):
        if k == warmup + 1:
            synchronize()
            start = time.perf_counter()
        batch = loader.batch_for_step(k)
        for (ids, labels), pos in zip(batch.microbatches, batch.microbatch_position_ids):
            ids, labels, pos = ids.to(device), labels.to(device), pos.to(device)
            loss = model(input_ids=ids, labels=labels, position_ids=pos).loss
            (loss * count_label_tokens(labels) / batch.num_label_tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    synchronize()
    assert start is not None, "steps must exceed warmup"
    return tokens * (spec.train.steps - warmup) / (time.perf_counter() - start)
