"""``roundpipe chaos``: break things during a real job; the result must not change.

Runs a job once without faults (the reference), then again on a local cluster while
injecting faults, and checks that the final weights are *bitwise* equal to the reference
(CPU workers, fp32, one thread each: every task computes the same bytes wherever it runs).

Faults (``FaultSpec``):

- ``kill`` / ``stop`` at a random moment: SIGKILL (a crash) or SIGSTOP (a hang: the
  coordinator detects the missing heartbeats and fences the process) of a random worker,
  after which a replacement worker is started, as systemd would;
- ``point``: a worker restarted with ``ROUNDPIPE_FAULT`` (worker.faults) that kills or
  freezes itself at a chosen step, task kind and microbatch;
- ``coordinator``: SIGKILL of the coordinator at a random moment, then a restart on the
  same state directory: the job resumes from its last checkpoint (docs/checkpoints.md).

Every random choice comes from ``random.Random(seed)``; the seed is printed so a failing
run can be replayed exactly (``--seed``). Recovery time (fault to the next completed
task, from the coordinator's ``[recovery]`` log lines) is reported per fault.
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from roundpipe.client import JobRejected, RoundPipeError
from roundpipe.cluster import LocalCluster
from roundpipe.coordinator.spec.errors import JobSpecError
from roundpipe.coordinator.spec.jobspec import JobSpec, load_job_spec
from roundpipe.coordinator.spec.paths import spec_read_dirs

__all__ = ["ChaosReport", "FaultSpec", "main", "random_faults", "run_chaos"]

_RECOVERY_RE = re.compile(
    r"^(?P<stamp>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*\[recovery\] first task "
    r"completed (?P<after>[0-9.]+)s after worker (?P<w>\d+) was lost",
    re.MULTILINE,
)


@dataclass(frozen=True)
class FaultSpec:
    kind: str  # "kill" | "stop" | "point" | "coordinator"
    at_fraction: float = 0.5  # when: once this fraction of the job's steps has completed
    point: str | None = None  # for kind "point": a ROUNDPIPE_FAULT value

    def __str__(self) -> str:
        if self.kind == "point":
            return f"point {self.point}"
        return f"{self.kind} at {self.at_fraction:.0%} of the steps"


@dataclass
class TrialResult:
    faults: list[FaultSpec]
    seed: int
    identical: bool
    state: str
    message: str
    seconds: float
    recovery_s: list[float] = field(default_factory=list)
    injected: int = 0  # faults that fired while the job was still running
    # For a trial that differs: which tensors, and the coordinator's account of the
    # trial (losses, lost and fenced workers, re-dispatches), so a rare failure seen
    # once in CI can be understood from its report alone.
    detail: str = ""


@dataclass
class ChaosReport:
    reference_s: float
    trials: list[TrialResult]

    @property
    def injected(self) -> int:
        return sum(t.injected for t in self.trials)

    @property
    def ok(self) -> bool:
        return all(t.identical and t.state == "succeeded" for t in self.trials)

    def table(self) -> str:
        rows = [
            f"{'trial':>5} {'seed':>6} {'faults':60} {'state':10} {'bitwise':8} {'fired':>5} "
            "recovery_s"
        ]
        for i, t in enumerate(self.trials):
            faults = "; ".join(map(str, t.faults))
            rec = ", ".join(f"{r:.2f}" for r in t.recovery_s) or "-"
            rows.append(
                f"{i:>5} {t.seed:>6} {faults[:60]:60} {t.state:10} "
                f"{'equal' if t.identical else 'DIFFERS':8} {t.injected:>5} {rec}"
            )
        rows += [f"trial {i}: {t.detail}" for i, t in enumerate(self.trials) if t.detail]
        return "\n".join(rows)


def random_faults(
    rng: random.Random,
    count: int,
    spec: JobSpec,
    *,
    allow_stop: bool = True,
    allow_point: bool = True,
) -> list[FaultSpec]:
    kinds = ["kill"] + (["stop"] if allow_stop else []) + (["point"] if allow_point else [])
    faults = []
    for _ in range(count):
        kind = rng.choice(kinds)
        if kind == "point":
            action = rng.choice(["kill", "stop"]) if allow_stop else "kill"
            task_kind = rng.choice(["forward", "tail", "backward"])
            iteration = rng.randint(1, max(1, spec.train.steps - 1))
            mb = rng.randrange(spec.batch.num_microbatches)
            point = f"{action}@iteration={iteration},kind={task_kind},mb={mb}"
            faults.append(FaultSpec("point", point=point))
        else:
            faults.append(FaultSpec(kind, at_fraction=rng.uniform(0.1, 0.7)))
    return faults


def _load_weights(directory: Path) -> dict:
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(directory.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return weights


def _bitwise_equal(a: Path, b: Path) -> bool:
    return not _differences(a, b)


def _differences(a: Path, b: Path) -> list[str]:
    """The tensors whose bits differ between two exported models (empty: identical),
    each with its largest absolute difference."""
    wa, wb = _load_weights(a), _load_weights(b)
    if wa.keys() != wb.keys():
        return [f"different tensor names: {sorted(wa.keys() ^ wb.keys())[:5]}"]
    out = []
    for k in sorted(wa):
        x, y = wa[k], wb[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            out.append(f"{k}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
        elif not bool((x.view(-1) == y.view(-1)).all()):
            diff = (x.float() - y.float()).abs().max().item()
            count = int((x.view(-1) != y.view(-1)).sum())
            out.append(f"{k}: {count} of {x.numel()} elements differ, max |diff| {diff:.3g}")
    return out


def _with_output(spec: JobSpec, out: Path, plan: str | None) -> JobSpec:
    raw = spec.to_dict()
    raw["output"]["dir"] = str(out)
    if plan is not None:
        raw["train"]["plan"] = plan
    return JobSpec.from_dict(raw)


def run_chaos(
    spec: JobSpec,
    *,
    root: Path,
    arena_dir: Path,
    num_workers: int = 3,
    trials: list[list[FaultSpec]],
    seeds: list[int],
    worker_timeout_s: float = 2.0,
    say: Callable[[str], None] = print,
    min_injected: int = 0,
    more: Callable[[int], tuple[list[FaultSpec], int]] | None = None,
    max_trials: int = 50,
    worker_args: Sequence[str] = (),
) -> ChaosReport:
    """Reference run, then one job per trial with that trial's faults injected.

    With ``min_injected`` and ``more(i) -> (faults, seed)``, trials are added until that
    many faults have fired mid-job (a fault can miss: the job may end first, or an armed
    worker never runs the matching task), at most ``max_trials`` in all. ``worker_args``
    go to every worker (e.g. ``--emulate-pcie 2GB/s``: asynchronous copies under faults).
    """
    from roundpipe.coordinator.spec.jobspec import model_config_from_spec
    from roundpipe.coordinator.training.trainer import default_plan

    # Pin the plan: the reference and the faulty runs must cut the model identically,
    # whatever number of workers happens to be connected when a job starts.
    layers = int(model_config_from_spec(spec.model).num_hidden_layers) + 2
    plan = str(default_plan(layers, num_workers))
    cluster = LocalCluster(
        root,
        arena_dir,
        coordinator_args=["--worker-timeout", str(worker_timeout_s)],
        worker_args=worker_args,
        allow_read=spec_read_dirs(spec),
        allow_write=[root],
    )
    fleet = _Fleet(cluster, num_workers)
    try:
        fleet.keep()
        cluster.wait_for_workers(num_workers)
        started = time.monotonic()
        reference = _with_output(spec, root / "reference", plan)
        status = cluster.client.submit(reference).wait(timeout_s=1800)
        if status.state != "succeeded":
            raise RuntimeError(f"reference run {status.state}: {status.message}\n{cluster.logs()}")
        reference_s = time.monotonic() - started
        say(f"chaos: reference run {reference_s:.1f}s, plan {plan}")
        results: list[TrialResult] = []
        planned = list(zip(trials, seeds))
        index = 0
        while index < len(planned) or (
            more is not None
            and sum(r.injected for r in results) < min_injected
            and index < max_trials
        ):
            if index >= len(planned):
                planned.append(more(index))
            faults, seed = planned[index]
            results.append(_trial(fleet, spec, plan, faults, seed, index, reference_s, root))
            r = results[-1]
            say(
                f"chaos: trial {index} seed {seed}: {'; '.join(map(str, faults))} -> "
                f"{r.state}, {'bitwise equal' if r.identical else 'DIFFERENT'}; "
                f"{r.injected} fired mid-job; recovery "
                f"{', '.join(f'{x:.2f}s' for x in r.recovery_s) or '-'}"
            )
            index += 1
        return ChaosReport(reference_s, results)
    finally:
        leaked = cluster.stop()
        if leaked:
            say(f"chaos: arenas left behind: {leaked}")


def _trial(
    fleet: _Fleet,
    spec: JobSpec,
    plan: str,
    faults: list[FaultSpec],
    seed: int,
    index: int,
    reference_s: float,
    root: Path,
) -> TrialResult:
    cluster = fleet.cluster
    rng = random.Random(seed)
    # Point faults live inside a worker: restart one worker with the fault armed.
    armed = []
    for fault in faults:
        if fault.kind == "point":
            # Never replace a worker armed for this trial: its fault would be lost, and
            # its exit counted as a fault that fired. With every worker armed, one more
            # joins.
            unarmed = [n for n in fleet.running() if n not in {d.name for d in armed}]
            if unarmed:
                victim = rng.choice(unarmed)
                cluster.signal_worker(victim, signal.SIGTERM)
                cluster.workers[victim].proc.wait(timeout=60)
                del cluster.workers[victim]
            armed.append(fleet.add(fault=fault.point))
    fleet.keep()
    # An armed worker must be listed before the job starts, and the worker it replaced
    # gone: otherwise round-robin may hand the armed one no task of its fault's iteration
    # (on a loaded machine it can join that late) and the point never fires.
    cluster.wait_for_workers(fleet.count, exactly=fleet.running() if armed else None)
    log_mark = _log_size(cluster)
    out = root / f"trial-{index}"
    handle = cluster.client.submit(_with_output(spec, out, plan))
    started = time.monotonic()
    injected_at: list[float] = []  # wall-clock times of faults that fired mid-job
    injected = 0

    for fault in sorted((f for f in faults if f.kind != "point"), key=lambda f: f.at_fraction):
        # Fire once the job has completed this fraction of its steps: wall-clock timing
        # would miss short jobs whose start-up overhead dominates.
        target = max(1, int(fault.at_fraction * spec.train.steps))
        if not _wait_for_step(
            cluster, handle.job_id, target, max(600.0, 20 * reference_s), fleet.keep
        ):
            continue  # the job ended first: this fault did not happen
        if fault.kind == "coordinator":
            cluster.coordinator.proc.send_signal(signal.SIGKILL)
            cluster.coordinator.proc.wait()
            injected_at.append(time.time())
            cluster.start_coordinator()
            injected += 1
            continue
        victim = rng.choice(fleet.running())
        if fault.kind == "stop":
            fleet.freeze(victim)
        else:
            cluster.signal_worker(victim, signal.SIGKILL)
        injected_at.append(time.time())
        injected += 1
        # As systemd would: a replacement starts (the frozen one is fenced by the
        # coordinator once its heartbeats stop).
        fleet.add()
    status = _wait(
        cluster,
        handle.job_id,
        timeout_s=max(600.0, 20 * reference_s),
        keep=fleet.keep,
    )
    # A point fault fired if its armed worker is gone (it killed itself, or froze itself
    # and was fenced); otherwise that worker never ran the matching task.
    injected += sum(1 for daemon in armed if not daemon.alive())
    fleet.keep()
    differences = _differences(root / "reference", out) if status.state == "succeeded" else []
    identical = status.state == "succeeded" and not differences
    detail = ""
    if differences:
        detail = (
            f"{len(differences)} tensors differ: {'; '.join(differences[:8])}\n"
            f"coordinator log of the trial:\n{_trial_events(cluster, log_mark)}"
        )
    return TrialResult(
        faults,
        seed,
        identical,
        status.state,
        status.message,
        time.monotonic() - started,
        _recoveries(cluster, log_mark, injected_at),
        injected,
        detail,
    )


def _trial_events(cluster: LocalCluster, mark: int, limit: int = 80) -> str:
    """The coordinator's log lines of a trial about steps, workers and tasks."""
    try:
        text = cluster.coordinator.log_path.read_text(errors="replace")[mark:]
    except OSError:
        return "(no log)"
    keep = ("step", "lost", "fenced", "dropped", "recovery", "re-", "attempt", "joined")
    lines = [line for line in text.splitlines() if any(k in line for k in keep)]
    return "\n".join(lines[-limit:])


