"""``roundpipe demo``: the whole runtime end to end on one machine, with nothing to set up.

:func:`run_demo` starts a private coordinator and its workers as child processes (one
``--gpu i`` worker per CUDA device, else two ``--cpu`` workers), trains the bundled tiny
model (roundpipe/demo_data/demo_job.yaml) with live progress, prints the first and last
loss and where the model went, then stops every process and checks that the coordinator
removed its shared-memory arenas.

Everything private lives in one temporary directory: the coordinator's state directory,
its ``ipc://`` socket (a file, so it never collides with another coordinator), a
throwaway key set (keys are on, as in production: docs/deploy.md), and the daemons'
logs. Arenas go to a fresh directory under /dev/shm when it is writable. Both are
removed at the end, also after a failure or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

from roundpipe.client import Client, CoordinatorUnavailable, RoundPipeError
from roundpipe.coordinator.spec.errors import JobSpecError
from roundpipe.coordinator.spec.jobspec import JobSpec, load_job_spec
from roundpipe.coordinator.spec.paths import spec_read_dirs
from roundpipe.progress import watch_job
from roundpipe.shared.defaults import MAX_IPC_PATH
from roundpipe.shared.keys import add_key, init_keys

__all__ = [
    "DEFAULT_OUTPUT_DIR",
    "DEFAULT_STARTUP_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "CHAT_DEMO_SPEC_PATH",
    "DEMO_SPEC_PATH",
    "DemoError",
    "demo_spec",
    "run_demo",
]

DEMO_SPEC_PATH = Path(__file__).parent / "demo_data" / "demo_job.yaml"
"""The bundled demo job."""

CHAT_DEMO_SPEC_PATH = Path(__file__).parent / "demo_data" / "demo_chat_job.yaml"
"""The bundled chat demo job (``roundpipe demo --chat``): assistant-only loss."""

DEFAULT_OUTPUT_DIR = "roundpipe-demo-output"
"""Where the demo's model goes, relative to the current directory."""

DEFAULT_TIMEOUT_S = 900.0
"""How long the demo job may run before the demo gives up."""

DEFAULT_STARTUP_TIMEOUT_S = 120.0
"""How long the coordinator and workers may take to start and find each other (each
imports torch; on a small, busy machine that takes a while)."""

_SHUTDOWN_GRACE_S = 20.0
_LOG_TAIL_LINES = 25

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class DemoError(Exception):
    """The demo could not run or did not end cleanly; the message says why."""


@dataclasses.dataclass
class _Daemon:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path


def demo_spec(
    *,
    spec_path: str | os.PathLike[str] | None = None,
    steps: int | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    num_workers: int | None = None,
) -> JobSpec:
    """The demo job with the demo's overrides applied, validated.

    ``steps`` replaces ``train.steps`` (the warmup is shortened to fit); the model goes
    to ``output_dir`` (default ``./roundpipe-demo-output``), made absolute here. With
    ``num_workers`` N, the microbatch count is raised to at least N + 1: round-robin keeps
    every worker busy only when M >= N + 1.
    """
    spec = load_job_spec(DEMO_SPEC_PATH if spec_path is None else spec_path)
    raw = spec.to_dict()  # paths are absolute already
    if steps is not None:
        raw["train"]["steps"] = steps
        raw["optimizer"]["warmup_steps"] = min(raw["optimizer"]["warmup_steps"], steps)
    if num_workers is not None:
        raw["batch"]["num_microbatches"] = max(raw["batch"]["num_microbatches"], num_workers + 1)
    try:
        out = Path(DEFAULT_OUTPUT_DIR if output_dir is None else output_dir).expanduser()
    except RuntimeError as exc:  # ~user that does not exist
        raise DemoError(f"--output {output_dir}: {exc}") from None
    raw["output"]["dir"] = str(out.resolve())
    try:
        return JobSpec.from_dict(raw, source=str(spec_path or DEMO_SPEC_PATH))
    except JobSpecError as exc:
        # A problem with what the command line set (or the demo's default output
        # directory) is the option's, not the spec file's.
        options = {"output.dir": "--output" if output_dir is not None else "the default --output"}
        if steps is not None:
            options["train.steps"] = "--steps"
        if exc.errors and all(e.path in options for e in exc.errors):
            raise DemoError(
                "; ".join(f"{options[e.path]}: {e.message}" for e in exc.errors)
            ) from None
        raise


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _worker_device_args(num_workers: int | None, cpu: bool) -> list[list[str]]:
    num_gpus = 0 if cpu else _cuda_device_count()
    if num_gpus == 0:
        return [["--cpu"] for _ in range(2 if num_workers is None else num_workers)]
    count = num_gpus if num_workers is None else num_workers
    if count > num_gpus:
        raise DemoError(
            f"--workers {count} asks for more GPU workers than the {num_gpus} CUDA "
            "device(s) here; use fewer, or --cpu for CPU workers"
        )
    return [["--gpu", str(i)] for i in range(count)]


