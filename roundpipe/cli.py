"""The ``roundpipe`` command: submit, watch and manage jobs on a RoundPipe coordinator.

::

    roundpipe submit job.yaml --wait     # prints the job id, then live progress on stderr
    roundpipe status JOB                 # one job
    roundpipe jobs                       # every job, as a table
    roundpipe workers                    # every worker, as a table
    roundpipe cancel JOB
    roundpipe forget JOB                 # drop an ended job's record and log (output stays)
    roundpipe resume JOB [--wait]        # continue a paused/failed job from its checkpoint
    roundpipe logs JOB [--follow]        # a job's log, from the coordinator (owner/admin)
    roundpipe timeline JOB -o t.png      # the measured pipeline as a picture
    roundpipe demo                       # coordinator + workers + a tiny job, end to end
    roundpipe keys init|new|add|list|remove|reload   # CurveZMQ keys and who may connect

Every subcommand that talks to a coordinator connects with ``--key`` /
``$ROUNDPIPE_KEY`` and ``--coordinator-key`` / ``$ROUNDPIPE_COORDINATOR_KEY`` (see
roundpipe.shared.keys and docs/deploy.md, "Keys and access").

Every subcommand that talks to a coordinator takes ``--address`` (default
``$ROUNDPIPE_ADDRESS``, else ``tcp://127.0.0.1:7420``). Errors are one line on stderr
(an invalid spec lists each problem on its own line), never a traceback.

Exit status: 0 success; 1 a runtime failure (coordinator unreachable, unknown job, a
file or directory that cannot be read or written, the job failed or was cancelled); 2 a
usage error or an invalid job spec; 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import msgspec

from roundpipe.client import (
    STOPPED_STATES,
    Client,
    CoordinatorUnavailable,
    JobHandle,
    RoundPipeError,
)
from roundpipe.coordinator.spec.errors import JobSpecError
from roundpipe.coordinator.spec.jobspec import load_job_spec
from roundpipe.progress import (
    ProgressPrinter,
    WatchResult,
    format_loss,
    format_rate,
    said_of,
    watch_job,
)
from roundpipe.protocol import JobStatus, WorkerInfo
from roundpipe.shared.defaults import CLIENT_TIMEOUT_S, default_address
from roundpipe.shared.units import format_bytes

__all__ = ["ProgressPrinter", "main", "watch_job"]

PROG = "roundpipe"

# ErrorReply codes meaning "the spec is wrong" (exit 2, like a client-side spec error).
_SPEC_ERROR_CODES = frozenset({"bad_spec"})

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _UsageError(Exception):
    """A command-line mistake found after parsing (exit 2)."""


def _error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- formatting


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row)]
    lines = []
    for row in [headers, *rows]:
        cells = [cell.ljust(w) for cell, w in zip(row, widths)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _report_final(result: WatchResult) -> int:
    status = result.status
    steps = f"{status.step}/{status.total_steps} steps"
    if status.state == "succeeded":
        loss = ""
        if result.first is not None and result.last is not None:
            loss = f", loss {format_loss(result.first.loss)} -> {format_loss(result.last.loss)}"
        where = f"; model written to {status.output_dir}" if status.output_dir else ""
        print(f"job {status.job_id} succeeded ({steps}{loss}){where}", file=sys.stderr)
        if status.plan:
            print(f"stage plan: {status.plan}", file=sys.stderr)
        return EXIT_OK
    reason = status.message or "no reason given"
    print(f"job {status.job_id} {status.state} at {steps}: {reason}", file=sys.stderr)
    return EXIT_FAILURE


# --------------------------------------------------------------------------- commands


def _client(args: argparse.Namespace) -> Client:
    try:
        return Client(
            args.address,
            timeout_s=args.timeout,
            key=args.key,
            coordinator_key=args.coordinator_key,
        )
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


def _cmd_submit(args: argparse.Namespace) -> int:
    spec = load_job_spec(args.spec)  # JobSpecError -> exit 2, before anything is sent
    with _client(args) as client:
        handle = client.submit(spec)
        print(handle.job_id, flush=True)
        if not args.wait:
            return EXIT_OK
        return _watch(handle, spec.train.steps)


def _status_dict(status: JobStatus | WorkerInfo) -> dict[str, Any]:
    return msgspec.structs.asdict(status)  # flat records: no nested ones to convert


def _cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        status = client.status(args.job)
    if args.json:
        print(json.dumps(_status_dict(status), indent=2))
        return EXIT_OK
    rows = [
        ("job", status.job_id),
        ("state", status.state),
        ("step", f"{status.step}/{status.total_steps}"),
        ("loss", format_loss(status.loss)),
        ("output", status.output_dir or "-"),
    ]
    if status.plan:
        rows.append(("plan", status.plan))
    rows += _figure_rows(status)  # observability
    if status.message:
        rows.append(("message", status.message))
    for key, value in rows:
        print(f"{key + ':':<8} {value}")
    return EXIT_OK


def _figure_rows(status: JobStatus) -> list[tuple[str, str]]:
    """Throughput, bubble, optimizer lag and busy workers of a running job."""
    rows = []
    if status.tokens_per_s is not None:
        rows.append(("speed", format_rate(status.tokens_per_s)))
    if status.bubble_fraction is not None:
        rows.append(("bubble", f"{100 * status.bubble_fraction:.1f}% (measured, latest step)"))
    if status.state == "running":
        rows.append(("opt lag", f"{status.optimizer_lag_steps} step(s)"))
    if status.worker_busy:
        busy = ", ".join(
            f"w{w} {100 * b:.0f}%"
            for w, b in sorted(status.worker_busy.items(), key=lambda i: int(i[0]))
        )
        rows.append(("busy", busy))
    return rows


def _print_listing(
    as_json: bool,
    items: Sequence[Any],
    none_text: str,
    headers: tuple[str, ...],
    row: Callable[[Any], tuple[str, ...]],
) -> int:
    """What `roundpipe jobs` and `roundpipe workers` print: JSON, a line saying there are
    none, or a table with a row per item."""
    if as_json:
        print(json.dumps([_status_dict(i) for i in items], indent=2))
    elif not items:
        print(none_text)
    else:
        print(_table(headers, [row(i) for i in items]))
    return EXIT_OK


def _job_row(j: JobStatus) -> tuple[str, ...]:
    return (
        j.job_id,
        j.state,
        f"{j.step}/{j.total_steps}",
        format_loss(j.loss),
        j.message if j.state in ("failed", "paused") or not j.output_dir else j.output_dir,
    )


def _cmd_jobs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        jobs = client.jobs()
    headers = ("JOB", "STATE", "STEP", "LOSS", "OUTPUT / MESSAGE")
    return _print_listing(args.json, jobs, "no jobs", headers, _job_row)


def _device_text(worker: WorkerInfo) -> str:
    name = worker.device_name
    if not name or name.startswith(worker.device):  # e.g. "cpu (16 cores)"
        return name or worker.device
    return f"{worker.device} ({name})"


def _bandwidth_text(worker: WorkerInfo) -> str:
    """Measured bus bandwidth, ``"24.1 / 25.3 GB/s"``; ``-`` when nothing crosses a bus."""
    if worker.h2d_bytes_per_s is None or worker.d2h_bytes_per_s is None:
        return "-"
    return f"{worker.h2d_bytes_per_s / 1e9:.1f} / {worker.d2h_bytes_per_s / 1e9:.1f} GB/s"


def _worker_row(w: WorkerInfo) -> tuple[str, ...]:
    return (
        str(w.worker_id),
        w.name,
        _device_text(w),
        format_bytes(w.memory_bytes),
        _bandwidth_text(w),
        w.state,
        str(w.tasks_done),
        w.current_task or "-",
    )


def _cmd_workers(args: argparse.Namespace) -> int:
    with _client(args) as client:
        workers = client.workers()
    none_text = "no workers (start one with `roundpipe-worker --cpu` or `--gpu N`)"
    headers = ("ID", "NAME", "DEVICE", "MEMORY CAP", "H2D / D2H", "STATE", "TASKS", "CURRENT TASK")
    return _print_listing(args.json, workers, none_text, headers, _worker_row)


def _watch(
    handle: JobHandle, total_steps: int | None = None, after_seq: int = 0, shown: str | None = None
) -> int:
    try:
        result = watch_job(handle, total_steps=total_steps, after_seq=after_seq, shown=shown)
    except KeyboardInterrupt:
        print(
            f"\n{PROG}: stopped watching; job {handle.job_id} keeps running "
            f"(`{PROG} cancel {handle.job_id}` stops it)",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    except CoordinatorUnavailable as exc:
        # The job was accepted: only watching it failed (it said the request's answer
        # was lost and to look before sending it again, as if the job might not exist).
        _error(
            f"lost the coordinator while watching job {handle.job_id} ({exc}). The job "
            "is kept: a restarted coordinator resumes it from its newest checkpoint. "
            f"`{PROG} status {handle.job_id}` shows it, `{PROG} resume "
            f"{handle.job_id} --wait` follows it again"
        )
        return EXIT_FAILURE
    return _report_final(result)


def _cmd_resume(args: argparse.Namespace) -> int:
    with _client(args) as client:
        handle = client.job(args.job)
        handle.resume()
        status = handle.status()
        print(f"job {args.job} {said_of(status)}", file=sys.stderr)
        if not args.wait:
            return EXIT_OK
        # from its checkpoint's step (status.step until it runs): the steps before it are
        # history, already shown when they were trained
        return _watch(handle, after_seq=status.step, shown=said_of(status))


def _cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.cancel(args.job)
    print(f"cancel requested for job {args.job}")
    return EXIT_OK


def _cmd_forget(args: argparse.Namespace) -> int:
    with _client(args) as client:
        output = client.status(args.job).output_dir
        client.forget(args.job)
    kept = f"; its output stays in {output}" if output else ""
    print(f"job {args.job} forgotten{kept}")
    return EXIT_OK


def job_log_path(state_dir: str | os.PathLike[str], job_id: str) -> Path:
    """Where the coordinator writes a job's log: ``<state_dir>/jobs/<job_id>/job.log``."""
    if not job_id or job_id in (".", "..") or "/" in job_id or "\\" in job_id or "\0" in job_id:
        raise _UsageError(f"invalid job id {job_id!r}")
    return Path(state_dir).expanduser() / "jobs" / job_id / "job.log"


