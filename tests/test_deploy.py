"""deploy/: systemd units verify, and the coordinator speaks the notify/watchdog protocol."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from roundpipe.coordinator.sdnotify import Notifier

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_units_verify(tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent  # the units' ExecStart must point at real binaries
    for unit in DEPLOY.glob("*.service"):
        text = unit.read_text().replace("/opt/roundpipe/venv/bin/", f"{bin_dir}/")
        (tmp_path / unit.name).write_text(text)
    (tmp_path / "roundpipe.target").write_text((DEPLOY / "roundpipe.target").read_text())
    shutil.copy(tmp_path / "roundpipe-worker@.service", tmp_path / "roundpipe-worker@3.service")
    result = subprocess.run(
        [
            "systemd-analyze",
            "verify",
            "--man=no",
            "roundpipe-coordinator.service",
            "roundpipe-worker@3.service",
            "roundpipe.target",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr
    coordinator = (DEPLOY / "roundpipe-coordinator.service").read_text()
    for needed in (
        "Type=notify",
        "WatchdogSec=",
        "Restart=always",
        "User=roundpipe",
        "StateDirectory=roundpipe",
        "EnvironmentFile=",
        "LimitMEMLOCK=infinity",
    ):
        assert needed in coordinator
    worker = (DEPLOY / "roundpipe-worker@.service").read_text()
    assert "--gpu %i" in worker and "After=roundpipe-coordinator.service" in worker
    assert "Restart=always" in worker


def _fake_notify_socket(tmp_path: Path) -> tuple[socket.socket, str]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    return sock, path


def test_notifier_is_a_no_op_outside_systemd() -> None:
    n = Notifier({})
    assert not n.enabled and n.watchdog_interval_s is None
    n.ready("x")
    n.watchdog_tick()  # nothing to send to, nothing raised


def test_notifier_protocol(tmp_path: Path) -> None:
    sock, path = _fake_notify_socket(tmp_path)
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})
    assert n.watchdog_interval_s == pytest.approx(0.1)
    n.ready("listening")
    assert sock.recv(4096).decode().splitlines()[0] == "READY=1"
    n.watchdog_tick()
    n.watchdog_tick()  # rate-limited: one ping per half interval
    assert sock.recv(4096) == b"WATCHDOG=1"
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(4096)
    other = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval_s is None  # the watchdog is someone else's
    n.close()
    sock.close()


def test_coordinator_notifies_ready_watchdog_and_stopping(tmp_path: Path, arena_dir: Path) -> None:
    sock, path = _fake_notify_socket(tmp_path)
    env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="400000")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "roundpipe.coordinator.daemon",
            "--address",
            f"ipc://{tmp_path}/c.sock",
            "--state-dir",
            str(tmp_path / "state"),
            "--arena-dir",
            str(arena_dir),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        messages = []
        deadline = time.monotonic() + 60
        while sum(m == "WATCHDOG=1" for m in messages) < 3 and time.monotonic() < deadline:
            messages.append(sock.recv(4096).decode())
        assert messages[0].startswith("READY=1"), messages
        assert f"MAINPID={proc.pid}" in messages[0]
        assert sum(m == "WATCHDOG=1" for m in messages) >= 3
        proc.send_signal(signal.SIGTERM)
        rest = []
        while "STOPPING=1" not in rest:
            rest.append(sock.recv(4096).decode())
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()
        sock.close()
