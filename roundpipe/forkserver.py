"""Start local daemons by forking a process that has already imported them.

A CPU worker or coordinator started with ``python -m ...`` spends about 3.5 s of CPU
importing torch and transformers before it does anything. A cluster's start-up, a
worker restarted by the chaos harness, each system test's daemons: all waited on those
imports, and on a two-core machine several daemons importing at once took each other's
cores. :class:`ForkServer` is one helper process
(``python -m roundpipe.forkserver``) that imports those modules once and then forks a
daemon per request: the child sets its own stdio, working directory, environment and
``sys.argv``, and calls the same entry point the console script calls.

What a forked daemon shares with one started afresh, and what it does not:

- The entry point, arguments, environment variables, log file, working directory,
  signal handling and exit status are the same. :class:`ForkedProcess` offers the part
  of :class:`subprocess.Popen` that :class:`roundpipe.cluster.LocalCluster` uses
  (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``, ``terminate``,
  ``returncode``); signals go straight to the daemon's pid.
- The modules were imported under the server's environment, so a variable that the
  interpreter or a library reads at start-up or import must not differ:
  :meth:`ForkServer.can_start` accepts an environment only where those
  (:data:`IMPORT_TIME_ENV`: ``PYTHON*``, the thread pools' ``OMP_*`` and the like,
  ``CUDA_*``, torch's and Hugging Face's, ``HOME``, ``PATH``...) equal the server's.
  This package reads its own ``ROUNDPIPE_*`` variables at run time, but for the two
  polling knobs listed there; a variable no library knows (``PYTEST_CURRENT_TEST``)
  may differ. Anything else is
  started afresh by the caller.
- The parent of the daemon is the server, not the caller; ``ps`` shows the server's
  command line for it. CUDA is never initialised in the server (it imports, never runs),
  so forking is safe, but GPU workers are still started afresh: that path is measured
  on the GPU as it is deployed.

The server is single-threaded when it forks: it is started with ``OMP_NUM_THREADS=1``
(which ``LocalCluster`` gives every daemon anyway), under which importing torch starts
no thread. It talks to its owner over its stdin and stdout, one JSON object a line, and
exits when its stdin closes (its owner exited); the daemons it started live on, to be
stopped by whoever stopped them before.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import NoReturn, TextIO

import psutil

ENTRY_POINTS = {
    "roundpipe.worker.daemon": "run",
    "roundpipe.coordinator.service.main": "main",
}
"""The modules a daemon can be forked as, and the function each one's console script
calls (``roundpipe-worker``, ``roundpipe-coordinator``)."""

PRELOAD = (
    *ENTRY_POINTS,
    # What both daemons import once they run, not when their modules load: the
    # coordinator imports transformers and its optimizer in main(), and a worker
    # imports the model families when its first job arrives.
    "transformers",
    "roundpipe.coordinator.training.optimizer",
    "roundpipe.shared.model",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.llama.modeling_llama",
    # A LoRA job's daemons import peft (and with it bitsandbytes and torch._inductor):
    # about a second of CPU in the coordinator, its spec checker and every worker, for
    # each LoRA job; once here instead.
    "peft",
)

IMPORT_TIME_ENV = (
    *("PYTHON", "LD_", "MALLOC_", "TMPDIR", "HOME", "PATH", "XDG_", "LANG", "LC_"),
    # This package's two knobs read when their modules load (shared/polling.py,
    # shared/events.py); the rest of ROUNDPIPE_* is read at run time.
    *("ROUNDPIPE_RECV_SPIN_US", "ROUNDPIPE_WAIT_POLL_MS"),
    *("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "NUMEXPR_"),  # thread pools
    *("CUDA_", "NVIDIA_", "NCCL_", "TORCH", "PYTORCH_"),  # torch and its libraries
    *("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "SAFETENSORS_"),
    "BNB_",  # bitsandbytes (imported with peft) reads its CUDA version at import
)
"""Prefixes of the variables read when the interpreter starts or a library is imported
(a library's constants, its thread pool, its cache directory): a forked daemon's must be
the server's."""

SERVER_ENV = {"OMP_NUM_THREADS": "1"}
"""Set in the server over its owner's environment (see the module docstring)."""

HF_HUB_DEFAULTS = {"HF_HUB_OFFLINE": "1"}
"""What both daemons set where unset (models, tokenizers and data are local); the server
sets it before its imports."""

POLL_S = 0.02

log = logging.getLogger(__name__)


class ForkServerError(RuntimeError):
    """The fork server could not start a daemon or answer about one."""


UNKNOWN_STATUS = 255
"""The exit status of a daemon whose fork server died before it: its parent was the
server, so nobody can tell how it exited."""


class ForkedProcess:
    """A daemon forked by a :class:`ForkServer`: the ``Popen`` methods LocalCluster
    uses. Its exit status comes from the server, which is its parent. Should the server
    die first, the daemon is still polled and signalled through psutil, which checks the
    pid's start time (a reused pid is never hit); its exit status is then UNKNOWN_STATUS."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]):
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        # Taken while the pid is surely this daemon's: the server reaps it only when asked.
        try:
            self._process: psutil.Process | None = psutil.Process(pid)
        except psutil.Error:
            self._process = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self._server.exit_status(self.pid)
            except ForkServerError:
                if self._orphan_runs():
                    return None
                self.returncode = UNKNOWN_STATUS
        return self.returncode

    def _orphan_runs(self) -> bool:
        """Whether this daemon runs on without its server (is_running compares the
        pid's start time: a reused pid is another process)."""
        try:
            return (
                self._process is not None
                and self._process.is_running()
                and self._process.status() != psutil.STATUS_ZOMBIE
            )
        except psutil.Error:
            return False

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(POLL_S)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # Until the server reaps it (only when asked, in poll()), an exited daemon is a
        # zombie whose pid no other process can take; once reaped, it is not signalled.
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _import_time_part(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that imports read (with the daemons' own defaults)."""
    env = {**HF_HUB_DEFAULTS, **env}
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


class ForkServer:
    """The owner's end of one fork server process (see the module docstring)."""

    def __init__(self, env: Mapping[str, str] | None = None, start_timeout_s: float = 120.0):
        self.env = {**(os.environ if env is None else env), **SERVER_ENV}
        self._imported_under = _import_time_part(self.env)
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "roundpipe.forkserver"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
            text=True,
        )
        try:
            ready = self._read_line(start_timeout_s)
        except ForkServerError:
            self.close()
            raise
        if ready != {"ready": True}:
            self.close()
            why = ready.get("why") if ready else f"it exited with {self._proc.returncode}"
            raise ForkServerError(f"the fork server cannot fork safely: {why}")

    def can_start(self, env: Mapping[str, str]) -> bool:
        """True when a daemon with this environment may be forked from this server."""
        return self.alive() and _import_time_part(env) == self._imported_under

    def alive(self) -> bool:
        return self._proc.poll() is None

    def start(
        self,
        module: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str],
        log_path: str | os.PathLike[str],
        cwd: str | os.PathLike[str] | None = None,
    ) -> ForkedProcess:
        """Fork a daemon running ``module``'s entry point with ``args`` (what follows
        ``python -m module``), its stdout and stderr appended to ``log_path``."""
        if module not in ENTRY_POINTS:
            raise ValueError(f"cannot fork {module!r}: only {sorted(ENTRY_POINTS)}")
        reply = self._ask(
            {
                "op": "start",
                "module": module,
                "args": list(args),
                "env": dict(env),
                "log": os.fspath(log_path),
                "cwd": os.fspath(cwd if cwd is not None else os.getcwd()),
            }
        )
        return ForkedProcess(self, reply["pid"], [sys.executable, "-m", module, *args])

    def exit_status(self, pid: int) -> int | None:
        return self._ask({"op": "poll", "pid": pid})["returncode"]

    def close(self) -> None:
        """Stop the server (its daemons live on)."""
        with contextlib.suppress(OSError):
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _ask(self, request: dict) -> dict:
        with self._lock:
            try:
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError) as exc:
                raise ForkServerError(f"the fork server is gone ({exc})") from exc
            reply = self._read_line(timeout_s=60.0)
        if reply is None:
            raise ForkServerError(f"the fork server exited ({self._proc.poll()})")
        if "error" in reply:
            raise ForkServerError(reply["error"])
        return reply

    def _read_line(self, timeout_s: float) -> dict | None:
        # The server answers at once (a fork, a waitpid); the timeout only keeps a
        # wedged server from hanging its owner. A late answer would be read as the next
        # request's: the wedged server is stopped instead.
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        if not ready:
            self._proc.kill()
            raise ForkServerError(f"the fork server did not answer within {timeout_s:.0f}s")
        line = self._proc.stdout.readline()
        return json.loads(line) if line else None


_shared: ForkServer | None = None
_shared_owner = 0
_shared_failed = False
_shared_lock = threading.Lock()


def shared_server() -> ForkServer | None:
    """This process's fork server, started on first use (about as long as one daemon's
    imports) and stopped when this process exits; None where it cannot start (it says
    why, once), and daemons are then started afresh."""
    global _shared, _shared_owner, _shared_failed
    with _shared_lock:
        if _shared_owner != os.getpid():
            _shared, _shared_owner, _shared_failed = None, os.getpid(), False
        if _shared_failed:
            return None
        if _shared is None or not _shared.alive():
            try:
                _shared = ForkServer()
            except (ForkServerError, OSError) as exc:
                _shared_failed = True
                log.warning("daemons start as new interpreters: %s", exc)
                return None
            atexit.register(_shared.close)
        return _shared


# ---- the server process ----------------------------------------------------------


def serve() -> None:
    """Import the daemons, then answer requests on stdin until it closes."""
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    # Ctrl-C reaches the whole process group: the server must outlive it, for its owner
    # to stop the daemons and learn their exit status (each daemon gets it back).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Set before the imports, as the coordinator does before it imports transformers:
    # huggingface_hub fixes its offline mode when it is imported.
    for name, value in HF_HUB_DEFAULTS.items():
        os.environ.setdefault(name, value)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # stderr stays the owner's: a server's own failure shows there
    os.close(devnull)
    # Before a daemon configures logging, a library's warning goes to the owner's stderr
    # (logging's last resort): bitsandbytes, imported with peft, warns on CPUs with
    # AVX512-BF16 that an optional kernel package is missing, on the terminal of every
    # `roundpipe chaos`. A handler of its own keeps it off; the daemons' logs, which
    # their root handlers write, still get what bitsandbytes says once they run.
    logging.getLogger("bitsandbytes").addHandler(logging.NullHandler())
    for name in PRELOAD:
        importlib.import_module(name)

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        # A thread that holds a lock at the fork leaves the child waiting on it forever.
        reply({"ready": False, "why": f"{threads} threads after the imports, not 1"})
        return
    reply({"ready": True})
    exited: dict[int, int] = {}
    for line in requests:
        request = json.loads(line)
        if request["op"] == "start":
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as exc:
                reply({"error": f"fork failed: {exc}"})
                continue
            if pid == 0:
                _become_daemon(request, (requests, replies))
            exited.pop(pid, None)  # a pid reaped earlier, now another daemon's
            reply({"pid": pid})
        elif request["op"] == "poll":
            pid = request["pid"]
            if pid not in exited:
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    reply({"error": f"pid {pid} is not a daemon of this fork server"})
                    continue
                if done:
                    exited[pid] = os.waitstatus_to_exitcode(status)
            reply({"returncode": exited.get(pid)})
        else:
            reply({"error": f"unknown request {request['op']!r}"})


def _become_daemon(request: dict, control: tuple[TextIO, TextIO]) -> NoReturn:
    """In the forked child: become the daemon the request names. It ends as
    ``python -m <module>`` would: the entry point's status through ``sys.exit`` (the
    interpreter's shutdown, atexit hooks and non-daemon threads included), an uncaught
    exception as a traceback and status 1; it never returns to the server's loop."""
    for stream in control:
        stream.close()
    log_fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignores it
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    module = importlib.import_module(request["module"])
    sys.argv = [module.__file__, *request["args"]]
    sys.exit(getattr(module, ENTRY_POINTS[request["module"]])())


if __name__ == "__main__":
    serve()