def _wait_for_step(
    cluster: LocalCluster, job_id: str, step: int, timeout_s: float, keep: Callable[[], None]
) -> bool:
    """Wait until the job has completed ``step`` steps; False if it ended before.
    ``keep()`` replaces workers that died meanwhile (as systemd would): without it, a job
    whose workers were all lost before this step would wait for one forever."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        keep()
        status = cluster.client.job(job_id).status()
        if status.state in ("succeeded", "failed", "cancelled", "paused"):
            return False
        if status.step >= step:
            return True
        time.sleep(0.02)
    raise TimeoutError(
        f"job {job_id} did not reach step {step} in {timeout_s:.0f}s\n{cluster.logs()}"
    )


def _wait(cluster: LocalCluster, job_id: str, timeout_s: float, keep=None):
    """Wait for a final state, tolerating a coordinator that is restarting; ``keep()``
    replaces dead workers meanwhile (as systemd's Restart=always would: a worker that
    killed itself at an injected point must not leave the job without workers)."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if keep is not None:
            keep()
        try:
            status = cluster.client.job(job_id).status()
            if status.state in ("succeeded", "failed", "cancelled", "paused"):
                return status
        except Exception as exc:  # the coordinator may be between a kill and a restart
            last_error = exc
        time.sleep(0.2)
    raise TimeoutError(
        f"job {job_id} did not finish in {timeout_s:.0f}s ({last_error})\n{cluster.logs()}"
    )


