"""Who is on the other end of a coordinator connection, and what they may do.

Two ways to authenticate, chosen by the coordinator's key directory (roundpipe.shared.keys):

- **keys** (``coordinator.key_secret`` exists; required for tcp://): the ROUTER is a
  CurveZMQ server; a peer completes the handshake only with a key listed in
  ``authorized/``, and its identity is that file's name, its role the file's ``role``.
  A connection is bound to the key it shook hands with, not to the name: removing a
  key, or replacing the key or role behind a name, applies to every open connection
  from the next re-read on (see Note [sessions belong to keys]).
- **peer credentials** (ipc:// without keys): who may connect is decided by the
  socket directory's permissions (0770 with a group, see docs/deploy.md); the kernel
  tells the coordinator the connecting process's uid (SO_PEERCRED, which libzmq passes
  to the ZAP handler as the peer address ``host:uid:gid:pid``). The identity is
  ``unix:<user>``; the coordinator's own user and root are admin and worker, every other
  user a client.

libzmq asks the ZAP handler (a socket at ``inproc://zeromq.zap.01``, served from the
coordinator's I/O loop) once per connection; a refused peer never completes its
handshake, so nothing it sends reaches the coordinator. Every accepted message carries
the identity the handler returned (``User-Id``) and, on ipc://, the peer's credentials
(``Peer-Address``): :meth:`Authenticator.peer` turns those into a :class:`Peer`.

``authorized/`` is re-read when it changes: the coordinator's I/O loop checks once a
second, and every handshake checks first (:meth:`Authenticator.reload`). The check
compares a fingerprint of the directory and of each ``*.key`` file (inode, size,
modification and change times), so a file rewritten in place (``cp`` over it, an editor
turning ``admin`` into ``client``) counts as a change, not only an added or removed
name. SIGHUP (:func:`request_reload`, installed by the daemon) forces a re-read whatever
the fingerprint says.
"""

from __future__ import annotations

import logging
import os
import pwd
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

from roundpipe.shared.keys import AUTHORIZED, authorized_keys, coordinator_key_pair

__all__ = [
    "ZAP_ENDPOINT",
    "Authenticator",
    "AuthSetupError",
    "Peer",
    "RateLimitedLog",
    "request_reload",
]

log = logging.getLogger("roundpipe.coordinator")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"roundpipe"
_UNIX_PREFIX = "unix:"

_reload_requests = 0
"""How many times this process was asked to re-read its keys (SIGHUP)."""


def request_reload(signum: int | None = None, frame: object = None) -> None:
    """Make every Authenticator of this process re-read ``authorized/`` at its next
    check, whether or not the files look changed. Usable as a signal handler (the
    coordinator's SIGHUP): it only counts; the I/O loop does the reading."""
    global _reload_requests
    _reload_requests += 1


class AuthSetupError(RuntimeError):
    """The coordinator cannot authenticate peers on its address (e.g. tcp:// without
    keys); the message says what to set up."""


@dataclass(frozen=True)
class Peer:
    """An authenticated peer, as one message's metadata says."""

    name: str
    roles: frozenset[str]
    # The connecting process's pid, from the kernel (ipc:// only), else None.
    pid: int | None = None

    @property
    def admin(self) -> bool:
        return "admin" in self.roles

    @property
    def worker(self) -> bool:
        return "worker" in self.roles

    @property
    def client(self) -> bool:
        return bool(self.roles & {"client", "admin"})


