"""A worker is lost when it is silent, never because the coordinator was (Note [a
stalled loop hears no heartbeat] in coordinator/service/daemon.py)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from roundpipe.cluster import cpu_cluster

TIMEOUT_S = 4


def test_a_stalled_coordinator_does_not_declare_its_workers_lost(tmp_path: Path) -> None:
    """The coordinator is frozen for longer than --worker-timeout (as an overloaded host
    or a paused VM would freeze it) while its worker keeps sending heartbeats: they wait
    unread in the socket. Once it runs again it must count that time as its own stall,
    not the worker's silence: the worker stays, and is not killed."""
    with cpu_cluster(
        tmp_path, "stall", ["--worker-timeout", str(TIMEOUT_S)], num_workers=1
    ) as cluster:
        worker = cluster.workers["w1"]
        cluster.coordinator.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(1.5 * TIMEOUT_S)  # the stall itself (not a wait for an outcome)
        finally:
            cluster.coordinator.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 60
        while "this loop stalled for" not in cluster.coordinator.tail(100_000):
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.05)
        # The check that follows a stall runs in the same turn of the loop as the
        # excuse, before this request is answered.
        assert [w.name for w in cluster.client.workers()] == ["w1"], cluster.logs()
        assert worker.alive(), cluster.logs()
        assert "lost:" not in cluster.coordinator.tail(100_000), cluster.logs()


def test_waiting_for_named_workers_waits_out_the_one_replaced(tmp_path: Path) -> None:
    """A worker that exited stays listed until the coordinator's next liveness check, so
    "three workers listed" can be met by the stopped one before its replacement joins:
    the chaos harness once started a job with its fault-armed worker not yet connected,
    and the fault never fired. Waiting for names waits for exactly those."""
    with cpu_cluster(tmp_path, "named", num_workers=2) as cluster:
        cluster.signal_worker("w2", signal.SIGTERM)
        cluster.workers.pop("w2").proc.wait(timeout=60)
        cluster.add_worker("w3")
        cluster.wait_for_workers(2, exactly=["w1", "w3"])
        assert sorted(w.name for w in cluster.client.workers()) == ["w1", "w3"]


def test_a_worker_that_reconnects_is_not_killed_under_its_old_registration(
    tmp_path: Path,
) -> None:
    """The coordinator's loop stalls longer than the worker's --coordinator-timeout: the
    worker gives up on it and registers again on a new connection, the same process.
    Its old registration is lost at once (its tasks would be re-dispatched), and its
    process is not fenced: it used to be SIGKILLed a heartbeat timeout later. The stall
    is long (21 s): the worker's tries used to back off up to 8 s apart, and a stall
    ending inside such a pause left the old registration to time out first."""
    with cpu_cluster(
        tmp_path,
        "reconnect",
        ["--worker-timeout", "2"],
        num_workers=1,
        worker_args=["--coordinator-timeout", "1.5", "--handshake-timeout", "2"],
    ) as cluster:
        worker = cluster.workers["w1"]
        deadline = time.monotonic() + 60
        while "heard the coordinator's heartbeat" not in worker.tail(100_000):
            assert time.monotonic() < deadline, cluster.logs()  # (it checks only after)
            time.sleep(0.05)
        cluster.coordinator.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(21)  # the stall itself (not a wait for an outcome)
        finally:
            cluster.coordinator.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 60
        while "lost: reconnected as worker" not in cluster.coordinator.tail(100_000):
            assert time.monotonic() < deadline and worker.alive(), cluster.logs()
            time.sleep(0.05)
        time.sleep(3)  # past the old registration's heartbeat timeout
        assert worker.alive(), cluster.logs()
        assert "fenced" not in cluster.coordinator.tail(100_000), cluster.logs()
        assert [w.name for w in cluster.client.workers()] == ["w1"], cluster.logs()


def test_a_stall_inside_the_loops_own_checks_is_excused(
    tmp_path: Path, arena_dir: Path, monkeypatch
) -> None:
    """The loop's once-a-second checks stall before the workers are judged (here the
    keys are re-read slowly, as a busy disk or a lock another thread holds makes them):
    that stall is excused too. It was measured only before the checks, so a healthy
    worker, beating every second, was declared lost in the same turn."""
    import zmq
    from coordinator_helpers import serving
    from runtime_helpers import fake_hello

    from roundpipe import cli
    from roundpipe.coordinator.service.daemon import Coordinator
    from roundpipe.protocol import ErrorReply, Heartbeat, Welcome, decode, encode
    from roundpipe.shared.keys import apply_connect_keys, connect_keys

    keys = tmp_path / "keys"
    assert cli.main(["keys", "init", "--keys-dir", str(keys)]) == 0
    secret = tmp_path / "w1"
    assert (
        cli.main(
            ["keys", "add", "w1", "--role", "worker", "--out", str(secret), "--keys-dir", str(keys)]
        )
        == 0
    )
    c = Coordinator(
        "tcp://127.0.0.1:*", tmp_path / "state", arena_dir, keys_dir=keys, worker_timeout_s=2.0
    )
    c.bind()
    c.address = c.router.getsockopt(zmq.LAST_ENDPOINT).decode()
    with serving(c):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        apply_connect_keys(sock, connect_keys(secret / "w1.key_secret", keys / "coordinator.key"))
        sock.connect(c.address)
        sock.send_multipart(encode(fake_hello(worker_name="w1")))
        assert sock.poll(60_000) and isinstance(decode(sock.recv_multipart()), Welcome)
        reload, stalled = c.auth.reload, []

        def slow_reload() -> None:
            if not stalled:
                stalled.append(True)
                time.sleep(4)  # the stall itself, twice the worker timeout
            reload()

        monkeypatch.setattr(c.auth, "reload", slow_reload)
        for seq in range(1, 17):  # 8 s of beats, every 0.5 s, and the 4 s stall
            sock.send_multipart(encode(Heartbeat(sender="w1", seq=seq, sent_at=time.time())))
            assert sock.poll(60_000), "a heartbeat was not answered"
            reply = decode(sock.recv_multipart())
            assert not isinstance(reply, ErrorReply), reply  # unknown_worker: declared lost
            time.sleep(0.5)
        assert stalled  # the checks ran once a second: the stall happened among the beats
        assert [e.hello.worker_name for e in c.workers._workers.values()] == ["w1"]
        sock.close()
