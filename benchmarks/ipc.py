"""IPC micro-benchmarks of the runtime's foundation (issue: runtime foundation).

Measures, between real processes on this machine:
  1. message round trip over ZeroMQ with the runtime's codec (a StageTask out, a TaskDone
     back, each encoded and decoded by roundpipe.protocol), median of many;
  2. event-table signal-to-wake latency across processes, by how long the waiter has been
     waiting when the producer signals: 2 ms (RESULT: a pipeline stage waiting for its
     input; past the spin, in the poll-sleep phase of Note [waiting in three phases]),
     0 (still spinning) and 100 ms (deep sleep), with the CPU the waiter burns meanwhile;
  3. copying 256 MiB into an arena view vs into a plain tensor (ratio of throughputs).

Prints a table and, last, `RESULT roundtrip_us=<median> event_wake_us=<median>
arena_copy_ratio=<x>`. Targets on a 2-core machine: <= 150 us, <= 50 us, >= 0.9.

Usage: python benchmarks/ipc.py [--roundtrips N] [--wakes N] [--copy-mib M]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import zmq

from roundpipe.protocol import (
    EventSignal,
    EventWait,
    Heartbeat,
    MicrobatchIO,
    StageTask,
    TaskDone,
    TensorRef,
    decode,
    encode,
)
from roundpipe.shared.arena import DATA_START, Arena, default_arena_dir, prepare_arena_dir
from roundpipe.shared.events import EventTable
from roundpipe.shared.polling import poll_spinning

TABLE_OFFSET = DATA_START
STAMPS_OFFSET = DATA_START + 4096


def sample_task(i: int) -> StageTask:
    """A realistic backward StageTask over 4 layers: 9 microbatches, each with its stage
    input, input gradient and output gradient (bf16 [4, 2048, 2048]), 2 waits and 1
    signal; 4 weight waits, 4 gradient-slot waits and 4 signals. (The layers' gradient
    slots travel once, in JobSetup.)"""
    numel = 4 * 2048 * 2048

    def act(arena: str, slot: int) -> TensorRef:
        return TensorRef(
            arena=arena,
            offset=DATA_START + 2 * numel * slot,
            dtype="bfloat16",
            shape=(4, 2048, 2048),
            stride=None,  # row-major, as every arena slot (ArenaAllocator.alloc)
        )

    def wait(counter: int) -> EventWait:
        return EventWait(counter=counter, at_least=i)

    def signal(counter: int) -> EventSignal:
        return EventSignal(counter=counter, value=i)

    start, stop = 3, 7
    microbatches = [
        MicrobatchIO(
            index=m,
            input=act("acts", m),
            output=act("dacts", m),
            grad_output=act("dacts", 9 + m),
            labels=None,
            loss=None,
            saved=[],
            waits=[wait(m), wait(100 + m)],
            signals=[signal(200 + m)],
        )
        for m in range(9)
    ]
    layers = range(start, stop)
    return StageTask(
        job_id="job-1",
        task_id=i,
        attempt=0,
        iteration=i // 16,
        kind="backward",
        layer_start=start,
        layer_stop=stop,
        weight_version=max(i // 16 - 1, 0),
        weight_waits=[wait(300 + layer) for layer in layers],
        microbatches=microbatches,
        grad_waits=[wait(400 + layer) for layer in layers],
        grad_signals=[signal(500 + layer) for layer in layers],
        loss_denominator=0,
        seed=1234,
        wait_timeout_s=60.0,
    )


# -- child roles ---------------------------------------------------------------------


def _serve(address: str, reply: Callable[[list[bytes]], list[bytes]]) -> None:
    """Answer every message on a PAIR socket with ``reply(frames)`` until b"stop"."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(address)
    while True:
        poll_spinning(sock, -1)  # as the daemons' I/O loops receive
        frames = sock.recv_multipart()
        if frames == [b"stop"]:
            break
        sock.send_multipart(reply(frames))
    sock.close()
    ctx.term()


