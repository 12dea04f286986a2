"""The connection budget: how many connections the coordinator's ROUTER may hold, and
the hang-ups that keep it there, so that a flood of idle or half-open connections cannot
use up the file descriptors a running job and the admin's connection need (Note
[connection budget] below). ``main`` raises the open-files limit first
(``raise_open_files_limit``); the daemon builds the budget when it binds
(``ConnectionBudget.for_router``) and feeds it the ROUTER's monitor events on the I/O
thread (``handle_monitor_events``).
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import struct
import time

import psutil
import zmq
from zmq.utils.monitor import recv_monitor_message

from roundpipe.coordinator.service.auth import RateLimitedLog

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "ROUTER_EVENTS",
    "ConnectionBudget",
    "connection_budget",
    "handle_monitor_events",
    "raise_open_files_limit",
]

log = logging.getLogger("roundpipe.coordinator")

HANDSHAKE_TIMEOUT_S = 10.0
"""ZMQ_HANDSHAKE_IVL of the ROUTER: a connection that has not completed its handshake by
then is closed (libzmq's default is 30 s). Note [connection budget]."""
FD_RESERVE = 128
"""File descriptors kept out of the connection budget, besides those open when the
coordinator starts: a running job's files (arenas, checkpoint files, its log, the model
and data it reads, TensorBoard), the job store, the spec checker. A job on the tiny test
model holds about 12 more than an idle coordinator."""
METRICS_CONNECTIONS = 8
"""Connections the Prometheus endpoint serves at once (Note [bounded metrics endpoint] in
roundpipe.coordinator.service.metrics): kept out of the connection budget."""
MAX_CONNECTIONS = 4096
"""The connection budget's ceiling, whatever RLIMIT_NOFILE allows: every connection costs
libzmq buffers too."""
MIN_CONNECTIONS = 8
"""The connection budget's floor (with a warning) when RLIMIT_NOFILE leaves less."""
WANTED_OPEN_FILES = 65536
"""The soft RLIMIT_NOFILE ``main`` raises to (at most the hard limit)."""


# Note [connection budget]
# Every connection the ROUTER accepts holds a file descriptor from the moment it is
# accepted, long before its handshake says who is on the other end. 1,100 idle TCP
# connections against a coordinator limited to 1,024 open files left it unable to open
# anything: libzmq could no longer accept the admin's connection, and the running job's
# checkpoint could not open its files. So:
# - ``main`` raises the soft RLIMIT_NOFILE towards the hard one (WANTED_OPEN_FILES);
# - the ROUTER closes a connection whose handshake is not complete after
#   HANDSHAKE_TIMEOUT_S (ZMQ_HANDSHAKE_IVL);
# - the connections are bounded by a budget: the soft limit less the descriptors open at
#   start, FD_RESERVE (a job's files) and METRICS_CONNECTIONS (the Prometheus
#   endpoint's), at most MAX_CONNECTIONS. The ROUTER's monitor reports each accepted
#   connection with its descriptor and each closed one. Beyond the
#   budget the coordinator hangs up (shutdown(2): libzmq then closes the connection as it
#   would a peer's hang-up) connections that can still be in their handshake, i.e. that
#   were accepted less than HANDSHAKE_TIMEOUT_S ago (an older one has finished it, or
#   libzmq would have closed it): first those that have not sent a byte (TCP_INFO: an
#   idle flood), oldest first, then the others, oldest first. A legitimate peer sends
#   its greeting at once, so an idle flood never costs it its connection; an
#   authenticated connection older than the handshake limit is never hung up.
# - A descriptor is touched only after every event queued so far has been read, and only
#   if it still is a connection on the coordinator's own address (its local port or ipc
#   path; not a listener): a number libzmq has closed and reused for anything else is
#   left alone.
# ZMQ_MAX_SOCKETS bounds a context's ZeroMQ sockets, not the connections of one socket;
# ZMQ_BACKLOG only the kernel's queue of connections not yet accepted: neither helps.

ROUTER_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_TCP_INFO_BYTES_RECEIVED = 128
"""Offset of ``tcpi_bytes_received`` (a u64) in Linux's ``struct tcp_info`` (4.1+)."""


class ConnectionBudget:
    """The ROUTER's open connections by descriptor, and the hang-ups that keep them within
    ``budget`` (Note [connection budget]). Used on the I/O thread only."""

    def __init__(self, budget: int, local: str | bytes | int | None) -> None:
        self.budget = budget
        self.local = local  # the ROUTER's TCP port or ipc path; None: not checkable
        self._open: dict[int, float] = {}  # descriptor -> when accepted, oldest first
        self.hung_up = 0

    @classmethod
    def for_router(cls, router: zmq.Socket) -> ConnectionBudget:
        """The budget of a bound ROUTER (``connection_budget()`` connections on its
        address); logs it."""
        budget = cls(
            connection_budget(), local_identity(router.getsockopt_string(zmq.LAST_ENDPOINT))
        )
        log.info(
            "[coordinator] at most %d connections at a time (RLIMIT_NOFILE %s, %d open files, "
            "%d kept for jobs); handshakes time out after %gs",
            budget.budget,
            soft_open_files_limit(),
            open_files(),
            FD_RESERVE,
            HANDSHAKE_TIMEOUT_S,
        )
        return budget

    def __len__(self) -> int:
        return len(self._open)

    def accepted(self, fd: int) -> None:
        self._open.pop(fd, None)
        self._open[fd] = time.monotonic()

    def closed(self, fd: int) -> None:
        self._open.pop(fd, None)

    def enforce(self) -> tuple[int, int]:
        """Hang up connections beyond the budget; returns how many of them had sent
        nothing and how many had (but could still be in their handshake)."""
        excess = len(self._open) - self.budget
        if excess <= 0 or self.local is None:
            return 0, 0
        young_since = time.monotonic() - HANDSHAKE_TIMEOUT_S - 1.0
        silent: list[int] = []
        spoken: list[int] = []
        for fd, since in list(self._open.items()):  # oldest first
            if len(silent) >= excess:
                break
            if since < young_since:
                continue  # its handshake is over: authenticated
            received = _received_bytes(fd, self.local)
            if received is None:  # not our connection any more: a stale entry
                self._open.pop(fd, None)
                excess -= 1
                continue
            (silent if received == 0 else spoken).append(fd)
        victims = (silent + spoken)[: max(excess, 0)]
        hung = [fd for fd in victims if _hang_up(fd, self.local)]
        for fd in victims:
            self._open.pop(fd, None)  # its DISCONNECTED event, if any, finds nothing
        self.hung_up += len(hung)
        quiet = len(set(hung) & set(silent))
        return quiet, len(hung) - quiet


def _our_connection(fd: int, local: str | bytes | int) -> socket.socket | None:
    """A socket object over ``fd`` if it is a connection accepted on the ROUTER's address
    (else None); the caller must ``detach()`` it, never close it: libzmq owns ``fd``."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise OSError("a listener")
        name = sock.getsockname()
        if sock.family == socket.AF_UNIX:
            ours = name == local
        elif sock.family in (socket.AF_INET, socket.AF_INET6):
            ours = name[1] == local
            sock.getpeername()  # connected
        else:
            ours = False
        if ours:
            return sock
    except OSError:
        pass
    sock.detach()
    return None


def _received_bytes(fd: int, local: str | bytes | int) -> int | None:
    """Bytes received so far on connection ``fd`` (-1: cannot tell, e.g. ipc://), or None
    if ``fd`` is not a connection on the ROUTER's address."""
    sock = _our_connection(fd, local)
    if sock is None:
        return None
    try:
        if sock.family == socket.AF_UNIX or not hasattr(socket, "TCP_INFO"):
            return -1
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        if len(info) < _TCP_INFO_BYTES_RECEIVED + 8:
            return -1
        return struct.unpack_from("=Q", info, _TCP_INFO_BYTES_RECEIVED)[0]
    except OSError:
        return -1
    finally:
        sock.detach()


def _hang_up(fd: int, local: str | bytes | int) -> bool:
    """shutdown(2) connection ``fd`` if it is one on the ROUTER's address: libzmq sees
    the hang-up and closes it (the descriptor stays libzmq's to close)."""
    sock = _our_connection(fd, local)
    if sock is None:
        return False
    try:
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()


def local_identity(endpoint: str) -> str | bytes | int | None:
    """What ``getsockname()`` says for a connection accepted on ``endpoint`` (the
    ROUTER's bound address): its TCP port, or its ipc path (bytes for an abstract one)."""
    if endpoint.startswith("tcp://"):
        try:
            return int(endpoint.rsplit(":", 1)[1])
        except ValueError:
            return None
    if endpoint.startswith("ipc://@"):
        return b"\0" + endpoint[len("ipc://@") :].encode()
    if endpoint.startswith("ipc://"):
        return endpoint[len("ipc://") :]
    return None


def soft_open_files_limit() -> int | None:
    """The soft RLIMIT_NOFILE (None: unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return psutil.Process().num_fds()


def raise_open_files_limit() -> None:
    """Raise the soft RLIMIT_NOFILE to the hard one, at most WANTED_OPEN_FILES (systemd
    starts services at 1,024): more room for connections and job files alike."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = WANTED_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, WANTED_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:
            log.warning("[coordinator] cannot raise RLIMIT_NOFILE from %d: %s", soft, exc)


def connection_budget() -> int:
    """How many connections the ROUTER may hold (Note [connection budget]): the soft
    RLIMIT_NOFILE less the descriptors open now, FD_RESERVE and METRICS_CONNECTIONS,
    within [MIN_CONNECTIONS, MAX_CONNECTIONS]."""
    soft = soft_open_files_limit()
    if soft is None:
        return MAX_CONNECTIONS
    budget = soft - open_files() - FD_RESERVE - METRICS_CONNECTIONS
    if budget < MIN_CONNECTIONS:
        log.warning(
            "[coordinator] RLIMIT_NOFILE is %d: with %d files open and %d kept for jobs, "
            "that leaves room for only %d connections; allowing %d. Raise the limit "
            "(LimitNOFILE= in the systemd unit, `ulimit -n`)",
            soft,
            open_files(),
            FD_RESERVE,
            budget,
            MIN_CONNECTIONS,
        )
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, budget))


