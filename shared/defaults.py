"""Defaults shared by the client, the CLI and the daemons.

One definition of each, so ``roundpipe status`` finds the coordinator that
``roundpipe-coordinator`` started with no arguments, and ``roundpipe logs`` finds the log
files it wrote.

Environment variables (read when this module is imported, or when the functions below
are called):

``ROUNDPIPE_ADDRESS``
    ZeroMQ endpoint of the coordinator, e.g. ``tcp://127.0.0.1:7420`` or
    ``ipc:///run/roundpipe/coordinator.sock``.
``ROUNDPIPE_STATE_DIR``
    The coordinator's state directory (job store, per-job logs).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "CLIENT_TIMEOUT_S",
    "SUBMIT_TIMEOUT_S",
    "SPEC_CHECK_TIMEOUT_S",
    "DEFAULT_ADDRESS",
    "FALLBACK_ADDRESS",
    "MAX_IPC_PATH",
    "default_address",
    "default_state_dir",
    "bind_endpoint_arg",
    "endpoint_arg",
    "endpoint_problem",
    "env_non_negative",
]

FALLBACK_ADDRESS = "tcp://127.0.0.1:7420"
"""The coordinator's address when ``ROUNDPIPE_ADDRESS`` is not set."""


ENDPOINT_EXAMPLES = "tcp://127.0.0.1:7420 or ipc:///path/to/coordinator.sock"
"""What a coordinator address looks like, for messages."""


def endpoint_problem(address: str, *, connect: bool = True) -> str | None:
    """What is wrong with a coordinator address (a ZeroMQ endpoint: ``tcp://HOST:PORT``
    with a port from 1 to 65535, ``ipc://PATH`` or ``inproc://NAME``), or None. The
    client, the coordinator (``--address``) and the worker (``--coordinator``) check it
    alike: ZeroMQ took port 99999 as 34463, and a worker died of "Invalid argument".
    ``connect``: an address to connect to, where the host ``*`` (every interface, to
    bind) means nothing."""
    transport, sep, rest = address.partition("://")
    if not sep or transport not in ("tcp", "ipc", "inproc") or not rest:
        return f"expected a ZeroMQ endpoint such as {ENDPOINT_EXAMPLES}"
    if transport == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host:
            return "a tcp:// address is tcp://HOST:PORT"
        if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
            return f"its port {port!r} is not a number from 1 to 65535"
        if connect and host == "*":
            return "'*' (every interface) is for the coordinator to bind; name its host"
    return None


def endpoint_arg(text: str, *, connect: bool = True) -> str:
    """An address option of a daemon (argparse ``type``: ``bind_endpoint_arg`` for the
    coordinator's): a usage error naming what is wrong with it (``endpoint_problem``)."""
    import argparse

    problem = endpoint_problem(text, connect=connect)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"invalid address {text!r}: {problem}")
    return text


def bind_endpoint_arg(text: str) -> str:
    """``endpoint_arg`` of an address to bind (``tcp://*:PORT`` allowed)."""
    return endpoint_arg(text, connect=False)


def default_address() -> str:
    """``$ROUNDPIPE_ADDRESS`` if set and not empty, else :data:`FALLBACK_ADDRESS`."""
    return os.environ.get("ROUNDPIPE_ADDRESS") or FALLBACK_ADDRESS


DEFAULT_ADDRESS: str = default_address()
"""The coordinator's address, fixed when this module is imported (see
:func:`default_address` to re-read the environment)."""


def default_state_dir() -> Path:
    """The coordinator's state directory.

    ``$ROUNDPIPE_STATE_DIR``, else ``$XDG_STATE_HOME/roundpipe``, else
    ``~/.local/state/roundpipe`` (the XDG base-directory default). Not created here.
    """
    explicit = os.environ.get("ROUNDPIPE_STATE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    # The XDG spec says a relative XDG_STATE_HOME is invalid and must be ignored.
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "roundpipe"
    return Path.home() / ".local" / "state" / "roundpipe"


CLIENT_TIMEOUT_S: float = 10.0
"""Seconds a client waits for the coordinator's reply to one request before it reports
the coordinator unavailable. Every request is answered without waiting for training
work, so this only trips when no coordinator is listening (or it is wedged)."""

SPEC_CHECK_TIMEOUT_S: float = 300.0
"""Longest the coordinator's check of one spec may take before its child is killed and
the spec refused (coordinator/service/admission.py)."""

SUBMIT_TIMEOUT_S: float = SPEC_CHECK_TIMEOUT_S + 60.0
"""The least a client waits for the reply to a SubmitJob or ResumeJob: before accepting a
job the coordinator reads (and tokenizes) its whole data file, so that an empty, broken
or mismatched dataset is refused at submit rather than after the job started. Longer
than the check may take: a client that gave up first reported the coordinator gone
while it accepted and ran the job."""


def env_non_negative(name: str, default: float, unit: str, off: str) -> float:
    """A non-negative number from environment variable `name` (in `unit`), or `default`.
    `off` says what 0 does, for the error message of a value that is not a number."""
    raw = os.environ.get(name, str(default))
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of {unit} (0 {off})") from None
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {raw!r}")
    return value


MAX_IPC_PATH = 100
"""Longest ipc:// socket path used as is: a Unix socket's path holds about 107 bytes
(sun_path). A launcher with a longer one picks another (the demo a TCP port, a
``LocalCluster`` a short private directory)."""