class RateLimitedLog:
    """Logs the first refusal of each kind, then at most one summary line per
    ``interval_s`` with the count of those not shown: a flood of refused connections or
    messages cannot fill the disk. Kinds are a few fixed strings, so memory is bounded."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        """Every refusal of each kind so far, logged or not."""

    def warning(self, kind: str, text: str, *args: object) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        now = time.monotonic()
        if now < self._next.get(kind, 0.0):
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        skipped = self._suppressed.pop(kind, 0)
        self._next[kind] = now + self.interval_s
        more = f" ({skipped} more like it in the last {self.interval_s:.0f}s not shown)"
        log.warning("[coordinator] " + text + (more if skipped else ""), *args)


class Authenticator:
    """The ZAP handler and the per-message identity lookup of one coordinator."""

    def __init__(self, address: str, keys_dir: Path) -> None:
        self.address = address
        self.keys_dir = Path(keys_dir)
        self.ipc = address.startswith("ipc://")
        self.server_keys = coordinator_key_pair(self.keys_dir)
        if self.server_keys is None and not self.ipc:
            raise AuthSetupError(
                f"{address} is reachable by other hosts' and users' processes, so it needs "
                f"keys: run `roundpipe keys init --keys-dir {self.keys_dir}` (then authorise "
                "clients with `roundpipe keys add`; docs/deploy.md), or serve an ipc:// "
                "address whose directory permissions decide who may connect"
            )
        self.mode = "keys" if self.server_keys is not None else "peer-credentials"
        self.refusals = RateLimitedLog()
        self._by_key: dict[bytes, tuple[str, str]] = {}  # Z85 public key -> (name, role)
        self._roles: dict[str, frozenset[str]] = {}  # unix:<user> -> roles (ipc only)
        self._fingerprint: object = _NEVER_READ
        self._requests_seen = _reload_requests
        self.reloads = 0
        """How many times ``authorized/`` was read."""
        self.reload()

    # -- setup ----------------------------------------------------------------------

    def configure(self, router: zmq.Socket) -> None:
        """Make ``router`` authenticate every connection (before it binds)."""
        router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        if self.server_keys is not None:
            router.curve_server = True
            router.curve_publickey, router.curve_secretkey = self.server_keys

    def reload(self) -> None:
        """Re-read ``authorized/`` if it changed since the last read, or if SIGHUP asked
        for it (:func:`request_reload`). Cheap when nothing changed: one stat per file.
        It runs once a second and before each handshake."""
        if self.server_keys is None:
            return
        directory = self.keys_dir / AUTHORIZED
        requested = self._requests_seen != _reload_requests
        self._requests_seen = _reload_requests
        # Taken before the files are read: a change made while they are read shows up
        # as a new fingerprint at the next check.
        fingerprint = _fingerprint(directory)
        if fingerprint == self._fingerprint and not requested:
            return
        self._fingerprint = fingerprint
        keys = authorized_keys(self.keys_dir)
        names: dict[bytes, list[str]] = {}
        for k in keys:
            names.setdefault(k.public_key, []).append(k.name)
        shared = {key: found for key, found in names.items() if len(found) > 1}
        for found in shared.values():
            log.warning(
                "[coordinator] one key is authorised as %s: it is refused under every "
                "name until all but one of them are removed (`roundpipe keys remove NAME`)",
                " and ".join(found),
            )
        keys = [k for k in keys if k.public_key not in shared]
        self._by_key = {k.public_key: (k.name, k.role) for k in keys}
        self.reloads += 1
        log.info(
            "[coordinator] %d authorised key(s) in %s%s: %s",
            len(keys),
            directory,
            " (re-read on request)" if requested else "",
            ", ".join(f"{k.name} ({k.role})" for k in keys) or "none",
        )

    # -- ZAP ------------------------------------------------------------------------

    def handle_zap(self, sock: zmq.Socket) -> None:
        """Answer one ZAP request waiting on ``sock`` (a ROUTER at ZAP_ENDPOINT)."""
        frames = sock.recv_multipart()
        try:
            sep = frames.index(b"")
        except ValueError:
            return
        envelope, request = frames[: sep + 1], frames[sep + 1 :]
        if len(request) < 6:
            return
        version, request_id, _domain, address, _identity, mechanism = request[:6]
        try:
            status, user_id, text = self._decide(
                mechanism, request[6:], address.decode(errors="replace")
            )
        except Exception:  # never leave a handshake hanging: refuse and say why
            log.exception("[coordinator] the ZAP handler failed; the connection is refused")
            status, user_id, text = b"500", b"", b"internal error"
        sock.send_multipart([*envelope, version, request_id, status, text, user_id, b""])

    def _decide(self, mechanism: bytes, credentials: list[bytes], address: str):
        if self.server_keys is not None:
            if mechanism != b"CURVE" or len(credentials) != 1:
                self.refusals.warning(
                    "no-key",
                    "refused a connection that failed the handshake: no CURVE key (from %s)",
                    address or "?",
                )
                return b"400", b"", b"a key is required"
            self.reload()
            found = self._by_key.get(z85.encode(credentials[0]))
            if found is None:
                self.refusals.warning(
                    "unknown-key",
                    "refused a connection from %s: its key %s is not authorised",
                    address or "?",
                    z85.encode(credentials[0]).decode()[:12] + "...",
                )
                return b"400", b"", b"key not authorised"
            # The User-Id every message of this connection carries is the key itself,
            # not the name it is authorised under: Note [sessions belong to keys].
            return b"200", z85.encode(credentials[0]), b"OK"
        creds = _ipc_credentials(address) if self.ipc else None
        if mechanism != b"NULL" or creds is None:
            self.refusals.warning(
                "no-creds", "refused a connection with no peer credentials (%s)", address or "?"
            )
            return b"400", b"", b"peer credentials required"
        uid = creds[0]
        name = _UNIX_PREFIX + _user_name(uid)
        roles = {"client"}
        if uid in (0, os.getuid()):
            roles = {"admin", "worker"}
        self._roles[name] = frozenset(roles)
        return b"200", name.encode(), b"OK"

    # -- per message ----------------------------------------------------------------

    def peer(self, frame: zmq.Frame) -> Peer | None:
        """The peer who sent the message ending in ``frame``, or None if the key its
        connection shook hands with is no longer authorised (removed, or replaced by
        another key under the same name)."""
        try:
            user_id = frame.get("User-Id")
        except zmq.ZMQError:
            return None
        if not user_id:
            return None
        if self.server_keys is not None:
            found = self._by_key.get(user_id.encode())
            if found is None:
                return None
            name, roles = found[0], frozenset({found[1]})
        else:
            name = user_id
            roles = self._roles.get(name)
            if roles is None:
                return None
        pid = None
        if self.ipc:
            try:
                creds = _ipc_credentials(frame.get("Peer-Address"))
            except zmq.ZMQError:
                creds = None
            pid = creds[2] if creds else None
        return Peer(name, roles, pid)


# Note [sessions belong to keys]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# libzmq asks the ZAP handler once per connection; every later message on that
# connection carries the User-Id the handler returned then. When that was the key's
# name, a role was looked up by name at each message, so after `keys remove carol` and
# `keys add carol --public-key NEW.key` the connection made with carol's old key
# answered again, with whatever role the new carol got. The User-Id is therefore the
# public key the peer proved it holds, and each message is looked up by key: a removed
# or replaced key finds nothing from the next re-read on, and its messages are dropped;
# a new connection with it fails the handshake. A role changed in place (the same key,
# another role) applies to the open connections too. Jobs still belong to the name, so
# a re-keyed user keeps them.
#
# One public key authorised under two names would make the identity depend on the
# order of the files; `roundpipe keys add` refuses it, and the re-read refuses such a
# key under every name.

_NEVER_READ = object()


def _fingerprint(directory: Path) -> tuple | None:
    """What changes when a file in ``directory`` is added, removed, renamed or written:
    the directory's own inode and times, and each ``*.key`` file's name, device, inode,
    size, modification and change times (nanoseconds). None if it cannot be listed."""
    try:
        top = directory.stat()
        files = []
        with os.scandir(directory) as entries:
            for entry in entries:
                if not entry.name.endswith(".key"):
                    continue
                try:
                    st = entry.stat()  # follows a link: a changed target counts
                except OSError:
                    files.append((entry.name,))
                    continue
                files.append(
                    (entry.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                )
    except OSError:
        return None
    return (top.st_ino, top.st_mtime_ns, top.st_ctime_ns), tuple(sorted(files))


def _ipc_credentials(address: str) -> tuple[int, int, int] | None:
    """(uid, gid, pid) from libzmq's ipc peer address ``host:uid:gid:pid``."""
    parts = address.rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        return int(parts[1]), int(parts[2]), int(parts[3])
    except ValueError:
        return None


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