def _cmd_logs(args: argparse.Namespace) -> int:
    if args.state_dir is None:
        with _client(args) as client:
            return _remote_log(client, args.job, follow=args.follow, poll_s=args.poll)
    path = job_log_path(args.state_dir, args.job)
    if not args.follow:
        try:
            f = open(path, encoding="utf-8", errors="replace")
        except FileNotFoundError:
            _error(
                f"no log for job {args.job} at {path} (is --state-dir the coordinator's "
                "state directory? default: $ROUNDPIPE_STATE_DIR, else "
                "$XDG_STATE_HOME/roundpipe, else ~/.local/state/roundpipe)"
            )
            return EXIT_FAILURE
        with f:
            _copy_new(f, sys.stdout)
        return EXIT_OK
    with _client(args) as client:
        return _follow_log(path, client.job(args.job), poll_s=args.poll)


def _remote_log(client: Client, job_id: str, *, follow: bool, poll_s: float) -> int:
    """Print a job's log as the coordinator sends it (GetJobLog), so that its owner can
    read it without access to the coordinator's files; with ``follow``, until the job
    has stopped and the log is drained."""
    offset = 0
    ended = False
    while True:
        piece = client.job_log(job_id, offset)
        sys.stdout.write(piece.text)
        sys.stdout.flush()
        offset = piece.next_offset
        if piece.more:
            continue
        if not follow or ended:
            return EXIT_OK
        # Read once more after the job has stopped: its last lines may have just landed.
        ended = client.status(job_id).state in STOPPED_STATES
        if not ended:
            time.sleep(poll_s)


