"""systemd's notify protocol (sd_notify) without libsystemd: READY, STATUS, WATCHDOG, STOPPING.

Under ``Type=notify`` systemd passes ``NOTIFY_SOCKET`` (a datagram socket path, or an
abstract one starting with ``@``) and, with ``WatchdogSec=``, ``WATCHDOG_USEC`` (and
``WATCHDOG_PID``). The coordinator sends ``READY=1`` once it listens, a ``STATUS=`` line
when its workers or jobs change (checked once a heartbeat interval), ``WATCHDOG=1`` from its I/O loop at half the watchdog interval (so a
wedged loop gets the service restarted), and ``STOPPING=1`` on shutdown. Outside systemd
every call is a cheap no-op.
"""

from __future__ import annotations

import os
import socket
import time

__all__ = ["Notifier"]


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self._address: str | bytes | None = None
        if path.startswith("@"):
            self._address = "\0" + path[1:]  # abstract namespace
        elif path.startswith("/"):
            self._address = path
        self._sock: socket.socket | None = None
        if self._address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        watchdog_for_us = pid is None or pid == str(os.getpid())
        self.watchdog_interval_s: float | None = None
        if usec and usec.isdigit() and int(usec) > 0 and watchdog_for_us:
            self.watchdog_interval_s = int(usec) / 1e6 / 2
        self._next_ping = 0.0

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *lines: str) -> None:
        if self._sock is None or self._address is None:
            return
        try:
            # Never blocks: the caller is the I/O loop, and a datagram socket whose
            # receiver lags blocks a sender once its queue (10 datagrams) is full.
            self._sock.sendto("\n".join(lines).encode(), socket.MSG_DONTWAIT, self._address)
        except OSError:
            pass  # systemd gone or its queue full: notifications are best effort

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    def watchdog_tick(self) -> None:
        """Call often from the main loop; pings at half the configured interval."""
        if self.watchdog_interval_s is None:
            return
        now = time.monotonic()
        if now >= self._next_ping:
            self.send("WATCHDOG=1")
            self._next_ping = now + self.watchdog_interval_s

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