def _codec_reply(frames: list[bytes]) -> list[bytes]:
    """A Heartbeat comes back as it is; a StageTask is answered with its TaskDone."""
    message = decode(frames)
    if isinstance(message, Heartbeat):  # small-message round trip
        return encode(message)
    if not isinstance(message, StageTask):
        raise SystemExit(f"echo server: unexpected {type(message).__name__}")
    done = TaskDone(
        job_id=message.job_id,
        task_id=message.task_id,
        attempt=message.attempt,
        worker_id=1,
        seconds=0.0,
        layer_times={},
    )
    return encode(done)


def serve_echo(address: str) -> None:
    _serve(address, _codec_reply)


def serve_raw_echo(address: str) -> None:
    """Echo frames back untouched: the transport floor, no codec."""
    _serve(address, lambda frames: frames)


def _stamps(arena: Arena, n: int) -> ctypes.Array:
    # A ctypes view, not a tensor: indexing a tensor costs microseconds that would land
    # inside the measured interval.
    return (ctypes.c_double * n).from_buffer(arena.buffer, STAMPS_OFFSET)


def serve_waker(path: str, n: int, delay_s: float) -> None:
    arena = Arena.attach(path)
    table = EventTable(arena, TABLE_OFFSET)
    stamps = _stamps(arena, n)
    for i in range(1, n + 1):
        table.wait_at_least(1, i, timeout_s=60)  # the parent is about to wait for round i
        if delay_s:
            time.sleep(delay_s)  # long enough for the parent to be asleep in its wait
        stamps[i - 1] = time.perf_counter()
        table.signal(0, i)


# -- measurements --------------------------------------------------------------------


_WARMUP_ROUNDTRIPS = 200