def _copy_new(src: IO[str], dst: IO[str]) -> bool:
    """Copy what `src` holds beyond what was read before; return whether anything was.
    (A text file keeps its position and its decoder state across reads at EOF, so a
    growing log is read piece by piece without splitting a UTF-8 character.)"""
    grew = False
    while chunk := src.read(1 << 16):
        dst.write(chunk)
        grew = True
    dst.flush()
    return grew


def _follow_log(path: Path, handle: JobHandle, *, poll_s: float) -> int:
    """Print the log as it grows, until the job has ended and the log is drained."""
    check_every_s = 4 * poll_s  # asking the coordinator costs more than a read
    next_check = 0.0
    ended = False
    f: IO[str] | None = None
    try:
        while True:
            if f is None:
                try:
                    f = open(path, encoding="utf-8", errors="replace")
                except FileNotFoundError:
                    f = None  # a queued job may not have a log yet
            grew = _copy_new(f, sys.stdout) if f is not None else False
            if ended and not grew:
                if f is None:
                    _error(f"job {handle.job_id} has ended and has no log at {path}")
                    return EXIT_FAILURE
                return EXIT_OK
            now = time.monotonic()
            if not ended and now >= next_check:
                next_check = now + check_every_s
                ended = handle.status().state in STOPPED_STATES
                if ended:
                    continue  # read once more: the job's last lines may have just landed
            if not grew:
                time.sleep(poll_s)
    finally:
        if f is not None:
            f.close()