class _Fleet:
    """The workers of one chaos run, kept at ``count`` as systemd would keep them.

    ``frozen`` names the workers this run stopped with SIGSTOP: the coordinator fences
    (SIGKILLs) them once their heartbeats stop; until then they look alive but are never
    picked or counted. It belongs to the run: names repeat from run to run (``chaos-w3``
    in every run), so a name frozen by one run must not hide the next run's worker."""

    def __init__(self, cluster: LocalCluster, count: int) -> None:
        self.cluster = cluster
        self.count = count
        self.frozen: set[str] = set()
        self._names = iter(f"chaos-w{i}" for i in range(10_000))

    def add(self, fault: str | None = None):
        return self.cluster.add_worker(next(self._names), fault=fault)

    def running(self) -> list[str]:
        return [n for n, d in self.cluster.workers.items() if d.alive() and n not in self.frozen]

    def freeze(self, name: str) -> None:
        self.frozen.add(name)
        self.cluster.signal_worker(name, signal.SIGSTOP)

    def keep(self) -> None:
        """Forget workers that exited and start replacements up to ``count``."""
        for name, daemon in list(self.cluster.workers.items()):
            if not daemon.alive():
                del self.cluster.workers[name]
                self.frozen.discard(name)
        while len(self.running()) < self.count:
            self.add()


