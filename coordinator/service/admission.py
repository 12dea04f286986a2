"""Job-spec validation in a child process, so that it can never stall the coordinator.

Validating a spec reads files: the model's ``config.json``, the tokenizer, the whole data
file (to find it empty, not UTF-8, or using token ids the model does not have). In a
thread of the coordinator that work still competes for the GIL with the I/O thread, and
some of it holds the GIL for the whole of one C call (``json.load`` of a large config):
a 60 MB data file of blank lines delayed replies and heartbeats by seconds. In its own
process it delays nothing but the submission it belongs to.

:class:`SpecValidator` keeps one child (started on first use, reused, replaced when it
dies or overruns its time limit). ``validate(spec)`` returns the normalised spec dict
(``JobSpec.to_dict()``) or raises :class:`~roundpipe.coordinator.spec.jobspec.JobSpecError`
with every problem the child found, exactly as ``JobSpec.from_dict`` would have.

Note [forked spec checker]
    A spawned child imports torch and transformers afresh, 3-5 s of CPU for each
    coordinator (the test suite starts hundreds, single-threaded: OMP_NUM_THREADS=1
    and --threads 1), and the first submission waited for it. So ``roundpipe-coordinator`` forks its first child instead (``start(fork=True)``),
    early in ``main``, before the Coordinator exists: forking is safe only while the
    process has a single thread (a lock held by another thread at the fork stays held in
    the child forever), and the coordinator's threads and ZeroMQ context come later.
    Whenever the process is not single-threaded then, and for every replacement (the
    coordinator has threads by then), the child is spawned: so a coordinator started
    with more than one torch thread (as deployed: importing torch starts OpenMP's
    threads) spawns it, as before. ``_forked_child_init`` undoes
    what a forked child inherits that a spawned one would not have.
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

__all__ = [
    "SpecValidator",
    "ValidationUnavailable",
    "check_spec",
    "single_threaded",
    "validate_spec",
]

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


def _open_fds() -> list[int]:
    """The descriptors above stdio open in this process now (the listing's own, closed
    when it returns, is not among them)."""
    listed = [int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2]
    still_open = []
    for fd in listed:
        try:
            os.fstat(fd)
        except OSError:
            continue
        still_open.append(fd)
    return still_open


def single_threaded() -> bool:
    """Whether this process runs one thread, as the kernel counts them (a library's
    native threads, an OpenMP pool, included) and as ``threading`` does."""
    try:
        tasks = len(os.listdir("/proc/self/task"))
    except OSError:
        return False
    return tasks == 1 and threading.active_count() == 1


def _forked_child_init(strict_reads: bool, coordinator_pid: int, inherited_fds: list[int]) -> None:
    """A forked child's start (Note [forked spec checker]): made what a spawned one was,
    then ``_child_init`` as for a spawned one."""
    # A spawned child starts with the default SIGTERM and SIGINT (KeyboardInterrupt)
    # behaviour; a forked one keeps the handlers of the coordinator's main(), which would
    # act on the coordinator's objects here. main() sets them after the fork, but reset
    # any Python handler found, whoever set it. SIGHUP runs main's request_reload until
    # _child_init ignores it, as a spawned child does: it only counts, in this copy.
    for sig, default in (
        (signal.SIGTERM, signal.SIG_DFL),
        (signal.SIGINT, signal.default_int_handler),
    ):
        handler = signal.getsignal(sig)
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, default)
    # A spawned child has stdio and multiprocessing's own pipes only (close_fds); a
    # forked one holds every descriptor the coordinator had at the fork: nothing of its
    # own (the fork precedes its sockets, files and sd_notify socket), but whatever its
    # launcher leaked into it, such as a pipe whose reader waits for end-of-file. They
    # are pointed at /dev/null rather than closed: a number left free could be reused
    # and then closed by a stale Python object owning the old one.
    if inherited_fds:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in inherited_fds:
            if fd != devnull:
                try:
                    os.dup2(devnull, fd)
                except OSError:
                    pass
        os.close(devnull)
    # A spawned child has no logging set up: only warnings reach stderr (logging's
    # last resort). A forked one would log at the coordinator's level into its log, e.g.
    # every checked spec's data summary as if the coordinator had read it; so the same.
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    # atexit hooks registered by the coordinator never run here: a forked
    # multiprocessing child ends with os._exit.
    # Module state main set before the fork (file modes, strict reads, HF_HUB_OFFLINE,
    # the raised open-files limit) is what this child sets or inherits anyway.
    threading.current_thread().name = "MainThread"  # main() renamed it
    _child_init(strict_reads, coordinator_pid)


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
            # spawn, never fork: the coordinator has threads and a ZeroMQ context by now
            # (only main's first start forks: Note [forked spec checker]).
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

    def start(self, *, fork: bool = False) -> bool:
        """Start the child and its imports now (without waiting for them), unless it runs
        already. ``fork``: fork it from this process if that is safe now (Note [forked
        spec checker]), else spawn it. Returns whether the child was forked."""
        with self._lock:
            if self._pool is not None and self._alive(self._pool):
                return False
            forked = False
            try:
                if fork and self._pool is None:
                    forked = self._fork_pool()
                if not forked:
                    self._executor().submit(_warm_up)
            except (BrokenProcessPool, RuntimeError, OSError) as exc:
                # The first validation tries again (and says why if it fails too).
                log.warning("[admission] cannot start the spec-checking process: %s", exc)
                self._discard()
                return False
            return forked

    def _fork_pool(self) -> bool:
        """Fork the child now, if this process is single-threaded; False if not."""
        if not single_threaded():
            log.info("[admission] this process runs threads: the spec checker is spawned")
            return False
        inherited = _open_fds()  # before the pool's own pipes exist
        pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("fork"),
            initializer=_forked_child_init,
            initargs=(self.strict_reads, os.getpid(), inherited),
        )
        # Python 3.11's pool, with the fork context, forks its children inside the first
        # submit(), before it starts its management thread (_start_executor_manager_thread:
        # _launch_processes, then the thread); should a later Python not say so, spawn.
        if getattr(pool, "_safe_to_dynamically_spawn_children", None) is not False:
            pool.shutdown(wait=False)
            return False
        self._pool = pool
        pool.submit(_warm_up)  # the fork, on this thread, the only one
        return True

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