def _make_arena_dir(tmp: Path) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        try:
            return Path(tempfile.mkdtemp(prefix="roundpipe-demo-", dir=shm))
        except OSError:
            pass
    arenas = tmp / "arenas"
    arenas.mkdir(mode=0o700)  # private: the coordinator keeps its arenas right in it
    return arenas


def _pick_address(tmp: Path) -> str:
    sock_path = tmp / "coordinator.sock"
    if len(str(sock_path)) <= MAX_IPC_PATH:
        return f"ipc://{sock_path}"
    # Past a socket path's limit, TCP. Ask the kernel for a free port. Another process could take it before the
    # coordinator binds; the coordinator then exits 2 "address in use" and we say so.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


def _start(
    name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None
) -> _Daemon:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    with open(log_path, "wb") as log:
        # The child gets its own copy of the descriptor; ours can close at once.
        process = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
        )
    return _Daemon(name, process, log_path)


def _tail(path: Path, num_lines: int = _LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"    (cannot read {path}: {exc.strerror})"
    lines = text.splitlines()[-num_lines:]
    if not lines:
        return "    (empty)"
    return "\n".join("    " + line for line in lines)


def _log_tails(daemons: Sequence[_Daemon], extra: Sequence[tuple[str, Path]] = ()) -> str:
    parts = [f"--- {d.name} log (last lines) ---\n{_tail(d.log_path)}" for d in daemons]
    parts += [f"--- {name} (last lines) ---\n{_tail(path)}" for name, path in extra]
    return "\n".join(parts)


def _exited(daemons: Sequence[_Daemon]) -> list[_Daemon]:
    return [d for d in daemons if d.process.poll() is not None]


def _wait_for_workers(
    address: str,
    daemons: Sequence[_Daemon],
    num_workers: int,
    timeout_s: float,
    keys: dict[str, Path],
) -> None:
    deadline = time.monotonic() + timeout_s
    seen = 0
    with Client(address, timeout_s=2.0, **keys) as client:
        while True:
            dead = _exited(daemons)
            if dead:
                what = ", ".join(f"{d.name} (exit status {d.process.returncode})" for d in dead)
                raise DemoError(f"{what} stopped during startup\n{_log_tails(daemons)}")
            try:
                workers = client.workers()
            except CoordinatorUnavailable:
                pass  # still importing, or not listening yet
            else:
                seen = sum(1 for w in workers if w.state != "lost")
                if seen >= num_workers:
                    return
            if time.monotonic() >= deadline:
                raise DemoError(
                    f"the coordinator at {address} did not report {num_workers} worker(s) "
                    f"within {timeout_s:g} s (it reported {seen})\n{_log_tails(daemons)}"
                )
            time.sleep(0.2)


def _stop(daemons: Sequence[_Daemon], grace_s: float) -> list[str]:
    """SIGTERM each daemon, wait up to `grace_s`, SIGKILL what is left; return problems."""
    problems: list[str] = []
    for d in daemons:
        if d.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                d.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for d in daemons:
        try:
            d.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                d.process.kill()
            d.process.wait()
            problems.append(f"{d.name} did not stop within {grace_s:g} s of SIGTERM; killed")
            continue
        # -SIGTERM: our SIGTERM reached it before its handler was set (still starting up,
        # e.g. a Ctrl-C during the start): stopped as asked, not a problem.
        if d.process.returncode not in (0, -signal.SIGTERM):
            problems.append(f"{d.name} exited with status {d.process.returncode}")
    return problems


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Let cleanup finish even if Ctrl-C is pressed again while it runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_demo(
    *,
    num_workers: int | None = None,
    steps: int | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    spec_path: str | os.PathLike[str] | None = None,
    timeout_s: float | None = None,
    cpu: bool = False,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    coordinator_command: Sequence[str] | None = None,
    worker_command: Sequence[str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Run the demo; return an exit status (0 success, 1 failure, 2 usage/spec error,
    130 interrupted).

    ``num_workers``: default one per CUDA device, else 2 CPU workers (``cpu=True``
    forces CPU workers). ``steps`` and ``output_dir`` override the demo spec (or the spec
    at ``spec_path``). ``timeout_s`` bounds the job (default :data:`DEFAULT_TIMEOUT_S`),
    ``startup_timeout_s`` the wait for the coordinator to see every worker.

    ``coordinator_command`` / ``worker_command`` replace the command prefix that starts a
    daemon (default ``[sys.executable, "-m", "roundpipe.coordinator.service.main"]`` and
    ``[..., "roundpipe.worker.daemon"]``); the daemon arguments are appended. Progress
    and diagnostics go to ``stderr``, the result to ``stdout``.
    """
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    job_timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s

    def say(text: str) -> None:
        print(f"roundpipe demo: {text}", file=err, flush=True)

    def fail(text: str) -> None:
        print(f"roundpipe demo: error: {text}", file=err, flush=True)

    try:
        devices = _worker_device_args(num_workers, cpu)
        spec = demo_spec(
            spec_path=spec_path, steps=steps, output_dir=output_dir, num_workers=len(devices)
        )
    except (JobSpecError, DemoError) as exc:
        fail(str(exc))
        return EXIT_USAGE
    if not devices:
        fail("the demo needs at least one worker")
        return EXIT_USAGE
    coordinator_cmd = list(
        coordinator_command or [sys.executable, "-m", "roundpipe.coordinator.service.main"]
    )
    worker_cmd = list(worker_command or [sys.executable, "-m", "roundpipe.worker.daemon"])

    tmp = Path(tempfile.mkdtemp(prefix="roundpipe-demo-"))
    arena_dir: Path | None = None
    daemons: list[_Daemon] = []
    state_dir = tmp / "state"
    job_log: Path | None = None
    rc = EXIT_FAILURE
    try:
        arena_dir = _make_arena_dir(tmp)
        state_dir.mkdir()
        address = _pick_address(tmp)
        # Keys on, as in production: a throwaway set, gone with the temporary directory.
        keys_dir = tmp / "keys"
        init_keys(keys_dir)
        add_key(keys_dir, "demo", "client", out_dir=keys_dir)
        client_keys = {
            "key": keys_dir / "demo.key_secret",
            "coordinator_key": keys_dir / "coordinator.key",
        }
        worker_env = {
            "ROUNDPIPE_KEY": str(keys_dir / "worker.key_secret"),
            "ROUNDPIPE_COORDINATOR_KEY": str(keys_dir / "coordinator.key"),
        }
        kind = "CPU" if devices[0] == ["--cpu"] else "GPU"
        say(f"starting a coordinator at {address} and {len(devices)} {kind} worker(s)")
        coordinator_args = {
            "--address": address,
            "--state-dir": str(state_dir),
            "--arena-dir": str(arena_dir),
            "--keys-dir": str(keys_dir),
            "--log-level": "INFO",
        }
        cpu_workers = sum(1 for d in devices if d == ["--cpu"])
        cores = os.cpu_count() or 2
        # Oversubscribed cores slow CPU training down many times (OpenMP threads of several
        # processes spinning against each other): give CPU workers the cores between them
        # and the coordinator (optimizer) one thread.
        worker_threads = ["--threads", str(max(1, cores // cpu_workers))] if cpu_workers else []
        if cpu_workers:
            coordinator_args["--threads"] = "1"
        # The demo's coordinator is private to this user (its address is in a fresh
        # temporary directory): it may read what the spec names and write its output
        # directory, which is created here so that it can be the write root.
        out_dir = Path(spec.output.dir or state_dir / "jobs")
        out_dir.mkdir(parents=True, exist_ok=True)
        roots = [("--allow-read", d) for d in spec_read_dirs(spec)]
        roots.append(("--allow-write", str(out_dir)))
        argv = coordinator_cmd + [x for kv in [*coordinator_args.items(), *roots] for x in kv]
        daemons.append(_start("coordinator", argv, tmp / "coordinator.log"))
        for i, device_args in enumerate(devices):
            name = f"demo-worker-{i}"
            daemons.append(
                _start(
                    name,
                    worker_cmd
                    + device_args
                    + ["--coordinator", address, "--name", name, "--log-level", "INFO"]
                    + (worker_threads if device_args == ["--cpu"] else []),
                    tmp / f"{name}.log",
                    worker_env,
                )
            )
        _wait_for_workers(address, daemons, len(devices), startup_timeout_s, client_keys)
        say("workers ready; submitting the demo job")

        with Client(address, **client_keys) as client:
            handle = client.submit(spec)
            job_log = state_dir / "jobs" / handle.job_id / "job.log"
            say(f"job {handle.job_id}: {spec.train.steps} steps")
            started = time.monotonic()
            try:
                result = watch_job(
                    handle, total_steps=spec.train.steps, stream=err, timeout_s=job_timeout_s
                )
            except TimeoutError as exc:
                raise DemoError(str(exc)) from None
            elapsed = time.monotonic() - started

        status = result.status
        if status.state != "succeeded":
            fail(f"job {status.job_id} {status.state}: {status.message or 'no reason given'}")
            print(_log_tails(daemons, [("job log", job_log)]), file=err)
            rc = EXIT_FAILURE
        else:
            print(
                f"demo job {status.job_id} succeeded: {status.step} steps in {elapsed:.1f} s",
                file=out,
            )
            if result.first is not None and result.last is not None:
                print(
                    f"loss: {result.first.loss:.4f} (step {result.first.step}) -> "
                    f"{result.last.loss:.4f} (step {result.last.step})",
                    file=out,
                )
            if status.plan:
                print(f"stage plan at the end: {status.plan}", file=out)
            print(f"model written to {status.output_dir or spec.output.dir}", file=out)
            rc = EXIT_OK
    except DemoError as exc:
        fail(str(exc))
        rc = EXIT_FAILURE
    except RoundPipeError as exc:
        extra = [("job log", job_log)] if job_log is not None else []
        fail(f"{exc}\n{_log_tails(daemons, extra)}")
        rc = EXIT_FAILURE
    except KeyboardInterrupt:
        print(file=err)
        say("interrupted; stopping the coordinator and workers")
        rc = EXIT_INTERRUPTED
    finally:
        with _sigint_deferred():
            # Workers first, so none is left talking to a coordinator that is gone; the
            # coordinator removes its arenas when it stops.
            problems = _stop(daemons[1:], _SHUTDOWN_GRACE_S)
            problems += _stop(daemons[:1], _SHUTDOWN_GRACE_S)
            leftovers = sorted(p.name for p in arena_dir.iterdir()) if arena_dir else []
            if leftovers:
                problems.append(
                    f"the coordinator left {len(leftovers)} arena file(s) in {arena_dir}: "
                    + ", ".join(leftovers[:10])
                )
            if problems and rc == EXIT_OK:
                fail("unclean shutdown:\n  " + "\n  ".join(problems))
                print(_log_tails(daemons), file=err)
                rc = EXIT_FAILURE
            elif problems:
                fail("also: " + "; ".join(problems))
            if arena_dir is not None and arena_dir.parent != tmp:
                shutil.rmtree(arena_dir, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)
    return rc
