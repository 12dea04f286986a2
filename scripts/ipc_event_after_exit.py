"""What does an imported CUDA IPC event do once its exporting process is killed?

CUDA leaves it undefined (Note [dead producers and imported events] in
roundpipe.shared.handoff), and the runtime never relies on the answer: this measures it on
real hardware so the docs can say what happens. Two cases, each in fresh processes:

``pending``  the exporter records the event behind ~5 s of GPU work and is SIGKILLed
             before it completes;
``done``     the exporter records the event, waits for it to complete, then is SIGKILLed.

For each, an importer opened the handle while the exporter lived and, after the kill,
reports ``event.query()`` and whether a stream that waits on the event (and a host
``synchronize``) finishes within 10 s. Every probe runs under a timeout, so a hang is
reported as ``"hang"``, never waited out.

    python scripts/ipc_event_after_exit.py [--out DIR]

Writes ``ipc_event_after_exit.json`` into DIR (default ``$OUT`` or the working
directory) and prints it; the last line is ``RESULT pending=<outcome> done=<outcome>``.
Without CUDA it writes ``{"cuda": false}`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

WAIT_S = 10.0


def exporter(case: str) -> None:
    import torch

    event = torch.cuda.Event(interprocess=True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        if case == "pending":
            torch.cuda._sleep(10_000_000_000)  # several seconds of GPU time
        event.record(stream)
    if case == "done":
        event.synchronize()
    print(bytes(event.ipc_handle()).hex(), flush=True)
    time.sleep(600)  # until killed


def importer(handle_hex: str) -> None:
    import torch

    event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", 0), bytes.fromhex(handle_hex))
    print("opened", flush=True)
    sys.stdin.readline()  # the parent kills the exporter, then writes a line
    report: dict[str, object] = {}
    try:
        report["query_after_kill"] = bool(event.query())
    except Exception as exc:  # noqa: BLE001 - the finding is the error itself
        report["query_after_kill"] = f"error: {type(exc).__name__}: {exc}"
    outcome: dict[str, object] = {}

    def wait() -> None:
        try:
            stream = torch.cuda.Stream()
            stream.wait_event(event)
            marker = torch.cuda.Event()
            marker.record(stream)
            marker.synchronize()
            outcome["stream_wait"] = "completed"
        except Exception as exc:  # noqa: BLE001
            outcome["stream_wait"] = f"error: {type(exc).__name__}: {exc}"

    thread = threading.Thread(target=wait, daemon=True)
    started = time.perf_counter()
    thread.start()
    thread.join(WAIT_S)
    report["stream_wait"] = outcome.get("stream_wait", f"hang (> {WAIT_S:.0f}s)")
    report["stream_wait_s"] = round(time.perf_counter() - started, 3)
    if thread.is_alive():
        report["context_after"] = "not checked: the wait hung (synchronize would too)"
    else:
        try:
            (torch.ones(4, device="cuda") * 2).sum().item()  # is the context still usable?
            report["context_after"] = "usable"
        except Exception as exc:  # noqa: BLE001
            report["context_after"] = f"error: {type(exc).__name__}: {exc}"
    print(json.dumps(report), flush=True)
    os._exit(0)  # a hung wait thread must not keep the process


def probe(case: str) -> dict[str, object]:
    me = [sys.executable, __file__]
    exp = subprocess.Popen(
        [*me, "--role", "exporter", "--case", case], stdout=subprocess.PIPE, text=True
    )
    imp = None
    try:
        handle = _read_line(exp, 120)
        if handle is None:
            return {"outcome": "exporter did not start"}
        imp = subprocess.Popen(
            [*me, "--role", "importer", "--handle", handle],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if _read_line(imp, 120) != "opened":
            return {"outcome": "importer could not open the handle"}
        exp.send_signal(signal.SIGKILL)
        exp.wait(timeout=30)
        assert imp.stdin is not None
        imp.stdin.write("go\n")
        imp.stdin.flush()
        line = _read_line(imp, WAIT_S + 60)
        if line is None:
            return {"outcome": "hang (importer did not report; killed)"}
        report = json.loads(line)
        report["outcome"] = f"query={report['query_after_kill']} wait={report['stream_wait']}"
        return report
    finally:
        for p in (exp, imp):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str | None:
    box: list[str] = []
    reader = threading.Thread(
        target=lambda: box.append(proc.stdout.readline().strip()), daemon=True
    )
    reader.start()
    reader.join(timeout_s)
    return box[0] if box and box[0] else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or ".")
    parser.add_argument("--role", choices=["exporter", "importer"])
    parser.add_argument("--case", choices=["pending", "done"], default="pending")
    parser.add_argument("--handle")
    args = parser.parse_args()
    if args.role == "exporter":
        exporter(args.case)
        return 0
    if args.role == "importer":
        importer(args.handle)
        return 0
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        result: dict[str, object] = {"cuda": False}
    else:
        result = {
            "cuda": True,
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "cuda_version": torch.version.cuda,
        }
        for case in ("pending", "done"):
            result[case] = probe(case)
    (out / "ipc_event_after_exit.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    if result["cuda"]:
        pending, done = result["pending"], result["done"]
        print(f"RESULT pending={pending['outcome']!r} done={done['outcome']!r}")  # type: ignore[index]
    else:
        print("RESULT cuda=false")
    return 0


if __name__ == "__main__":
    sys.exit(main())