def _time_roundtrips(role: str, n: int, exchange: Callable[[zmq.Socket, int], None]) -> list[float]:
    """Seconds of ``exchange(sock, i)`` (send one message, receive the answer) against a
    child process serving ``role``, after a warm-up."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock_dir = tempfile.TemporaryDirectory(prefix="rp-ipc-")
    address = f"ipc://{sock_dir.name}/bench.sock"
    sock.bind(address)
    child = subprocess.Popen([sys.executable, __file__, role, address])
    times = []
    try:
        for i in range(n + _WARMUP_ROUNDTRIPS):
            start = time.perf_counter()
            exchange(sock, i)
            if i >= _WARMUP_ROUNDTRIPS:
                times.append(time.perf_counter() - start)
        sock.send_multipart([b"stop"])
        child.wait(timeout=30)
    finally:
        child.kill()
        sock.close()
        ctx.term()
        sock_dir.cleanup()
    return times


def measure_roundtrip(n: int) -> list[float]:
    """Client: encode a StageTask, send, receive the TaskDone, decode it. The echo server
    decodes the task, builds a TaskDone and encodes it. Tasks are built before timing:
    the coordinator builds each task once whatever the transport (construction and the
    codec's parts are reported separately by ``measure_codec_parts``)."""
    tasks = [sample_task(i) for i in range(64)]

    def exchange(sock: zmq.Socket, i: int) -> None:
        task = tasks[i % len(tasks)]
        sock.send_multipart(encode(task))
        poll_spinning(sock, -1)
        reply = decode(sock.recv_multipart())
        assert isinstance(reply, TaskDone) and reply.task_id == task.task_id

    return _time_roundtrips("--serve-echo", n, exchange)


def measure_small_roundtrip(n: int) -> list[float]:
    """The same path with a Heartbeat both ways: transport + codec floor."""
    beat = Heartbeat(sender="bench", seq=1, sent_at=0.0)

    def exchange(sock: zmq.Socket, i: int) -> None:
        sock.send_multipart(encode(beat))
        poll_spinning(sock, -1)
        decode(sock.recv_multipart())

    return _time_roundtrips("--serve-echo", n, exchange)


def measure_raw_roundtrip(n: int) -> list[float]:
    """The StageTask's encoded frames echoed back as they are, no codec on either side:
    the transport floor for a message of that size."""
    frames = encode(sample_task(1))

    def exchange(sock: zmq.Socket, i: int) -> None:
        sock.send_multipart(frames)
        poll_spinning(sock, -1)
        sock.recv_multipart()

    return _time_roundtrips("--serve-raw-echo", n, exchange)


def measure_codec_parts(n: int = 300) -> dict[str, float]:
    """Median microseconds of building, encoding and decoding the sample StageTask."""
    out = {}
    task = sample_task(1)
    frames = encode(task)
    for name, fn in (
        ("construct", lambda: sample_task(1)),
        ("encode", lambda: encode(task)),
        ("decode", lambda: decode(frames)),
    ):
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        out[name] = statistics.median(samples) * 1e6
    out["descriptors"] = sum(
        (mb.input is not None) + (mb.output is not None) + (mb.grad_output is not None)
        for mb in task.microbatches
    )
    out["frame_bytes"] = sum(len(f) for f in frames)
    return out


def measure_wake(n: int, delay_s: float) -> tuple[list[float], float]:
    """Signal-to-wake latencies, and the waiter's CPU time as a share of its waiting."""
    # A private directory below the arena root, as a coordinator's job gets (Note
    # [private arena directory]): arena files are never created in a shared /dev/shm.
    with prepare_arena_dir(default_arena_dir(), "bench") as where:
        return _measure_wake(n, delay_s, where.path)


def _measure_wake(n: int, delay_s: float, directory: Path) -> tuple[list[float], float]:
    arena = Arena.create("bench-events", 4096 + 8 * n, directory=directory)
    try:
        table = EventTable.create(arena, TABLE_OFFSET, 4)
        stamps = _stamps(arena, n)
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve-waker", str(arena.path), str(n), str(delay_s)]
        )
        latencies = []
        waited = 0.0
        cpu_before = time.process_time()
        try:
            for i in range(1, n + 1):
                table.signal(1, i)
                start = time.perf_counter()
                table.wait_at_least(0, i, timeout_s=60)
                end = time.perf_counter()
                waited += end - start
                latencies.append(end - stamps[i - 1])
            cpu_share = (time.process_time() - cpu_before) / max(waited, 1e-9)
            child.wait(timeout=30)
        finally:
            child.kill()
        del stamps
        return latencies, cpu_share
    finally:
        arena.destroy()


