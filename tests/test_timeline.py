"""The timeline recorder, its trace files and pictures, without daemons (the end-to-end
checks are in test_observability.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from roundpipe.cli import main as cli_main
from roundpipe.coordinator.planning.simulator import SimStage, simulate_roundpipe
from roundpipe.coordinator.training.timeline import (
    NETWORK_TID,
    TaskRecord,
    TimelineRecorder,
    bubble_in_window,
    read_trace,
    stage_label,
    trace_files,
)
from roundpipe.protocol import ProgressEvent, TaskDone
from roundpipe.shared.plan import Plan
from roundpipe.timeline_plot import (
    NETWORK_LANE,
    boxes_from_simulation,
    boxes_from_trace,
    parse_steps,
)

PLAN = Plan.parse("F[0:2,2:4] T[4:6] B[2:4,0:2]")
STAGES = [
    ("forward", 0, 2),
    ("forward", 2, 4),
    ("tail", 4, 6),
    ("backward", 2, 4),
    ("backward", 0, 2),
]


def record(worker: int, start: float, end: float, compute: float) -> TaskRecord:
    return TaskRecord(worker, 1, 0, 0, "forward", "F0", start, end, compute, 0, 0, 0, 0, 0)


def test_bubble_in_window() -> None:
    tasks = [
        record(1, 0.0, 1.0, 1.0),  # busy the whole window
        record(2, 0.0, 0.5, 0.25),  # half the window, computing half of that
        record(2, 0.75, 1.5, 0.75),  # cut by the window's end: a third inside
    ]
    bubble, busy = bubble_in_window(tasks, (0.0, 1.0), 2)
    assert busy == {1: 1.0, 2: pytest.approx(0.25 + 0.25)}
    assert bubble == pytest.approx(1 - (1.0 + 0.5) / 2)
    assert bubble_in_window([], (0.0, 1.0), 2) == (1.0, {})


def test_stage_labels() -> None:
    assert [stage_label(PLAN, *s) for s in STAGES] == ["F0", "F1", "T", "B0", "B1"]
    assert stage_label(PLAN, "forward", 0, 3) == "F[0:3]"  # a range of another plan


def feed(recorder: TimelineRecorder, steps: range, *, t0: float, workers: int = 2) -> float:
    """Drive a recorder as a trainer would: every stage of every step, round-robin,
    each 0.1 s long (0.08 s computing), then the optimizer and the progress event."""
    t, task_id = t0, 0
    for k in steps:
        for kind, a, b in STAGES:
            done = TaskDone(
                job_id="j",
                task_id=task_id,
                attempt=0,
                worker_id=task_id % workers,
                seconds=0.1,
                layer_times={},
                compute_s=0.08,
                started_at=t,
            )
            task = SimpleNamespace(
                iteration=k, kind=kind, layer_start=a, layer_stop=b, task_id=task_id
            )
            recorder.task_done(done, task)
            t += 0.1 / workers
            task_id += 1
        recorder.iteration_done(k)
        for layer in (2, 1, 0):
            recorder.optimizer_layer(k, layer, t, t + 0.01)
        recorder.step_reported(
            ProgressEvent(seq=k, step=k, loss=1.0 / k, tokens_per_s=100.0, lr=1e-4, time=t)
        )
    return t


def test_recorder_is_bounded_and_rotates_its_trace(tmp_path: Path) -> None:
    recorder = TimelineRecorder("j", tmp_path, keep_steps=8, segment_steps=10, keep_segments=3)
    recorder.start(1, PLAN, num_optimizer_layers=3)
    feed(recorder, range(1, 101), t0=1000.0)
    assert len(recorder.recent_tasks()) <= 9 * len(STAGES)  # memory does not grow per step
    assert len(recorder._steps) <= 10
    assert recorder.optimizer_step == 100
    assert recorder.latest_bubble_step == 99  # step 100 settles when the job ends
    # Tasks back to back on two workers, computing 80% of the time.
    assert recorder.latest_bubble == pytest.approx(0.2, abs=1e-6)
    assert recorder.latest_busy == {0: pytest.approx(0.8), 1: pytest.approx(0.8)}
    recorder.close()
    assert recorder.latest_bubble_step == 100
    assert recorder.latest_bubble > 0.2  # the drain: no next step fills its window
    files = trace_files(tmp_path)
    assert len(files) == 3  # segments of 10 steps, the newest 3 kept
    for f in files:
        doc = json.loads(f.read_text())  # every finished segment is complete JSON
        lanes = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
        assert lanes == {"optimizer", "worker 0", "worker 1"}  # each names its lanes
    trace = read_trace(tmp_path)
    # Steps 71..100, and step 70's bubble (settled once step 71 had finished).
    assert sorted(trace.steps) == list(range(70, 101))
    assert trace.steps[100]["loss"] == pytest.approx(0.01)
    assert trace.steps[100]["bubble_fraction"] == recorder.latest_bubble
    workers = {e["args"]["worker"] for e in trace.tasks if e["tid"] != 0}
    assert workers == {0, 1}
    assert {e["name"] for e in trace.tasks} >= {"F0", "F1", "T", "B0", "B1", "L0", "L2"}


def test_read_trace_of_a_running_or_resumed_job(tmp_path: Path) -> None:
    first = TimelineRecorder("j", tmp_path)
    first.start(1, PLAN, num_optimizer_layers=3)
    feed(first, range(1, 6), t0=1000.0)
    first._writer._file.flush()  # still open: no closing "]}" yet, like a running job
    with pytest.raises(json.JSONDecodeError):
        json.loads(trace_files(tmp_path)[0].read_text())
    assert sorted(read_trace(tmp_path).steps) == [1, 2, 3, 4, 5]
    # The coordinator died; the job resumes from a checkpoint at step 3 and redoes 4, 5.
    second = TimelineRecorder("j", tmp_path)
    second._t0 = second._writer.t0 = first._t0 + 1.0  # a later run
    second.start(4, PLAN, num_optimizer_layers=3)
    feed(second, range(4, 7), t0=2000.0)
    second.close()
    trace = read_trace(tmp_path, steps=range(4, 6))
    assert sorted(trace.steps) == [4, 5]
    starts = [e["ts"] / 1e6 + trace.origin for e in trace.tasks]
    # The newest run's events only (its first starts at 2000.0; microseconds relative to
    # a wall-clock origin round by well under a millisecond).
    assert min(starts) >= 2000.0 - 1e-3
    with pytest.raises(FileNotFoundError, match="no timeline trace"):
        read_trace(tmp_path / "nothing")


def test_a_group_nodes_collectives_have_a_lane_of_their_own(tmp_path: Path) -> None:
    """A node of a data-parallel group records each collective: from ready, through the
    wait for the other nodes, to its end. Per-step ones are filed under their step; each
    segment names the lane; the picture draws it with the wait hatched."""
    recorder = TimelineRecorder("j", tmp_path / "timeline", segment_steps=3)
    recorder.start(1, PLAN, num_optimizer_layers=3)
    t = 1000.0
    for k in range(1, 7):
        t = feed(recorder, range(k, k + 1), t0=t)
        for layer in (2, 1, 0):  # ready at t, all arrived 0.02 s later, 0.01 s moving bytes
            recorder.collective(f"grad/{layer}", k, t, t + 0.02, t + 0.03, 4096)
            t += 0.03
    recorder.collective("checkpoint/6/states", None, t, t, t + 0.5, 1 << 20)  # no step
    recorder.close()
    files = trace_files(tmp_path / "timeline")
    # Steps 1-3, 4-6, and the collectives recorded after step 6 was reported.
    assert len(files) == 3
    for f in files:
        doc = json.loads(f.read_text())
        lanes = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
        assert "network (collectives)" in lanes
    trace = read_trace(tmp_path / "timeline", steps=[5])
    network = [e for e in trace.tasks if e["tid"] == NETWORK_TID]
    assert [e["name"] for e in network] == ["grad/2", "grad/1", "grad/0"]
    assert all(e["args"]["step"] == 5 and e["args"]["bytes"] == 4096 for e in network)
    assert network[0]["args"]["wait_s"] == pytest.approx(0.02)
    assert network[0]["dur"] == pytest.approx(30_000, abs=1)  # microseconds
    boxes = [b for b in boxes_from_trace(trace.tasks, multi_step=False) if b.lane == NETWORK_LANE]
    assert len(boxes) == 3
    assert all(b.kind == "collective" and b.busy_s == pytest.approx(0.01, abs=1e-6) for b in boxes)
    png = tmp_path / "t.png"
    assert cli_main(["timeline", str(tmp_path), "--steps", "4:6", "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulated_timeline_has_the_optimizer_lane() -> None:
    stages = [SimStage("F", 0, 2, 0.01), SimStage("T", 2, 4, 0.03, optimizer_s=0.02)]
    sim = simulate_roundpipe(stages, num_workers=2, num_microbatches=3, iterations=3)
    assert [e.iteration for e in sim.optimizer_events] == [1, 2, 3]
    boxes = boxes_from_simulation(sim)
    assert {b.lane for b in boxes} == {"worker 0", "worker 1", "optimizer"}
    assert sorted(b.label for b in boxes if b.kind == "tail") == ["1:T", "2:T", "3:T"]


def test_plan_timeline_picture(tmp_path: Path, capsys) -> None:
    png = tmp_path / "plan.png"
    rc = cli_main(
        [
            "plan",
            "--architecture",
            "llama",
            "--set",
            "num_hidden_layers=6",
            "--workers",
            "3",
            "--seq-len",
            "512",
            "--optimizer-rate",
            "1e9",
            "--timeline",
            str(png),
        ]
    )
    assert rc == 0
    assert f"timeline drawn to {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parse_steps() -> None:
    assert parse_steps("3:5") == (3, 5)
    assert parse_steps("7") == (7, 7)
    for bad in ("5:3", "0:2", "a:b", "1:2:3"):
        with pytest.raises(ValueError, match="--steps"):
            parse_steps(bad)


def test_timeline_command_without_a_trace(tmp_path: Path, capsys) -> None:
    rc = cli_main(["timeline", str(tmp_path), "-o", str(tmp_path / "t.png")])
    assert rc == 1
    err = capsys.readouterr().err
    assert "no timeline trace in" in err and "output.timeline is false" in err
    assert not (tmp_path / "t.png").exists()


def test_timeline_command_draws_a_trace(tmp_path: Path, capsys) -> None:
    recorder = TimelineRecorder("j", tmp_path / "timeline")
    recorder.start(1, PLAN, num_optimizer_layers=3)
    feed(recorder, range(1, 6), t0=1000.0)
    recorder.close()
    png = tmp_path / "t.png"
    assert cli_main(["timeline", str(tmp_path), "-o", str(png)]) == 0  # the last 3 steps
    assert "steps 3-5 of job in" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli_main(["timeline", str(tmp_path), "--steps", "7:9", "-o", str(png)]) == 1
    assert "holds no task of steps 7-9" in capsys.readouterr().err


def test_timeline_command_names_the_file_it_wrote(tmp_path: Path, capsys) -> None:
    """matplotlib adds .png to a name without a suffix: `-o t` wrote t.png while the
    command said t, and `-o some/dir` wrote some/dir.png beside the directory."""
    recorder = TimelineRecorder("j", tmp_path / "timeline")
    recorder.start(1, PLAN, num_optimizer_layers=3)
    feed(recorder, range(1, 3), t0=1000.0)
    recorder.close()
    assert cli_main(["timeline", str(tmp_path), "-o", str(tmp_path / "t")]) == 0
    assert f"drawn to {tmp_path / 't.png'}\n" in capsys.readouterr().out
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pictures = tmp_path / "pictures"
    pictures.mkdir()
    assert cli_main(["timeline", str(tmp_path), "-o", str(pictures)]) == 1
    assert "is a directory; name the picture's file" in capsys.readouterr().err
    assert not (tmp_path / "pictures.png").exists()


def test_closing_settles_no_step_the_run_stopped_inside() -> None:
    """A run cancelled inside step 3 (two of its tasks done): closing gave step 3 a
    bubble fraction from those two tasks, a figure of no real step, beside the resumed
    run's own for step 3. The steps that completed are settled."""
    recorder = TimelineRecorder("j")
    recorder.start(1, PLAN, num_optimizer_layers=3)
    t = feed(recorder, range(1, 3), t0=1000.0)
    for task_id, (kind, a, b) in enumerate(STAGES[:2], start=100):
        done = TaskDone(
            job_id="j", task_id=task_id, attempt=0, worker_id=0, seconds=0.1,
            layer_times={}, compute_s=0.08, started_at=t + task_id,
        )  # fmt: skip
        task = SimpleNamespace(iteration=3, kind=kind, layer_start=a, layer_stop=b, task_id=task_id)
        recorder.task_done(done, task)
    recorder.close()
    assert recorder._steps[2].bubble is not None
    assert recorder._steps[3].bubble is None
