"""Transfer/compute overlap of the worker's data path, on CPU through the emulated bus.

One worker (``WorkerCore``, the logic inside ``roundpipe-worker``) runs every task of
several iterations of a Qwen3-shaped job (forward stages, fused tail, backward stages) on
real arenas and a real event table; a thread stands in for the optimizer (it publishes
each layer's version once its gradient is complete, with no arithmetic), so only the
worker's own work is timed. Three runs, side by side:

  compute      the CPU engine: no bus at all (the compute time C of an iteration)
  serial       the emulated bus, every copy waited for where it is issued, no prefetch
               and no look-ahead: transfers, then compute
  overlapped   the emulated bus as the runtime uses it: the next task's weights go up
               while this one computes, microbatch m + 1 while m computes, downloads
               behind compute, TaskDone when the last copy landed

The bus bandwidth is set so that an iteration's transfers take about as long as its
compute (the busier direction's bytes / C), which is where overlap matters most. The lower
bound is taken stage by stage, as the worker overlaps at most one stage ahead: the sum
over tasks of max(task compute, its upload bytes / bandwidth, its download bytes /
bandwidth). (A forward stage moves as many weight bytes as a backward stage with a third
of the compute, so max(total compute, total transfer) is not reachable with one stage
of prefetch; it is printed too.)

Prints a table and last ``RESULT overlap_efficiency=<bound / overlapped>
speedup=<serial / overlapped>``. Target: overlap_efficiency >= 0.85.

Usage: python benchmarks/overlap.py [--iterations 4] [--threads 1] [--smoke]
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import threading
import time
from pathlib import Path

import torch
from common import demo_data_spec

from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.training.trainer import Trainer
from roundpipe.scratch import work_dir
from roundpipe.worker.runtime import WorkerCore
from roundpipe.worker.transfer import CpuEngine, EmulatedEngine


def stage_plan(num_layers: int) -> str:
    """Two layers per stage: several tasks per iteration, each with its own weights."""
    fwd = ",".join(f"{i}:{i + 2}" for i in range(0, num_layers - 2, 2))
    bwd = ",".join(f"{i}:{i + 2}" for i in range(num_layers - 4, -1, -2))
    return f"F[{fwd}] T[{num_layers - 2}:{num_layers}] B[{bwd}]"


def make_spec(out: Path, smoke: bool) -> JobSpec:
    # The smoke run keeps the default's depth, so its stage plan (four forward stages, the
    # tail, four backward stages) and shared gradient slots take the default's code paths.
    hidden, layers, seq = (128, 8, 128) if smoke else (512, 8, 512)
    config = {
        "hidden_size": hidden,
        "intermediate_size": hidden * 11 // 4,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": hidden // 8,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
    }
    return demo_data_spec(
        config,
        out,
        steps=100,
        seq_len=seq,
        microbatch_size=1,
        num_microbatches=4,
        staleness=0,
        train={"plan": stage_plan(layers + 2), "replan": False},
    )


class Bench:
    """A prepared job whose iterations one WorkerCore runs, with the optimizer faked."""

    def __init__(self, root: Path, arena_dir: Path, smoke: bool) -> None:
        spec = make_spec(root / "out", smoke)
        self.trainer = Trainer(
            "overlap",
            spec,
            arena_dir=arena_dir,
            namespace=f"overlap{id(self)}",
            output_dir=root / "out",
            wait_timeout_s=120,
        )
        self.trainer.prepare(1)
        self.layout = self.trainer.layout
        self.next_iteration = 1
        self.next_task = 0
        self._stop = threading.Event()
        self._optimizer = threading.Thread(
            target=self._publish_versions, name="bench-optimizer", daemon=True
        )
        self._optimizer.start()

    def _publish_versions(self) -> None:
        """The optimizer, without the arithmetic: each layer's version k is published as
        soon as its step-k gradient is complete, last layers first, as the real one does
        (Note [weight-update ordering]). Publishing them once per iteration instead would
        deadlock a model deep enough to share gradient slots between layers (Note
        [gradient buffer]): a backward task then waits for another layer's version within
        its own iteration."""
        events, counters = self.layout.events, self.layout.counters
        layers = sorted(self.layout.trainable_layers(), reverse=True)
        k = 1
        try:
            while not self._stop.is_set():
                for layer in layers:
                    events.wait_at_least(
                        counters.wgrad(layer), k, 600, should_abort=self._stop.is_set
                    )
                    events.signal(counters.version(layer), k)
                k += 1
        except InterruptedError:
            pass  # closed

    def iteration_tasks(self):
        k = self.next_iteration
        self.next_iteration += 1
        layout = self.layout
        batch = self.trainer.loader.batch_for_step(k)
        layout.write_batch(k % 2, batch)
        for m in range(layout.num_microbatches):
            layout.events.signal(layout.counters.act(0, m), k)
        tasks = self.trainer.schedule.tasks(k, batch.num_label_tokens, self.next_task)
        self.next_task += len(tasks)
        return tasks

    def run(self, core: WorkerCore, iterations: int, overlapped: bool) -> tuple[float, list]:
        core.overlap = overlapped
        queue: list = []
        core.peek_next = lambda: queue[0] if queue else None
        dones: list = []
        landed = threading.Semaphore(0)

        def deliver(result) -> None:
            if isinstance(result, BaseException):
                raise result
            dones.append(result)
            landed.release()

        started = time.perf_counter()
        count = 0
        queue.extend(self.iteration_tasks())
        for i in range(iterations):
            current = len(queue)
            # The next iteration's tasks queue up once this one starts, as the trainer
            # dispatches them, so this iteration's last task prefetches the next's first.
            if i + 1 < iterations:
                queue.extend(self.iteration_tasks())
            for _ in range(current):
                task = queue.pop(0)
                count += 1
                if overlapped:
                    core.start_task(task, deliver)
                else:
                    dones.append(core.run_task(task))
        if overlapped:
            for _ in range(count):
                if not landed.acquire(timeout=600):
                    raise TimeoutError("a task's copies never landed")
        return (time.perf_counter() - started) / iterations, dones

    def close(self) -> None:
        self._stop.set()
        self._optimizer.join(timeout=10)
        self.trainer.close()


def measure(root: Path, arena_dir: Path, smoke: bool, engine, iterations: int, overlapped: bool):
    bench = Bench(root, arena_dir, smoke)
    core = WorkerCore(0, transfer=engine())
    try:
        core.setup_job(bench.trainer.job_setup())
        bench.run(core, 1, overlapped)  # warm-up iteration
        return bench.run(core, iterations, overlapped)
    finally:
        core.close()
        bench.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch compute threads")
    parser.add_argument("--latency", type=float, default=10e-6, help="seconds per copy")
    parser.add_argument(
        "--smoke", action="store_true", help="a narrow model of the same depth, for the tests"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # Two timed iterations, not one: only then does an iteration's last task see the next
    # iteration's first one queued behind it and prefetch its weights, as in the default.
    iterations = 2 if args.smoke else args.iterations
    with work_dir("rp-overlap-") as root:
        arena_dir = Path(tempfile.mkdtemp(prefix="rp-overlap-", dir="/dev/shm"))
        try:
            compute_s, computed = measure(
                root / "c", arena_dir, args.smoke, CpuEngine, iterations, False
            )
            # Bytes per iteration, from a run on a bus too fast to matter.
            fast = functools.partial(EmulatedEngine, 1e12, latency_s=0.0)
            _, dones = measure(root / "b", arena_dir, args.smoke, fast, 1, False)
            up = sum(d.upload_bytes for d in dones)
            down = sum(d.download_bytes for d in dones)
            bandwidth = max(up, down) / compute_s
            # Chunks of about 2 ms on the bus: a GPU's 8 MB chunks at 25 GB/s are 0.3 ms,
            # small beside a stage; a slow emulated bus needs smaller ones to match.
            chunk = max(4096, int(bandwidth * 2e-3))
            bus = functools.partial(
                EmulatedEngine, bandwidth, latency_s=args.latency, chunk_bytes=chunk
            )
            serial_s, _ = measure(root / "s", arena_dir, args.smoke, bus, iterations, False)
            overlapped_s, _ = measure(root / "o", arena_dir, args.smoke, bus, iterations, True)
        finally:
            for f in arena_dir.iterdir():
                f.unlink()
            arena_dir.rmdir()
    per_task = [d.compute_s for d in computed[: len(dones)]]
    bound = sum(
        max(c, d.upload_bytes / bandwidth, d.download_bytes / bandwidth)
        for c, d in zip(per_task, dones)
    ) * (compute_s / max(sum(per_task), 1e-9))  # tasks' compute_s omit Python around them
    total_bound = max(compute_s, up / bandwidth, down / bandwidth)
    print(
        f"one worker, {len(dones)} tasks per iteration, {iterations} timed iteration(s); "
        f"bus {bandwidth / 1e6:.1f} MB/s per direction, latency {args.latency * 1e6:.0f} us; "
        f"per iteration {up / 1e6:.2f} MB up, {down / 1e6:.2f} MB down"
    )
    print(f"{'run':34} {'s/iteration':>12} {'vs bound':>9}")
    rows = [
        ("compute only (no bus)", compute_s),
        ("max(compute, transfer), whole", total_bound),
        ("bound: per stage max(c, t)", bound),
        ("serial (transfers, then compute)", serial_s),
        ("overlapped (the runtime)", overlapped_s),
    ]
    for name, value in rows:
        print(f"{name:34} {value:12.3f} {value / bound:9.2f}")
    print(
        f"RESULT overlap_efficiency={bound / overlapped_s:.2f} speedup={serial_s / overlapped_s:.2f}"
    )


if __name__ == "__main__":
    main()