def _cmd_data_help(args: argparse.Namespace) -> int:
    print(f"{PROG} data: name a command: inspect SPEC.yaml (see `{PROG} data -h`)", file=sys.stderr)
    return 2


def _cmd_data_inspect(args: argparse.Namespace) -> int:
    from roundpipe.inspect_data import inspect_data

    return inspect_data(args.spec, row=args.row)


def _cmd_demo(args: argparse.Namespace) -> int:
    from roundpipe.demo import CHAT_DEMO_SPEC_PATH, run_demo

    if args.chat and args.spec is not None:
        print(f"{PROG} demo: error: --chat and --spec exclude each other", file=sys.stderr)
        return 2
    return run_demo(
        num_workers=args.workers,
        steps=args.steps,
        output_dir=args.output,
        spec_path=CHAT_DEMO_SPEC_PATH if args.chat else args.spec,
        timeout_s=args.timeout_s,
        cpu=args.cpu,
    )


# --------------------------------------------------------------------------- parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _job_id(text: str) -> str:
    """A JOB argument: a job id is never empty (``J=$(roundpipe submit bad.yaml)`` left
    one empty, and the request failed with a traceback)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("a job id is not empty (roundpipe jobs lists them)")
    return text


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``roundpipe`` command."""
    from roundpipe import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Submit and manage fine-tuning jobs on a RoundPipe coordinator.",
        epilog="Exit status: 0 ok, 1 failure (job failed, coordinator unreachable), "
        "2 usage or spec error.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")

    conn = argparse.ArgumentParser(add_help=False)
    conn.add_argument(
        "--address",
        default=None,
        metavar="ADDR",
        help="coordinator endpoint (default: $ROUNDPIPE_ADDRESS or tcp://127.0.0.1:7420; "
        f"now {default_address()})",
    )
    conn.add_argument(
        "--timeout",
        type=_positive_float,
        default=CLIENT_TIMEOUT_S,
        metavar="S",
        help=f"seconds to wait for each coordinator reply (default: {CLIENT_TIMEOUT_S:g})",
    )
    conn.add_argument(
        "--key",
        default=None,
        metavar="FILE",
        help="your key pair, *.key_secret (default: $ROUNDPIPE_KEY, else "
        "~/.config/roundpipe/client.key_secret)",
    )
    conn.add_argument(
        "--coordinator-key",
        default=None,
        metavar="FILE",
        help="the coordinator's public key (default: $ROUNDPIPE_COORDINATOR_KEY, else "
        "~/.config/roundpipe/coordinator.key, else /etc/roundpipe/coordinator.key, else "
        "coordinator.key in the keys directory)",
    )
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON instead of text")

    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(
        name: str,
        func: Callable[[argparse.Namespace], int],
        help_text: str,
        *parents: Any,
        add_help: bool = True,
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name, help=help_text, description=help_text, parents=list(parents), add_help=add_help
        )
        p.set_defaults(func=func)
        return p

    p = add("submit", _cmd_submit, "validate a YAML job spec and submit it", conn)
    p.add_argument("spec", metavar="SPEC.yaml", help="job spec file (see docs/job-spec.md)")
    p.add_argument(
        "--wait",
        action="store_true",
        help="show progress until the job ends; exit 0 if it succeeded, 1 if not",
    )

    p = add("status", _cmd_status, "show one job's status", conn, as_json)
    p.add_argument("job", metavar="JOB", type=_job_id, help="job id")

    add("jobs", _cmd_jobs, "list your jobs (an admin's key: every job)", conn, as_json)
    add("workers", _cmd_workers, "list every worker", conn, as_json)

    p = add("cancel", _cmd_cancel, "cancel a queued or running job", conn)
    p.add_argument("job", metavar="JOB", type=_job_id, help="job id")

    p = add(
        "forget",
        _cmd_forget,
        "remove a job that has ended from the coordinator's jobs (its record, log and "
        "progress history; its output stays, and stays yours)",
        conn,
    )
    p.add_argument("job", metavar="JOB", type=_job_id, help="job id")

    p = add(
        "resume",
        _cmd_resume,
        "queue a paused, failed or cancelled job again; it continues from its newest checkpoint",
        conn,
    )
    p.add_argument("job", metavar="JOB", type=_job_id, help="job id")
    p.add_argument(
        "--wait",
        action="store_true",
        help="show progress until the job stops; exit 0 if it succeeded, 1 if not",
    )

    p = add("logs", _cmd_logs, "print a job's log", conn)
    p.add_argument("job", metavar="JOB", type=_job_id, help="job id")
    p.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="read the log file in this state directory of the coordinator directly, "
        "instead of asking the coordinator (which gives a job's log only to its owner "
        "or an admin)",
    )
    p.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing as the log grows, until the job ends (asks the coordinator)",
    )
    p.add_argument("--poll", type=_positive_float, default=0.5, help=argparse.SUPPRESS)

    # observability: the measured pipeline as a picture (roundpipe.timeline_plot)
    p = add("timeline", _cmd_timeline, "draw a job's measured pipeline timeline as a PNG", conn)
    p.add_argument("job", metavar="JOB", type=_job_id, help="job id, or a job's output directory")
    p.add_argument("--steps", default=None, metavar="A:B", help="steps A..B (default: last 3)")
    p.add_argument("-o", "--output", default="timeline.png", metavar="FILE.png")

    p = add(
        "demo",
        _cmd_demo,
        "start a private coordinator and workers, train the bundled tiny model, clean up",
    )
    p.add_argument(
        "--workers",
        type=_positive_int,
        default=None,
        metavar="N",
        help="number of workers (default: one per CUDA GPU, else 2 CPU workers)",
    )
    p.add_argument("--cpu", action="store_true", help="use CPU workers even if CUDA is there")
    p.add_argument(
        "--chat",
        action="store_true",
        help="fine-tune on the bundled conversations instead, with the loss on the "
        "assistant's turns only (roundpipe/demo_data/demo_chat_job.yaml)",
    )
    p.add_argument("--steps", type=_positive_int, default=None, metavar="N", help="optimizer steps")
    p.add_argument(
        "--output",
        default=None,
        metavar="DIR",
        help="where the trained model goes (default: ./roundpipe-demo-output)",
    )
    p.add_argument("--spec", default=None, metavar="SPEC.yaml", help=argparse.SUPPRESS)
    p.add_argument(
        "--timeout",
        dest="timeout_s",
        type=_positive_float,
        default=None,
        metavar="S",
        help="give up if the demo job has not ended after this many seconds",
    )
    p = add("data", _cmd_data_help, "look at a job's training data (see `roundpipe data -h`)")
    data_sub = p.add_subparsers(dest="data_command", metavar="DATA_COMMAND")
    p = data_sub.add_parser(
        "inspect",
        help="count a job's rows, tokens and trained tokens; show one row with the trained "
        "tokens marked",
        description="Build the job's rows as the coordinator will and print how many "
        "documents, rows, tokens and trained tokens they hold, then one rendered row with "
        "every trained token in [[...]] and | where a packed document starts.",
    )
    p.add_argument("spec", metavar="SPEC.yaml", help="job spec file (see docs/job-spec.md)")
    p.add_argument("--row", type=int, default=0, metavar="N", help="the row to show (default 0)")
    p.set_defaults(func=_cmd_data_inspect)

    _add_keys_parser(add)
    from roundpipe.plan_command import build_plan_parser

    p = add(
        "plan",
        _cmd_plan,
        "choose forward/backward/tail stages for a model and hardware; predict throughput",
    )
    build_plan_parser(p)

    p = add(
        "chaos",
        _cmd_chaos,
        "run a job with injected worker/coordinator faults and check the result is bitwise "
        "the fault-free one (see `roundpipe chaos -h`)",
        add_help=False,  # -h goes to the harness's own parser
    )
    p.add_argument("chaos_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _add_keys_parser(add: Callable[..., argparse.ArgumentParser]) -> None:
    from roundpipe.shared.keys import ROLES

    keys = add("keys", _cmd_keys, "create and authorise CurveZMQ keys (docs/deploy.md)")
    keys_dir = argparse.ArgumentParser(add_help=False)
    keys_dir.add_argument(
        "--keys-dir",
        default=None,
        metavar="DIR",
        help="the coordinator's key directory (default: $ROUNDPIPE_KEYS_DIR, else STATE_DIR/keys)",
    )
    sub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    sub.add_parser(
        "init",
        parents=[keys_dir],
        help="create the coordinator's key pair, authorized/ and a worker key",
    )
    p = sub.add_parser("new", help="create your own key pair to send to the admin")
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="where to write client.key_secret and client.key (default: ~/.config/roundpipe)",
    )
    p = sub.add_parser("add", parents=[keys_dir], help="authorise an identity with a role")
    p.add_argument("name", metavar="NAME", help="the identity (jobs belong to it)")
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument(
        "--public-key",
        default=None,
        metavar="FILE",
        help="the user's public key (from `roundpipe keys new`); without it a new pair is "
        "made and its secret written to --out",
    )
    p.add_argument(
        "--out", default=".", metavar="DIR", help="where a new NAME.key_secret goes (default .)"
    )
    sub.add_parser("list", parents=[keys_dir], help="list authorised identities and roles")
    p = sub.add_parser(
        "remove",
        parents=[keys_dir],
        help="withdraw an identity's key (its open connections end too)",
    )
    p.add_argument("name", metavar="NAME")
    sub.add_parser(
        "reload",
        parents=[keys_dir],
        help="make a running coordinator re-read authorized/ (it also does on any change)",
    )