def handle_monitor_events(
    monitor: zmq.Socket, budget: ConnectionBudget, refusals: RateLimitedLog, noisy: RateLimitedLog
) -> None:
    """Read every event the ROUTER's monitor has queued (connections accepted and closed,
    failed handshakes), then hang up what exceeds the connection budget (Note
    [connection budget]). ``refusals`` logs the failed handshakes, ``noisy`` the
    hang-ups (both rate-limited: a peer provokes them at will)."""
    while True:
        try:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            break
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_ACCEPTED:
            budget.accepted(value)
        elif kind == zmq.EVENT_DISCONNECTED:
            budget.closed(value)
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            refusals.warning(
                "no-key",
                "refused a connection that failed the handshake: it offered another "
                "security mechanism (no key?)",
            )
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # A kind of its own: a flood of junk connections must not hide, behind one
            # rate-limited line, the client that came without a key.
            refusals.warning(
                "not-zmtp",
                "closed a connection that failed the handshake: it does not speak ZMTP, "
                "or did not finish its handshake within %gs",
                HANDSHAKE_TIMEOUT_S,
            )
    silent, waiting = budget.enforce()
    if silent or waiting:
        noisy.warning(
            "budget",
            "connection budget of %d reached: hung up %d connection(s) that had sent "
            "nothing and %d still in their handshake, oldest first (%d so far); a flood "
            "of connections? (docs/deploy.md, threat model)",
            budget.budget,
            silent,
            waiting,
            budget.hung_up,
        )