def _log_size(cluster: LocalCluster) -> int:
    try:
        return cluster.coordinator.log_path.stat().st_size
    except OSError:
        return 0


def _recoveries(cluster: LocalCluster, mark: int, injected_at: list[float]) -> list[float]:
    """Seconds from each fault to the next task completed after its loss was handled
    (the coordinator logs that moment; see coordinator.recovery)."""
    import datetime

    try:
        text = cluster.coordinator.log_path.read_text(errors="replace")[mark:]
    except OSError:
        return []
    completed = sorted(
        datetime.datetime.strptime(m["stamp"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for m in _RECOVERY_RE.finditer(text)
    )
    out = []
    for fault_time in injected_at:
        after = [t for t in completed if t >= fault_time]
        if after:
            out.append(after[0] - fault_time)
    return out


PROG = "roundpipe chaos"


def _count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def _fault_point(text: str) -> str:
    """An argparse type: a ROUNDPIPE_FAULT value the workers will accept."""
    from roundpipe.worker.faults import parse_fault

    try:
        parse_fault(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _bandwidth(text: str) -> str:
    """An argparse type: a positive bandwidth the workers' --emulate-pcie accepts."""
    from roundpipe.shared.units import parse_quantity

    try:
        ok = parse_quantity(text, what="--emulate-pcie") > 0
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not ok:
        raise argparse.ArgumentTypeError(f"expected a positive bandwidth, got {text!r}")
    return text


def _error(message: str, status: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    """``roundpipe chaos``. A user's mistake (arguments, the spec, the work directory, a
    spec the coordinator refuses) is one message on stderr and exit status 2 (1 for the
    work directory), never a traceback; 0 when every trial is bitwise equal, else 1."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run a job with injected worker/coordinator faults and check the result "
        "is bitwise equal to a fault-free run (CPU workers).",
    )
    parser.add_argument("spec", help="job spec YAML (keep it small: it runs 1 + trials times)")
    parser.add_argument("--workers", type=_count(1), default=3)
    parser.add_argument("--trials", type=_count(1), default=5)
    parser.add_argument("--faults-per-trial", type=_count(0), default=1)
    parser.add_argument("--seed", type=int, default=None, help="replay a run (printed)")
    parser.add_argument(
        "--point",
        type=_fault_point,
        default=None,
        help="one fixed ROUNDPIPE_FAULT point instead of random faults, "
        "e.g. kill@iteration=3,kind=backward,mb=1",
    )
    parser.add_argument(
        "--coordinator-kills",
        type=_count(0),
        default=0,
        help="also SIGKILL the coordinator this many times per trial "
        "(needs output.checkpoint_every in the spec)",
    )
    parser.add_argument("--no-stop", action="store_true", help="only kills, no SIGSTOP hangs")
    parser.add_argument(
        "--emulate-pcie",
        type=_bandwidth,
        default=None,
        metavar="BANDWIDTH",
        help="run the workers' copies through an emulated bus (roundpipe-worker --emulate-pcie)",
    )
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    try:
        spec = load_job_spec(args.spec)
    except JobSpecError as exc:
        return _error(str(exc), 2)
    try:
        root = Path(args.workdir or tempfile.mkdtemp(prefix="roundpipe-chaos-"))
        root.mkdir(parents=True, exist_ok=True)
        arena_dir = Path(tempfile.mkdtemp(prefix="roundpipe-chaos-", dir="/dev/shm"))
    except OSError as exc:
        return _error(f"cannot create directory {exc.filename!r}: {exc.strerror or exc}", 1)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    print(f"chaos: seed {seed}", flush=True)
    rng = random.Random(seed)
    trials, seeds = [], []
    for _ in range(args.trials):
        if args.point:
            faults = [FaultSpec("point", point=args.point)]
        else:
            faults = random_faults(rng, args.faults_per_trial, spec, allow_stop=not args.no_stop)
        faults += [
            FaultSpec("coordinator", at_fraction=rng.uniform(0.2, 0.8))
            for _ in range(args.coordinator_kills)
        ]
        trials.append(faults)
        seeds.append(rng.randrange(1, 10**6))
    try:
        report = run_chaos(
            spec,
            root=root,
            arena_dir=arena_dir,
            num_workers=args.workers,
            trials=trials,
            seeds=seeds,
            worker_args=["--emulate-pcie", args.emulate_pcie] if args.emulate_pcie else (),
        )
    except JobRejected as exc:  # e.g. more host memory than this machine has
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
        return _error(str(exc), 2)
    except KeyboardInterrupt:
        if not args.workdir:  # nothing was found: nothing worth keeping in /tmp
            shutil.rmtree(root, ignore_errors=True)
        return _error("interrupted", 130)
    except (RoundPipeError, RuntimeError, TimeoutError) as exc:
        # The run itself broke (the reference run failed, a coordinator vanished
        # between trials): its logs are the evidence, kept and named.
        return _error(
            f"{exc}\nchaos: FAIL: the run could not go on (seed {seed}; work dir {root}, "
            "the daemons' logs are in it)",
            1,
        )
    finally:
        for f in arena_dir.iterdir():
            f.unlink()
        arena_dir.rmdir()
    print(report.table())
    # A failure's daemon logs and models are the evidence: kept. A pass's are not worth
    # the space in /tmp unless the user named the directory.
    kept = bool(args.workdir) or not report.ok
    if not kept:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"chaos: {'PASS' if report.ok else 'FAIL'}: {report.injected} fault(s) injected "
        f"mid-job (seed {seed}; work dir {root if kept else 'removed'})"
    )
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