def _cmd_keys(args: argparse.Namespace) -> int:
    from roundpipe.shared import keys

    try:
        if args.keys_command == "new":
            out = Path(args.out).expanduser() if args.out else keys.config_dir()
            secret = keys.new_key_pair(out)
            print(f"your key pair: {secret} (keep it; mode 0600)")
            print(
                f"send {secret.with_suffix('.key')} to the coordinator's admin, who runs "
                "`roundpipe keys add YOURNAME --role client --public-key FILE`; put the "
                f"coordinator's coordinator.key in {keys.config_dir()}"
            )
            return EXIT_OK
        keys_dir = Path(args.keys_dir).expanduser() if args.keys_dir else keys.default_keys_dir()
        if args.keys_command == "init":
            made = keys.init_keys(keys_dir)
            for path in made:
                print(f"wrote {path}")
            print(
                f"clients and workers need {keys_dir / 'coordinator.key'} (public); workers on "
                f"this host connect with {keys_dir / 'worker.key_secret'} (ROUNDPIPE_KEY), "
                "workers on other hosts each with their own key (`roundpipe keys add HOST "
                "--role worker`); authorise users with `roundpipe keys add NAME --role "
                "client|admin`"
            )
        elif args.keys_command == "add":
            path = keys.add_key(
                keys_dir,
                args.name,
                args.role,
                public_key=Path(args.public_key) if args.public_key else None,
                out_dir=Path(args.out),
            )
            if args.public_key:
                print(f"authorised {args.name} ({args.role}): {path}")
            else:
                print(
                    f"authorised {args.name} ({args.role}); its key pair is {path}: give it to "
                    f"{args.name} over a private channel, with {keys_dir / 'coordinator.key'}"
                )
        elif args.keys_command == "list":
            keys.authorized_dir(keys_dir)  # a wrong --keys-dir is an error, not "no keys"
            listed = keys.authorized_keys(keys_dir)
            rows = [(k.name, k.role, k.public_key.decode()[:12] + "...") for k in listed]
            print(_table(("NAME", "ROLE", "PUBLIC KEY"), rows) if rows else "no authorised keys")
            skipped = {p.stem for p in (keys_dir / keys.AUTHORIZED).glob("*.key")} - {
                k.name for k in listed
            }
            for name in sorted(skipped):
                _error(
                    f"{name}.key is ignored: not a public key with a role (client, worker, admin)"
                )
            names: dict[bytes, list[str]] = {}
            for k in listed:
                names.setdefault(k.public_key, []).append(k.name)
            for shared in (found for found in names.values() if len(found) > 1):
                _error(
                    f"{' and '.join(shared)} hold the same key: the coordinator refuses it "
                    "under every name; remove all but one (`roundpipe keys remove NAME`)"
                )
        elif args.keys_command == "remove":
            path = keys.remove_key(keys_dir, args.name)
            print(
                f"removed {path}; within a second a running coordinator refuses this key, "
                "on connections already open too"
            )
        elif args.keys_command == "reload":
            directory = keys.ask_reload(keys_dir)
            print(
                f"marked {directory} changed: a running coordinator using these keys re-reads "
                "them within a second (its log then lists the authorised keys); to make it "
                "re-read at once, send it SIGHUP"
            )
    except (keys.KeyFileError, OSError) as exc:
        _error(str(exc))
        return EXIT_FAILURE
    return EXIT_OK


