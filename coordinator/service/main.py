"""``roundpipe-coordinator``: the command line, and the start-up around the daemon.

``main`` parses the options, sets the process up (file modes, torch threads, logging,
the open-files limit: Note [connection budget] in roundpipe.coordinator.service.connections),
forks the spec checker while the process has one thread (Note [forked spec checker] in
roundpipe.coordinator.service.admission), binds the Coordinator (roundpipe.coordinator.service.daemon), joins the data-parallel
group if asked, starts the metrics server if asked, and serves until SIGTERM/SIGINT.
Exit status: 0 stopped; 2 cannot start (the message says why); 3 a follower lost the
group's rank 0 (systemd restarts it to join the new group: docs/multi-node.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import zmq

from roundpipe.coordinator.service.admission import SpecValidator
from roundpipe.coordinator.service.auth import AuthSetupError, request_reload
from roundpipe.coordinator.service.connections import raise_open_files_limit
from roundpipe.coordinator.service.daemon import (
    WORKER_LOST_AFTER_S,
    AddressInUse,
    Coordinator,
)
from roundpipe.coordinator.service.jobstore import JobStoreError
from roundpipe.coordinator.service.metrics import MetricsServer
from roundpipe.coordinator.spec.paths import (
    GROUP_MODES,
    PRIVATE_MODES,
    PathPolicy,
    set_modes,
    set_strict_reads,
)
from roundpipe.coordinator.training.multinode import (
    DEFAULT_DIST_TIMEOUT_S,
    GroupError,
    GroupSettings,
    NodeGroup,
    settings_from_args,
)
from roundpipe.shared.arena import ArenaError
from roundpipe.shared.keys import KeyFileError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from roundpipe.shared.defaults import DEFAULT_ADDRESS, bind_endpoint_arg

    # SIGHUP: re-read the authorised keys (only counted here; the I/O loop's next key
    # check re-reads). Set first, so a SIGHUP while starting up does not end the process.
    signal.signal(signal.SIGHUP, request_reload)

    parser = argparse.ArgumentParser(
        prog="roundpipe-coordinator",
        description="RoundPipe coordinator: owns training state, schedules stage tasks.",
    )
    parser.add_argument(
        "--address",
        default=DEFAULT_ADDRESS,
        type=bind_endpoint_arg,
        help="ZeroMQ address to bind (default %(default)s)",
    )
    parser.add_argument("--state-dir", default=None, help="jobs, logs, outputs")
    parser.add_argument(
        "--arena-dir",
        default=None,
        help="RAM-backed directory for shared-memory arenas (default /dev/shm)",
    )
    parser.add_argument(
        "--keys-dir",
        default=None,
        help="CurveZMQ keys: coordinator.key_secret and authorized/ (default "
        "$ROUNDPIPE_KEYS_DIR, else STATE_DIR/keys; create with `roundpipe keys init`); "
        "required for tcp://, optional for ipc:// (see docs/deploy.md)",
    )
    parser.add_argument(
        "--worker-timeout",
        type=float,
        default=WORKER_LOST_AFTER_S,
        help="seconds without a worker heartbeat before the worker is declared lost and "
        "its tasks go to the others (default %(default)s)",
    )
    parser.add_argument(
        "--wait-timeout",
        type=float,
        default=600.0,
        help="seconds a task may wait for an input before failing",
    )
    parser.add_argument(
        "--task-deadline",
        type=float,
        default=60.0,
        help="a worker with tasks in flight that completes none for this many seconds "
        "(or 20x the job's slowest task so far, if longer) is lost and fenced (default "
        "%(default)s; raise it for long sequences on slow or shared CPU workers)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for the optimizer (default: half the cores, leaving the "
        "rest to the workers' host-side work); a job's optimizer.threads overrides it",
    )
    parser.add_argument(
        "--allow-read",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory below which job specs may name data, models, tokenizers and "
        "checkpoints (repeatable; also $ROUNDPIPE_ALLOW_READ, ':'-separated). Always "
        "allowed: write roots, STATE_DIR/jobs and the shipped demo data",
    )
    parser.add_argument(
        "--allow-write",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory below which job specs may name output directories (repeatable; "
        "also $ROUNDPIPE_ALLOW_WRITE). Always allowed: STATE_DIR/jobs",
    )
    parser.add_argument(
        "--group-access",
        action="store_true",
        default=os.environ.get("ROUNDPIPE_GROUP_ACCESS", "") not in ("", "0"),
        help="write files 0640 and directories 0750 (the coordinator's group may read "
        "results) instead of 0600/0700 (also $ROUNDPIPE_GROUP_ACCESS=1)",
    )
    parser.add_argument(
        "--metrics-address",
        default=os.environ.get("ROUNDPIPE_METRICS_ADDRESS") or None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics over HTTP at http://HOST:PORT/metrics (default: "
        "$ROUNDPIPE_METRICS_ADDRESS, else off; see docs/observability.md)",
    )
    parser.add_argument(
        "--dist-init",
        default=None,
        metavar="tcp://HOST:PORT",
        help="join a data-parallel group of coordinators (one per server) whose rank 0 "
        "listens at HOST:PORT; with --rank and --world-size. Without it, torchrun's "
        "MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE are used when set (docs/multi-node.md). "
        "The group's traffic is not authenticated: a private network only",
    )
    parser.add_argument("--rank", type=int, default=None, help="this coordinator's rank")
    parser.add_argument(
        "--world-size", type=int, default=None, help="number of coordinators in the group"
    )
    parser.add_argument(
        "--dist-timeout",
        type=float,
        default=DEFAULT_DIST_TIMEOUT_S,
        help="seconds to wait for the other coordinators to join, and for a silent or "
        "stuck node before the job pauses (default %(default)s)",
    )
    parser.add_argument(
        "--max-jobs-per-owner",
        type=int,
        default=None,
        metavar="N",
        help="most jobs one identity may have queued or running at once; a submission or "
        "resume beyond it is refused, saying to wait or cancel one (default: no limit)",
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if args.max_jobs_per_owner is not None and args.max_jobs_per_owner < 1:
        parser.error(f"--max-jobs-per-owner must be at least 1, got {args.max_jobs_per_owner}")
    try:
        group_settings = settings_from_args(
            args.dist_init, args.rank, args.world_size, args.dist_timeout
        )
    except ValueError as exc:
        parser.error(str(exc))
    # Everything this process writes (state, checkpoints, exports, logs) is private by
    # default; spec paths were resolved when accepted, so reads follow no new links.
    set_modes(GROUP_MODES if args.group_access else PRIVATE_MODES)
    set_strict_reads(True)
    import torch

    from roundpipe.coordinator.training.optimizer import default_threads

    torch.set_num_threads(args.threads or default_threads())
    # Models, tokenizers and data are local by design: never wait on the hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    threading.current_thread().name = "rp-coordinator"
    raise_open_files_limit()  # Note [connection budget]
    # Job specs are validated on the I/O thread; import transformers (seconds) now, not
    # inside the first client request, which would then miss the client's timeout.
    import transformers  # noqa: F401

    # The spec checker is forked now, while this process may still be single-threaded:
    # the Coordinator below starts the ZeroMQ context and threads. Forked, it has every
    # import already (a spawned one re-imports torch and transformers: seconds of CPU).
    # start() spawns it instead where another thread already runs (Note [forked spec
    # checker] in roundpipe.coordinator.service.admission). A data-parallel follower takes
    # no submissions, so it runs no checker at all.
    validator = None
    if group_settings is None or group_settings.rank == 0:
        validator = SpecValidator(strict_reads=True)
        validator.start(fork=True)
    try:
        return _serve(args, group_settings, validator)
    finally:
        if validator is not None:
            validator.close()  # serve() closed it already, unless it never got that far


def _serve(
    args: argparse.Namespace, group_settings: GroupSettings | None, validator: SpecValidator | None
) -> int:
    from roundpipe.shared.defaults import default_state_dir

    state_dir = args.state_dir or default_state_dir()
    keys_dir = args.keys_dir or os.environ.get("ROUNDPIPE_KEYS_DIR") or Path(state_dir) / "keys"
    coordinator = Coordinator(
        args.address,
        state_dir,
        args.arena_dir,
        wait_timeout_s=args.wait_timeout,
        task_deadline_s=args.task_deadline,
        worker_timeout_s=args.worker_timeout,
        paths=PathPolicy.for_coordinator(state_dir, args.allow_read, args.allow_write),
        keys_dir=keys_dir,
        max_jobs_per_owner=args.max_jobs_per_owner,
        spec_validator=validator,
    )
    # Before bind: from then on a stop ends serve() at once and cleans up (an ipc://
    # socket file). Set after, a SIGTERM that came once the socket existed (systemd
    # stopping a coordinator still starting up) ended the process with the default
    # action, the file left behind (test_forkserver saw it: status -15).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: coordinator.stop())
    try:
        coordinator.bind()
    except (
        AddressInUse,
        ArenaError,
        AuthSetupError,
        FileNotFoundError,
        JobStoreError,
        KeyFileError,
        zmq.ZMQError,
    ) as exc:
        print(f"roundpipe-coordinator: {exc}", file=sys.stderr)
        return 2
    group = None
    if group_settings is not None:
        # Joining waits for the other nodes (up to --dist-timeout): a stop meanwhile
        # ends the process at once, as it always has, rather than after the wait.
        handlers = {
            sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            group = NodeGroup.join(group_settings)
        except GroupError as exc:
            print(f"roundpipe-coordinator: {exc}", file=sys.stderr)
            return 2
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        coordinator.join_group(group)
    metrics = None
    if args.metrics_address:  # observability (coordinator.metrics)
        try:
            metrics = MetricsServer(coordinator.metrics_snapshot, args.metrics_address)
        except (ValueError, OSError) as exc:
            print(f"roundpipe-coordinator: --metrics-address: {exc}", file=sys.stderr)
            return 2
    coordinator.serve()
    if metrics is not None:
        metrics.close()
    if group is not None:
        group.close()
    if coordinator.group_lost is not None:
        print(f"roundpipe-coordinator: {coordinator.group_lost}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
