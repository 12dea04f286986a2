"""Job-spec validation in a child process, so that it can never stall the coordinator.

Validating a spec reads files: the model's ``config.json``, the tokenizer, the whole data
file (to find it empty, not UTF-8, or using token ids the model does not have). In a
thread of the coordinator that work still competes for the GIL with the I/O thread, and
some of it holds the GIL for the whole of one C call (``json.load`` of a large config):
a 60 MB data file of blank lines delayed replies and heartbeats by seconds. In its own
process it delays nothing but the submission it belongs to.

:class:`SpecValidator` keeps one spawned child (started on first use, reused, replaced
when it dies or overruns its time limit). ``validate(spec)`` returns the normalised spec
dict (``JobSpec.to_dict()``) or raises :class:`~roundpipe.coordinator.spec.jobspec.JobSpecError`
with every problem the child found, exactly as ``JobSpec.from_dict`` would have.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Mapping
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, Any

from roundpipe.coordinator.spec.errors import FieldError, JobSpecError
from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.shared.defaults import SPEC_CHECK_TIMEOUT_S

if TYPE_CHECKING:
    from roundpipe.coordinator.planning.hardware import HardwareSpec
    from roundpipe.shared.model import LayeredModel

__all__ = ["SpecValidator", "ValidationUnavailable", "check_spec", "validate_spec"]

log = logging.getLogger(__name__)

VALIDATION_TIMEOUT_S = SPEC_CHECK_TIMEOUT_S
"""Longest one validation may take before its child is killed and the spec refused (the
client waits longer for its answer: SUBMIT_TIMEOUT_S)."""


class ValidationUnavailable(RuntimeError):
    """The validating process died or overran its time limit; the message says which."""


def validate_spec(
    spec: Mapping[str, Any], arena_dir: str | None = None, hardware: HardwareSpec | None = None
) -> JobSpec:
    """Everything a job is checked for before it is accepted: ``JobSpec.from_dict``, then
    the checks that read the whole data file, exactly as the trainer does when the job
    starts (``build_dataset_from_spec``, ``validate_against_model``): an empty dataset,
    bytes that are not UTF-8 or lines that do not parse on any line, token ids beyond
    the model's ``vocab_size``. Without them such a job was accepted and failed once
    started, leaving an empty checkpoints/ directory. Last, the host memory the job
    needs under any plan against what the machine (and ``arena_dir``) has, and, when
    ``hardware`` describes connected GPU workers, whether any plan fits their memory.
    Raises JobSpecError."""
    from roundpipe.coordinator.spec.data import build_dataset_from_spec
    from roundpipe.coordinator.spec.errors import DataError, host_shortage
    from roundpipe.coordinator.spec.jobspec import model_config_from_spec, validate_against_model

    job = JobSpec.from_dict(spec)
    try:
        dataset = build_dataset_from_spec(job)
    except DataError as exc:
        raise JobSpecError([FieldError("data", str(exc))]) from None
    except Exception as exc:
        if host_shortage(exc) is not None:
            raise
        # A library's own error on input nobody foresaw: the submitter still learns
        # which file, not "internal error"; the log keeps the traceback for a bug report.
        log.warning("[admission] reading %s failed unexpectedly", job.data.path, exc_info=True)
        detail = " ".join(str(exc).split())[:500]
        raise JobSpecError(
            [FieldError("data", f"cannot read {job.data.path}: {type(exc).__name__}: {detail}")]
        ) from None
    try:
        config = model_config_from_spec(job.model)
    except Exception as exc:  # transformers raises several types for a bad config
        detail = " ".join(str(exc).split())
        raise JobSpecError([FieldError("model", f"cannot build its config: {detail}")]) from None
    validate_against_model(job, config, vocab_size_needed=dataset.vocab_size_needed)
    from roundpipe.shared.model import LayeredModel

    try:
        model = LayeredModel(config, job.lora.model_settings() if job.lora is not None else None)
    except ValueError as exc:
        # A frozen matrix the quantiser does not know is the base quantisation's problem
        # (Note [quantised base] in roundpipe.shared.quantized_base); anything else the
        # model's.
        field = "lora.base_quantization" if "base_quantization" in str(exc) else "model"
        raise JobSpecError([FieldError(field, str(exc))]) from None
    if job.train.plan:
        from roundpipe.shared.plan import Plan

        try:
            Plan.parse(job.train.plan).validate(model.num_layers)
        except ValueError as exc:
            raise JobSpecError([FieldError("train.plan", str(exc))]) from None
    _check_least_memory(job, model, arena_dir, dataset.nbytes)
    if hardware is not None and hardware.gpu_memory_limited:
        _check_gpu_memory(job, model, hardware)
    return job


def _check_least_memory(
    job: JobSpec, model: LayeredModel, arena_dir: str | None, dataset_bytes: int
) -> None:
    """Refuse a job that cannot fit this machine under any plan (``least_host_memory``,
    its data rows included). The trainer checks the real plan's figure before it
    allocates."""
    from roundpipe.coordinator.training.memory import (
        InsufficientMemory,
        check_host_memory,
        least_host_memory,
    )

    try:
        check_host_memory(
            least_host_memory(model, job, dataset_bytes),
            arena_dir,
            what="this job, whatever its plan,",
        )
    except InsufficientMemory as exc:
        raise JobSpecError([FieldError("", str(exc))]) from None


def _check_gpu_memory(job: JobSpec, model: LayeredModel, hardware: HardwareSpec) -> None:
    """Refuse a job that no plan fits on the connected GPU workers (the planner's cost
    model: each stage's weights, gradients and working memory, plus the prefetched next
    stage, on the smallest GPU). The trainer plans again, for real, when the job starts."""
    import torch

    from roundpipe.coordinator.planning.costs import estimate_costs
    from roundpipe.coordinator.planning.search import (
        evaluate_plan,
        pinned_grain,
        plan_stages,
        runnable_grain,
    )
    from roundpipe.shared.plan import Plan
    from roundpipe.shared.units import format_bytes

    costs = estimate_costs(
        model,
        microbatch_rows=job.batch.microbatch_size,
        seq_len=job.data.seq_len,
        compute_dtype=getattr(torch, job.train.dtype),
        flops_per_s=hardware.flops_per_s,
        on_gpu=hardware.gpu_workers,
    )
    m, limit = job.batch.num_microbatches, hardware.memory_limit_bytes
    where = f"the connected GPU workers ({format_bytes(limit)} each)"
    # At the grain the job will run at: a pinned plan at pinned_grain, the planner's
    # search given the same setting. Priced at stage grain, a pinned layer-grain plan
    # that fits was refused.
    if job.train.plan:
        result = evaluate_plan(
            Plan.parse(job.train.plan),
            costs,
            hardware,
            m,
            staleness=job.train.staleness,
            recompute=pinned_grain(runnable_grain(model, job.train.recompute)),
        )
        need = max(result.per_worker_memory)
        if need > limit:
            raise JobSpecError(
                [
                    FieldError(
                        "train.plan",
                        f"needs about {format_bytes(need)} on one GPU, more than {where} "
                        "have; leave train.plan out to let the planner cut smaller stages, "
                        "or use a shorter data.seq_len or a smaller batch.microbatch_size",
                    )
                ]
            )
        return
    try:
        plan_stages(
            costs,
            hardware,
            m,
            staleness=job.train.staleness,
            recompute=runnable_grain(model, job.train.recompute),
        )
    except ValueError as exc:
        raise JobSpecError([FieldError("", f"cannot run on {where}: {exc}")]) from None


def check_spec(
    spec: Mapping[str, Any], arena_dir: str | None = None, hardware: HardwareSpec | None = None
) -> tuple[dict[str, Any] | None, list[tuple[str, str]]]:
    """What the child runs: ``(normalised spec, [])`` or ``(None, [(path, message)...])``.

    Plain values only cross the process boundary (a JobSpecError does not pickle back
    into itself: its constructor takes the problem list, not the message)."""
    try:
        return validate_spec(spec, arena_dir, hardware).to_dict(), []
    except JobSpecError as exc:
        return None, [(e.path, e.message) for e in exc.errors]
    finally:
        from roundpipe.coordinator.training.memory import release_freed_memory

        release_freed_memory()  # the dataset was built and dropped: give it back


def _exit_with_parent(parent: int, every_s: float = 1.0) -> None:
    """Exit when the coordinator is gone. A SIGKILLed coordinator cannot shut its pool
    down, and the child, reparented, would otherwise live on (holding its memory)."""
    while os.getppid() == parent:
        time.sleep(every_s)
    os._exit(0)


def _child_init(strict_reads: bool, coordinator_pid: int) -> None:
    # The coordinator's pid comes from the coordinator: one that died while this child
    # was still starting has already left it with another parent.
    threading.Thread(
        target=_exit_with_parent, args=(coordinator_pid,), name="rp-parent-watch", daemon=True
    ).start()
    # SIGHUP asks the coordinator to re-read its keys (systemd's ExecReload may send it
    # to the whole group); it must not end the checker.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # The child only reads files; never let it reach the hub or use every core.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from roundpipe.coordinator.spec.paths import set_strict_reads

    set_strict_reads(strict_reads)
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass


def _warm_up() -> None:
    # What every validation imports (seconds on a small machine): done once, when the
    # coordinator starts, not inside the first client's submission.
    import transformers  # noqa: F401

    import roundpipe.coordinator.spec.data  # noqa: F401
    import roundpipe.coordinator.training.layout  # noqa: F401
    import roundpipe.shared.model  # noqa: F401


class SpecValidator:
    """Validates specs in one child process, one at a time."""

    def __init__(
        self,
        arena_dir: str | os.PathLike[str] | None = None,
        timeout_s: float = VALIDATION_TIMEOUT_S,
        *,
        strict_reads: bool = False,
    ) -> None:
        self.arena_dir = None if arena_dir is None else os.fspath(arena_dir)
        # The coordinator gives the child specs whose paths it resolved: the child then
        # opens data files without following links (coordinator.paths.open_for_read).
        self.strict_reads = strict_reads
        self.timeout_s = timeout_s
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        """The pool, started now if there is none; one whose child has died (killed
        while idle: the OOM killer, an operator) is discarded and replaced."""
        if self._pool is not None and not self._alive(self._pool):
            log.warning("[admission] the spec-checking process died; starting a new one")
            self._discard()
        if self._pool is None:
            # spawn, never fork: the coordinator has threads and a ZeroMQ context.
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_child_init,
                initargs=(self.strict_reads, os.getpid()),
            )
        return self._pool

    @staticmethod
    def _alive(pool: concurrent.futures.ProcessPoolExecutor) -> bool:
        """Whether ``pool`` and its child still work. A dead child is found by reaping
        it here, or by the pool's own thread, which marks the pool broken before it
        reaps: so ``_broken`` is read after the children."""
        processes = list((getattr(pool, "_processes", None) or {}).values())
        alive = all(proc.is_alive() for proc in processes)
        return alive and not getattr(pool, "_broken", False)

    def _discard(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.kill()  # an overrunning child would otherwise keep running
        pool.shutdown(wait=False, cancel_futures=True)

    def start(self) -> None:
        """Start the child and its imports now (without waiting for them)."""
        with self._lock:
            try:
                self._executor().submit(_warm_up)
            except (BrokenProcessPool, RuntimeError, OSError) as exc:
                # The first validation tries again (and says why if it fails too).
                log.warning("[admission] cannot start the spec-checking process: %s", exc)
                self._discard()

    def _submit(self, *args: Any) -> concurrent.futures.Future:
        """Submit to the pool; a pool found broken (its child died while idle, after the
        liveness check) is replaced once. Raises ValidationUnavailable if no child can
        be started (e.g. the coordinator is out of file descriptors or memory)."""
        for attempt in (1, 2):
            try:
                return self._executor().submit(*args)
            except (BrokenProcessPool, RuntimeError) as exc:
                self._discard()
                if attempt == 2:
                    raise ValidationUnavailable(
                        f"the process that checks job specs cannot be started ({exc}); "
                        "the spec was not accepted: try again, and see the coordinator's log"
                    ) from None
            except OSError as exc:
                self._discard()
                raise ValidationUnavailable(
                    f"the process that checks job specs cannot be started ({exc}); the spec "
                    "was not accepted: try again in a moment, and see the coordinator's log"
                ) from None
        raise AssertionError("unreachable")

    def validate(
        self, spec: Mapping[str, Any], hardware: HardwareSpec | None = None
    ) -> dict[str, Any]:
        """The normalised spec; ``hardware``: the workers connected now, if any."""
        with self._lock:
            try:
                future = self._submit(check_spec, dict(spec), self.arena_dir, hardware)
                normalised, errors = future.result(timeout=self.timeout_s)
            except concurrent.futures.TimeoutError:
                self._discard()
                raise ValidationUnavailable(
                    f"checking the job spec took longer than {self.timeout_s:.0f} s and was "
                    "stopped; is its data file enormous, or on a hung file system?"
                ) from None
            except BrokenProcessPool:
                self._discard()
                raise ValidationUnavailable(
                    "the process checking the job spec died (out of memory?) before it "
                    "finished; the spec was not accepted"
                ) from None
        if normalised is None:
            raise JobSpecError([FieldError(path, message) for path, message in errors])
        return normalised

    def close(self) -> None:
        with self._lock:
            self._discard()
