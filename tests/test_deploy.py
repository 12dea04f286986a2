"""deploy/: systemd units verify, and the coordinator speaks the notify/watchdog protocol."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from roundpipe.coordinator.service.sdnotify import Notifier
from roundpipe.shared.arena import check_arena_root

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


def _directives(unit: Path) -> dict[str, list[str]]:
    """Key -> values of a unit file's [Service] section (continuation lines joined)."""
    text = unit.read_text().replace("\\\n", " ")
    section, found = "", {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


HARDENING = {
    "UMask": "0077",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "NoNewPrivileges": "yes",
    "CapabilityBoundingSet": "",
    "RestrictNamespaces": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "SystemCallArchitectures": "native",
    "DevicePolicy": "closed",
}


@pytest.mark.parametrize("name", ["roundpipe-coordinator.service", "roundpipe-worker@.service"])
def test_units_are_hardened_but_keep_dev_shm_and_ipc_shared(name: str) -> None:
    found = _directives(DEPLOY / name)
    for key, value in HARDENING.items():
        assert found.get(key) == [value], (key, found.get(key))
    assert "AF_UNIX" in found["RestrictAddressFamilies"][0]
    assert found["SystemCallFilter"][0] == "@system-service"
    # RemoveIPC= would delete the arenas in /dev/shm (files of the shared service user)
    # whenever one of the units stops; nothing may make /dev/shm private.
    assert "RemoveIPC" not in found or found["RemoveIPC"] == ["no"]
    for key in ("TemporaryFileSystem", "InaccessiblePaths", "ReadOnlyPaths"):
        assert not any("/dev" in v for v in found.get(key, [])), key
    env = (DEPLOY / "roundpipe.env").read_text()
    if name.startswith("roundpipe-coordinator"):
        # MemoryDenyWriteExecute= would refuse the optimizer's compiled (numba) kernel.
        assert "MemoryDenyWriteExecute" not in found and found["PrivateDevices"] == ["yes"]
        # Every write root of roundpipe.env is writable under ProtectSystem=strict.
        writable = {p.lstrip("-") for v in found["ReadWritePaths"] for p in v.split()}
        for line in env.splitlines():
            if line.startswith("ROUNDPIPE_ALLOW_WRITE="):
                for root in line.partition("=")[2].split(":"):
                    assert root in writable, (root, writable)
    else:  # the GPU: its device nodes, not a private /dev
        assert "PrivateDevices" not in found
        allowed = " ".join(found["DeviceAllow"])
        assert "char-nvidia-frontend rw" in allowed and "char-nvidia-uvm rw" in allowed


def test_workers_share_the_user_their_private_arenas_belong_to() -> None:
    """Each job's arenas are in a directory private to the coordinator's user (0700, files
    0600; roundpipe.shared.arena), so the workers run as that user; the configured root
    is what the coordinator gets, and it is one the coordinator accepts: a directory
    every user may write to only with the sticky bit, as /dev/shm."""
    coordinator = _directives(DEPLOY / "roundpipe-coordinator.service")
    worker = _directives(DEPLOY / "roundpipe-worker@.service")
    assert coordinator["User"] == worker["User"] == ["roundpipe"]
    assert coordinator["Group"] == worker["Group"]
    assert re.search(r"--arena-dir\s+\$\{ROUNDPIPE_ARENA_DIR\}", coordinator["ExecStart"][0])
    env = dict(
        line.split("=", 1)
        for line in (DEPLOY / "roundpipe.env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    root = env["ROUNDPIPE_ARENA_DIR"]
    assert root == "/dev/shm"
    # /run (RuntimeDirectory=) is a small tmpfs, and a root below the state directory
    # would not be RAM-backed: neither may hold the arenas.
    assert not root.startswith(("/run", "/var/lib"))
    if Path(root).is_dir():  # here as on the servers: root's, world-writable, sticky
        service_uid = 4242  # the roundpipe user does not exist here: any uid but root's
        assert check_arena_root(root, uid=service_uid) == Path(root).resolve()


SECURITY_LIMITS = {"roundpipe-coordinator.service": 4.0, "roundpipe-worker@3.service": 4.0}
"""Highest `systemd-analyze security` exposure each unit may have; docs/deploy.md records
the scores and why each setting that remains open does."""


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_units_security_exposure(tmp_path: Path) -> None:
    for unit in DEPLOY.glob("*.service"):
        shutil.copy(unit, tmp_path / unit.name)
    shutil.copy(tmp_path / "roundpipe-worker@.service", tmp_path / "roundpipe-worker@3.service")
    for name, limit in SECURITY_LIMITS.items():
        result = subprocess.run(
            ["systemd-analyze", "security", "--offline=yes", "--no-pager", name],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        score = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
        if score is None:
            pytest.skip(f"systemd-analyze security gave no score: {result.stderr[-300:]}")
        assert float(score.group(1)) <= limit, result.stdout


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


def test_notifier_never_blocks_when_nobody_reads(tmp_path: Path) -> None:
    """The I/O loop sends the notifications: with systemd's queue full (10 datagrams by
    default) a blocking send stalled the loop that answers every client and worker."""
    import threading

    sock, path = _fake_notify_socket(tmp_path)  # never read
    n = Notifier({"NOTIFY_SOCKET": path})
    sender = threading.Thread(target=lambda: [n.status(f"line {i}") for i in range(200)])
    sender.start()
    sender.join(timeout=30)
    assert not sender.is_alive(), "a notification blocked"
    n.close()
    sock.close()


def test_coordinator_notifies_ready_watchdog_and_stopping(tmp_path: Path, arena_dir: Path) -> None:
    sock, path = _fake_notify_socket(tmp_path)
    env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="400000")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "roundpipe.coordinator.service.main",
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
        status = "STATUS=listening on ipc://" + f"{tmp_path}/c.sock; 0 workers; no job running"
        while (
            sum(m == "WATCHDOG=1" for m in messages) < 3 or status not in messages
        ) and time.monotonic() < deadline:
            messages.append(sock.recv(4096).decode())
        assert status in messages, messages  # what `systemctl status` shows, kept current
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


def _families(unit: str) -> str:
    return ",".join(_directives(DEPLOY / unit)["RestrictAddressFamilies"][0].split())


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in (path.read_text() if path.exists() else ""):
        assert proc.poll() is None, f"exited {proc.returncode}:\n{path.read_text()}"
        assert time.monotonic() < deadline, path.read_text()
        time.sleep(0.05)


@pytest.mark.skipif(
    sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86-64 seccomp filter"
)
def test_the_daemons_run_under_the_address_families_their_units_allow(
    tmp_path: Path, arena_dir: Path
) -> None:
    """`RestrictAddressFamilies=` as systemd applies it (a seccomp filter on socket()):
    libzmq lists the interfaces (a netlink socket) when it binds a tcp:// address, and
    aborted the coordinator at start when netlink was not allowed (every 2 s, under
    Restart=always); gloo, for a multi-node group, needs it too."""
    restrict = [sys.executable, str(Path(__file__).parent / "procs" / "address_families.py")]
    bin_dir = Path(sys.executable).parent
    keys = tmp_path / "keys"
    subprocess.run([bin_dir / "roundpipe", "keys", "init", "--keys-dir", keys], check=True,
                   capture_output=True)  # fmt: skip
    with socket.socket() as a, socket.socket() as b:  # both held: two different ports
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        port, group_port = a.getsockname()[1], b.getsockname()[1]  # coordinator, gloo store
    address = f"tcp://127.0.0.1:{port}"
    coordinator_log, worker_log = tmp_path / "coordinator.log", tmp_path / "worker.log"
    env = {**os.environ, "ROUNDPIPE_KEY": str(keys / "worker.key_secret"),
           "ROUNDPIPE_COORDINATOR_KEY": str(keys / "coordinator.key")}  # fmt: skip
    with open(coordinator_log, "w") as out:
        coordinator = subprocess.Popen(
            [*restrict, _families("roundpipe-coordinator.service"), "--",
             str(bin_dir / "roundpipe-coordinator"), "--address", address, "--state-dir",
             str(tmp_path / "state"), "--arena-dir", str(arena_dir), "--keys-dir", str(keys)],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    worker = None
    try:
        _wait_for(coordinator_log, "ready on", coordinator)
        with open(worker_log, "w") as out:
            worker = subprocess.Popen(
                [*restrict, _families("roundpipe-worker@.service"), "--",
                 str(bin_dir / "roundpipe-worker"), "--cpu", "--threads", "1",
                 "--coordinator", address, "--name", "w1"],
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        _wait_for(worker_log, "joined coordinator", worker)
        member = subprocess.run(
            [*restrict, _families("roundpipe-coordinator.service"), "--", sys.executable,
             str(Path(__file__).parent / "procs" / "group_member.py"), "--rank", "0",
             "--world-size", "1", "--port", str(group_port)],
            input="", capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert member.stdout.strip() == "joined", member.stdout + member.stderr
    finally:
        for proc in (worker, coordinator):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)
    assert coordinator.returncode == 0, coordinator_log.read_text()