def _cmd_timeline(args: argparse.Namespace) -> int:
    from roundpipe.timeline_plot import draw_job_timeline, parse_steps

    try:
        steps = parse_steps(args.steps) if args.steps else None
    except ValueError as exc:
        raise _UsageError(str(exc)) from None
    output_dir = Path(args.job)
    job = f"job in {output_dir}"
    if not output_dir.is_dir():  # a job id: ask for its output directory
        with _client(args) as client:
            status = client.status(args.job)
        if not status.output_dir:
            raise RoundPipeError(f"job {args.job} has no output directory yet ({status.state})")
        output_dir, job = Path(status.output_dir), f"job {args.job}"
    try:
        path, drawn, _ = draw_job_timeline(output_dir, Path(args.output), job=job, steps=steps)
    except (FileNotFoundError, ValueError) as exc:
        raise RoundPipeError(str(exc)) from None
    print(f"steps {drawn[0]}-{drawn[1]} of {job} drawn to {path}")
    return EXIT_OK


def _cmd_plan(args: argparse.Namespace) -> int:
    from roundpipe.plan_command import run_plan_command

    try:
        return run_plan_command(args)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


def _cmd_chaos(args: argparse.Namespace) -> int:
    from roundpipe.chaos import main as chaos_main

    return chaos_main(args.chaos_args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``roundpipe`` command; return its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["chaos"]:
        # The harness has its own parser (and -h); argparse.REMAINDER cannot take a
        # leading option, so hand the rest over directly.
        from roundpipe.chaos import main as chaos_main

        return chaos_main(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    stdout = sys.stdout
    sys.stdout = _Output(stdout)  # type: ignore[assignment]
    try:
        status = args.func(args)
        sys.stdout.flush()  # a full disk under `> file` fails here, not at exit
        return status
    except _OutputFailed as exc:
        _discard_output(stdout)
        _error(f"cannot write the output: {exc}")
        return EXIT_FAILURE
    except JobSpecError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except _UsageError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except (RoundPipeError, TimeoutError) as exc:
        # The spec's own fault (refused at submit, or a stored spec refused at resume)
        # is a usage error, whichever call it came from.
        _error(str(exc))
        return EXIT_USAGE if getattr(exc, "code", None) in _SPEC_ERROR_CODES else EXIT_FAILURE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        _error("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `roundpipe jobs | head`: the reader left; say nothing more.
        _discard_output(stdout)
        return EXIT_FAILURE
    except OSError as exc:
        if exc.filename is None:  # not about a path the user named: show where it came from
            raise
        # A file or directory the command reads or writes (a missing output directory,
        # no permission): the user's to fix.
        _error(_path_error(exc))
        return EXIT_FAILURE
    finally:
        sys.stdout = stdout


def _discard_output(stream: IO[str]) -> None:
    """Point ``stream``'s file at /dev/null once writing it failed (a closed pipe, a full
    disk): what its buffer still holds is flushed at exit, and must not fail again there.
    The stream itself stays ``sys.stdout``: a later ``main()`` in this process (tests)
    writes where its caller set it."""
    try:
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError, AttributeError):  # no file under it (a test's capture)
        return
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


class _OutputFailed(Exception):
    """Writing the command's output (its standard output) failed."""


class _Output:
    """The standard output, whose write failures (a full disk under ``roundpipe logs
    JOB > job.log``) name themselves: they gave a traceback."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _OutputFailed(exc.strerror or str(exc)) from None

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _OutputFailed(exc.strerror or str(exc)) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _path_error(exc: OSError) -> str:
    """``'PATH': reason`` (``'A' -> 'B'`` for a rename) of an OSError about a path."""
    where = repr(str(exc.filename))
    if exc.filename2 is not None:
        where += f" -> {str(exc.filename2)!r}"
    return f"{where}: {exc.strerror or exc}"


if __name__ == "__main__":
    sys.exit(main())