def measure_copy(mib: int, reps: int) -> tuple[float, float]:
    nbytes = mib << 20
    source = torch.randn(nbytes // 4)
    plain = torch.empty_like(source)
    plain.zero_()  # fault the pages in before timing
    with prepare_arena_dir(default_arena_dir(), "bench") as where:
        return _measure_copy(source, plain, nbytes, reps, where.path)


def _measure_copy(
    source: torch.Tensor, plain: torch.Tensor, nbytes: int, reps: int, directory: Path
) -> tuple[float, float]:
    arena = Arena.create("bench-copy", nbytes, directory=directory)
    try:
        view = arena.view(arena.ref(DATA_START, torch.float32, (nbytes // 4,)))
        view.zero_()

        def best_of(dst: torch.Tensor) -> float:
            samples = []
            for _ in range(reps):
                start = time.perf_counter()
                dst.copy_(source)
                samples.append(time.perf_counter() - start)
            return statistics.median(samples)

        # Interleave the two so machine noise hits both alike.
        plain_t, arena_t = [], []
        for _ in range(3):
            plain_t.append(best_of(plain))
            arena_t.append(best_of(view))
        assert torch.equal(view, source)
        return statistics.median(plain_t), statistics.median(arena_t)
    finally:
        del view
        arena.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--roundtrips", type=int, default=3000)
    parser.add_argument("--wakes", type=int, default=400)
    parser.add_argument("--copy-mib", type=int, default=256)
    parser.add_argument("--copy-reps", type=int, default=5)
    parser.add_argument("--serve-echo", metavar="ADDR", help=argparse.SUPPRESS)
    parser.add_argument("--serve-raw-echo", metavar="ADDR", help=argparse.SUPPRESS)
    parser.add_argument("--serve-waker", nargs=3, metavar="X", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_echo:
        return serve_echo(args.serve_echo)
    if args.serve_raw_echo:
        return serve_raw_echo(args.serve_raw_echo)
    if args.serve_waker:
        path, n, delay = args.serve_waker
        return serve_waker(path, int(n), float(delay))

    torch.set_num_threads(1)
    rt = measure_roundtrip(args.roundtrips)
    small = measure_small_roundtrip(args.roundtrips)
    raw = measure_raw_roundtrip(args.roundtrips)
    parts = measure_codec_parts()
    wake_sleeping, cpu_sleeping = measure_wake(args.wakes, delay_s=0.002)
    wake_spinning, cpu_spinning = measure_wake(args.wakes, delay_s=0.0)
    wake_deep, cpu_deep = measure_wake(max(20, args.wakes // 8), delay_s=0.1)
    plain_s, arena_s = measure_copy(args.copy_mib, args.copy_reps)

    def us(samples: list[float], q: float) -> float:
        return (
            statistics.quantiles(samples, n=100)[int(q) - 1] * 1e6
            if q != 50
            else (statistics.median(samples) * 1e6)
        )

    rows = [
        ("zmq round trip, StageTask/TaskDone", us(rt, 50), us(rt, 90), us(rt, 99), len(rt)),
        (
            "zmq round trip, Heartbeat/Heartbeat",
            us(small, 50),
            us(small, 90),
            us(small, 99),
            len(small),
        ),
        (
            "zmq round trip, raw StageTask frames",
            us(raw, 50),
            us(raw, 90),
            us(raw, 99),
            len(raw),
        ),
    ]
    wakes = [
        ("event wake after 2 ms (poll-sleeping)", wake_sleeping, cpu_sleeping),
        ("event wake after 0 ms (spinning)", wake_spinning, cpu_spinning),
        ("event wake after 100 ms (deep sleep)", wake_deep, cpu_deep),
    ]
    print(f"{'measurement':40} {'p50 us':>10} {'p90 us':>10} {'p99 us':>10} {'n':>7}")
    for name, p50, p90, p99, count in rows:
        print(f"{name:40} {p50:10.1f} {p90:10.1f} {p99:10.1f} {count:7d}")
    print(f"\n{'measurement':40} {'p50 us':>10} {'p90 us':>10} {'waiter CPU':>10} {'n':>7}")
    for name, samples, cpu in wakes:
        print(
            f"{name:40} {us(samples, 50):10.1f} {us(samples, 90):10.1f} "
            f"{cpu * 100:9.1f}% {len(samples):7d}"
        )
    print(
        f"\nStageTask codec ({parts['descriptors']:.0f} tensor descriptors, "
        f"{parts['frame_bytes']:.0f} bytes on the wire): construct {parts['construct']:.0f} us, "
        f"encode {parts['encode']:.0f} us, decode {parts['decode']:.0f} us"
    )
    gbps = lambda s: (args.copy_mib / 1024) / s  # noqa: E731
    print(f"\n{'copy of ' + str(args.copy_mib) + ' MiB':40} {'ms':>10} {'GiB/s':>10}")
    print(f"{'  into a plain tensor':40} {plain_s * 1e3:10.1f} {gbps(plain_s):10.2f}")
    print(f"{'  into an arena view':40} {arena_s * 1e3:10.1f} {gbps(arena_s):10.2f}")
    ratio = plain_s / arena_s
    print(
        f"RESULT roundtrip_us={statistics.median(rt) * 1e6:.1f} "
        f"event_wake_us={statistics.median(wake_sleeping) * 1e6:.1f} "
        f"arena_copy_ratio={ratio:.2f}"
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
