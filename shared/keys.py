"""CurveZMQ key files: the coordinator's key directory, authorised keys with roles, and
the keys a client or worker connects with. See docs/deploy.md ("Keys and access").

The coordinator's key directory (``--keys-dir``, ``$ROUNDPIPE_KEYS_DIR``, else
``<state-dir>/keys``)::

    keys/
      coordinator.key          its public key: clients and workers need a copy
      coordinator.key_secret   its key pair (0600)
      worker.key_secret        the key pair local workers connect with (0600)
      authorized/              who may connect, one public key per identity:
        worker.key               metadata role = "worker"
        alice.key                metadata role = "client"
        ops.key                  metadata role = "admin"

Files are pyzmq's certificate format (``zmq.auth``), so czmq tools can read them too.
The file name (without ``.key``) is the identity: jobs belong to it, logs name it. A
connection belongs to the key it was made with (roundpipe.coordinator.service.auth): removing
or replacing a key ends the connections made with it. One key is one identity: give
each worker host its own (``roundpipe keys add gpu-host-2 --role worker``), so that one
host can be revoked alone.

A running coordinator re-reads ``authorized/`` within a second of any change, a file
rewritten in place included; :func:`ask_reload` (``roundpipe keys reload``) marks the
directory changed, which makes it re-read even when no file changed.

A client or worker finds its keys in ``--key`` / ``$ROUNDPIPE_KEY`` (its own
``*.key_secret``; default ``~/.config/roundpipe/client.key_secret``) and
``--coordinator-key`` / ``$ROUNDPIPE_COORDINATOR_KEY`` (the coordinator's public
``coordinator.key``; default ``~/.config/roundpipe/coordinator.key``, else
``/etc/roundpipe/coordinator.key``, else the one in the keys directory: ``default_keys_dir``).
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq

__all__ = [
    "ROLES",
    "AuthorizedKey",
    "ConnectKeys",
    "KeyFileError",
    "add_key",
    "apply_connect_keys",
    "ask_reload",
    "authorized_dir",
    "authorized_keys",
    "check_name",
    "config_dir",
    "connect_keys",
    "default_keys_dir",
    "init_keys",
    "new_key_pair",
    "remove_key",
]

ROLES = ("client", "worker", "admin")
"""client: submits jobs and manages its own; admin: manages every job; worker: runs tasks."""

COORDINATOR = "coordinator"
AUTHORIZED = "authorized"
SYSTEM_COORDINATOR_KEY = Path("/etc/roundpipe/coordinator.key")
"""Where a shared server publishes its coordinator's public key for every user."""
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
"""An identity's name, matched whole (fullmatch: ``$`` would also accept a name ending in
a newline, a file that ``keys list`` shows split and ``keys remove`` cannot name)."""
_ROLE_LINE = re.compile(r'^\s+role\s*=\s*"([^"]*)"\s*$', re.MULTILINE)


class KeyFileError(ValueError):
    """A key file is missing, unreadable or malformed, or a key operation cannot be done
    (a bad name or role, a key that exists already); the message says which and what to
    do."""


@dataclass(frozen=True)
class AuthorizedKey:
    name: str
    role: str
    public_key: bytes  # Z85, 40 bytes
    path: Path


@dataclass(frozen=True)
class ConnectKeys:
    """What a client or worker socket needs for CURVE: its own pair (Z85) and the
    coordinator's public key (Z85), plus where they came from (for error messages)."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes
    key_path: Path
    server_key_path: Path


def default_keys_dir() -> Path:
    """``$ROUNDPIPE_KEYS_DIR``, else ``<default state dir>/keys``."""
    from roundpipe.shared.defaults import default_state_dir

    explicit = os.environ.get("ROUNDPIPE_KEYS_DIR")
    return Path(explicit).expanduser() if explicit else default_state_dir() / "keys"


def config_dir() -> Path:
    """Where a user's own keys live: ``$XDG_CONFIG_HOME/roundpipe`` (``~/.config/roundpipe``)."""
    xdg = os.environ.get("XDG_CONFIG_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".config"
    return base / "roundpipe"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name == COORDINATOR:
        raise KeyFileError(
            f"invalid key name {name!r}: use 1-64 letters, digits, '_', '.' or '-' (not "
            f"starting with '.' or '-', and not {COORDINATOR!r})"
        )
    return name


def _write_key_file(path: Path, public: bytes, secret: bytes | None, role: str | None) -> None:
    """One certificate in zmq.auth's format (``zmq.auth.load_certificate`` reads it),
    written to a temporary file and renamed: a reader never sees half a key."""
    lines = ["#   RoundPipe CURVE key (zmq.auth certificate format)", "metadata"]
    if role is not None:
        lines.append(f'    role = "{role}"')
    lines += ["curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".new-key-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(tmp, 0o600 if secret is not None else 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_pair(directory: Path, name: str, role: str | None) -> Path:
    """A fresh key pair as ``directory/name.key`` (public, 0644) and
    ``directory/name.key_secret`` (0600); returns the secret file."""
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    _write_key_file(directory / f"{name}.key", public, None, role)
    _write_key_file(directory / f"{name}.key_secret", public, secret, role)
    return directory / f"{name}.key_secret"


_MAX_KEY_FILE_BYTES = 64 * 1024
"""A certificate is a few hundred bytes; anything far larger is not one."""


def _read_key_file(path: Path) -> str:
    """The text of a key file, refused unless it is a small regular file, and read from
    the descriptor that was checked: a FIFO blocked the reader forever (a coordinator
    re-reading ``authorized/`` stalled with it), and /dev/zero or a /proc file (regular,
    of size 0) filled its memory."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO's open blocks
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise KeyFileError(
                f"{path} is not a regular file (a device, a pipe or a directory): a key "
                "file is the small text file `roundpipe keys` writes"
            )
        data = f.read(_MAX_KEY_FILE_BYTES + 1)
    if len(data) > _MAX_KEY_FILE_BYTES:
        raise KeyFileError(
            f"{path} holds more than {_MAX_KEY_FILE_BYTES} bytes: not a key file (a few "
            "hundred bytes, written by `roundpipe keys`)"
        )
    return data.decode("utf-8", errors="replace")


_KEY_LINE = re.compile(r'^\s*(public-key|secret-key)\s*=\s*"([^"]*)"\s*$', re.MULTILINE)
"""A key line of zmq.auth's certificate format, as ``_write_key_file`` writes it."""


def _load(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    """The public key and (``secret``: required) the secret key of a key file."""
    try:
        text = _read_key_file(path)  # KeyFileError, not caught below: it names the path
    except OSError as exc:
        raise KeyFileError(f"cannot read the key file {path}: {exc}") from None
    return _parse_key_file(path, text, secret=secret)


def _parse_key_file(path: Path, text: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    found = {kind: value.encode() for kind, value in _KEY_LINE.findall(text)}
    public, secret_key = found.get("public-key"), found.get("secret-key")
    if (
        public is None
        or len(public) != 40
        or (secret and (not secret_key or len(secret_key) != 40))
    ):
        what = "a key pair (*.key_secret)" if secret else "a public key (*.key)"
        raise KeyFileError(f"{path} is not {what} in zmq.auth certificate format")
    return public, secret_key


def init_keys(keys_dir: Path) -> list[Path]:
    """Create a coordinator key pair, the ``authorized/`` directory and a ``worker``
    key (role worker) in ``keys_dir``. Refuses to overwrite an existing coordinator key
    (every client would have to be given the new public key). Returns the files made."""
    keys_dir = Path(keys_dir)
    if (keys_dir / f"{COORDINATOR}.key_secret").exists():
        raise KeyFileError(
            f"{keys_dir} already holds a coordinator key; remove {keys_dir}/{COORDINATOR}.key* "
            "first to replace it (every client and worker then needs the new public key)"
        )
    keys_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(keys_dir, 0o750)
    (keys_dir / AUTHORIZED).mkdir(exist_ok=True)
    made = [_write_pair(keys_dir, COORDINATOR, None)]
    made.append(add_key(keys_dir, "worker", "worker", out_dir=keys_dir))
    return made


def new_key_pair(out_dir: Path, name: str = "client") -> Path:
    """A key pair for a user (``roundpipe keys new``): ``out_dir/name.key_secret`` stays
    with the user, ``out_dir/name.key`` goes to the coordinator's admin."""
    check_name(name)
    secret = Path(out_dir) / f"{name}.key_secret"
    if secret.exists():
        raise KeyFileError(f"{secret} exists already; remove it first to make a new key")
    return _write_pair(Path(out_dir), name, None)


def add_key(
    keys_dir: Path,
    name: str,
    role: str,
    *,
    public_key: Path | None = None,
    out_dir: Path | None = None,
) -> Path:
    """Authorise identity ``name`` with ``role``: with ``public_key`` (a user's ``.key``
    file) that key; else a fresh pair whose secret file goes to ``out_dir``. Returns the
    authorised public key file (with ``public_key``) or the new secret file."""
    check_name(name)
    if role not in ROLES:
        raise KeyFileError(f"invalid role {role!r}: choose one of {', '.join(ROLES)}")
    authorized = authorized_dir(keys_dir)
    target = authorized / f"{name}.key"
    if target.exists():
        raise KeyFileError(
            f"identity {name!r} is authorised already ({target}); `roundpipe keys remove "
            f"{name}` first to replace its key"
        )
    if public_key is not None:
        key, _ = _load(Path(public_key), secret=False)
        for other in authorized_keys(keys_dir):
            if other.public_key == key:
                raise KeyFileError(
                    f"the key in {public_key} is authorised already as {other.name!r} "
                    f"({other.path}); one key is one identity: make {name} a key pair of "
                    "its own (`roundpipe keys new`, or `keys add` without --public-key)"
                )
        _write_key_file(target, key, None, role)
        return target
    if out_dir is None:
        raise KeyFileError("give the user's public key (--public-key) or where to write a new pair")
    secret = Path(out_dir) / f"{name}.key_secret"
    if secret.exists():
        raise KeyFileError(f"{secret} exists already; remove it or choose another --out")
    secret = _write_pair(Path(out_dir), name, role)
    public, _ = _load(secret, secret=True)
    _write_key_file(target, public, None, role)
    return secret


def remove_key(keys_dir: Path, name: str) -> Path:
    """Withdraw identity ``name``: within a second a running coordinator refuses its
    key, on connections already open too (their messages are dropped)."""
    check_name(name)
    target = Path(keys_dir) / AUTHORIZED / f"{name}.key"
    try:
        target.unlink()
    except FileNotFoundError:
        raise KeyFileError(f"no authorised key named {name!r} in {target.parent}") from None
    return target


def authorized_dir(keys_dir: Path) -> Path:
    """``keys_dir/authorized``; KeyFileError if it is not there (a wrong --keys-dir must
    not read as "nobody is authorised")."""
    authorized = Path(keys_dir) / AUTHORIZED
    if not authorized.is_dir():
        raise KeyFileError(
            f"{authorized} does not exist; is --keys-dir the coordinator's key directory? "
            f"(create one with `roundpipe keys init --keys-dir {keys_dir}`)"
        )
    return authorized


def ask_reload(keys_dir: Path) -> Path:
    """Mark ``keys_dir/authorized`` changed (its modification time becomes now): every
    coordinator using it re-reads its keys at its next check, within a second, even if
    no file changed. No signal and no pid needed, only the write access that ``keys
    add`` and ``keys remove`` need. Returns the directory."""
    authorized = authorized_dir(keys_dir)
    try:
        os.utime(authorized)
    except PermissionError:
        raise KeyFileError(
            f"no permission to mark {authorized} changed; run this as the user that owns "
            "the keys (e.g. `sudo -u roundpipe roundpipe keys reload ...`), or send the "
            "coordinator SIGHUP"
        ) from None
    return authorized


def authorized_keys(keys_dir: Path) -> list[AuthorizedKey]:
    """Every authorised key, by name. A file without a valid role or key is skipped
    (and reported by ``roundpipe keys list``), never given a default role."""
    out = []
    for path in sorted((Path(keys_dir) / AUTHORIZED).glob("*.key")):
        try:
            text = _read_key_file(path)  # once: the file may change between two reads
            public, _ = _parse_key_file(path, text, secret=False)
        except (KeyFileError, OSError):
            continue
        role_match = _ROLE_LINE.search(text)
        if role_match is None or role_match.group(1) not in ROLES or not _NAME.fullmatch(path.stem):
            continue
        out.append(AuthorizedKey(path.stem, role_match.group(1), public, path))
    return out


def coordinator_key_pair(keys_dir: Path) -> tuple[bytes, bytes] | None:
    """The coordinator's (public, secret) Z85 keys, or None if the directory has none."""
    path = Path(keys_dir) / f"{COORDINATOR}.key_secret"
    if not path.exists():
        return None
    public, secret = _load(path, secret=True)
    assert secret is not None
    return public, secret


def connect_keys(
    key: str | os.PathLike[str] | None = None,
    coordinator_key: str | os.PathLike[str] | None = None,
) -> ConnectKeys | None:
    """The keys to connect with: explicit paths, else ``$ROUNDPIPE_KEY`` /
    ``$ROUNDPIPE_COORDINATOR_KEY``, else the default files. None when no key of its own
    is configured anywhere (the connection then uses no CURVE: fine for an ipc://
    coordinator without keys, refused by one with keys)."""
    explicit = key is not None or os.environ.get("ROUNDPIPE_KEY")
    key_path = Path(key or os.environ.get("ROUNDPIPE_KEY") or config_dir() / "client.key_secret")
    if not _exists(key_path.expanduser()):
        if explicit:
            raise KeyFileError(
                f"key file {key_path} does not exist (--key / ROUNDPIPE_KEY); create one with "
                "`roundpipe keys new` and ask the coordinator's admin to authorise it"
            )
        return None
    key_path = key_path.expanduser()
    public, secret = _load(key_path, secret=True)
    candidates = (
        [Path(coordinator_key)]
        if coordinator_key is not None
        else [Path(os.environ["ROUNDPIPE_COORDINATOR_KEY"])]
        if os.environ.get("ROUNDPIPE_COORDINATOR_KEY")
        else [
            config_dir() / f"{COORDINATOR}.key",
            SYSTEM_COORDINATOR_KEY,
            default_keys_dir() / f"{COORDINATOR}.key",
        ]
    )
    for server_path in candidates:
        server_path = server_path.expanduser()
        if _exists(server_path):
            server, _ = _load(server_path, secret=False)
            assert secret is not None
            return ConnectKeys(public, secret, server, key_path, server_path)
    raise KeyFileError(
        f"no coordinator public key found (looked at {', '.join(map(str, candidates))}); "
        "copy the coordinator's coordinator.key there or point --coordinator-key / "
        "ROUNDPIPE_COORDINATOR_KEY at it"
    )


def _exists(path: Path) -> bool:
    """Whether ``path`` exists; a path this user may not even look at (another user's
    home) does not, for the purpose of finding a default key."""
    try:
        return path.exists()
    except OSError:
        return False


def apply_connect_keys(sock: zmq.Socket, keys: ConnectKeys | None) -> None:
    """Make ``sock`` a CURVE client with ``keys`` (before connect); None: leave it as is."""
    if keys is None:
        return
    sock.curve_secretkey = keys.secret_key
    sock.curve_publickey = keys.public_key
    sock.curve_serverkey = keys.server_key
