"""The end-to-end benchmark scripts run and report what they claim (no timing asserted)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_throughput  # noqa: E402 -- benchmarks/ is not a package
import sync_mode  # noqa: E402


def _run_benchmark(script: str, *args: str, timeout_s: float = 300) -> str:
    """Run ``benchmarks/<script> args`` to completion; its stdout."""
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _spec(tmp_path: Path, model: str, seq_len: int = 4096):
    args = argparse.Namespace(
        warmup=0, steps=1, microbatches=1, rows=1, seq_len=seq_len, dtype="bfloat16"
    )
    # A short sequence keeps the random-token data file small; FLOPs scale it back.
    return gpu_throughput.make_spec(gpu_throughput.MODELS[model], args, tmp_path)


def test_model_flops_match_the_published_parameter_counts(tmp_path: Path) -> None:
    """Qwen3-1.7B has 1.7B parameters (1.4B without the embedding, whose matrix is the
    tied LM head); Llama-3.1-8B 8.0B of which 0.53B embedding; LoRA r=32 on every linear
    layer adds 84M."""
    seq = 64
    qwen = _spec(tmp_path / "q", "qwen3-1.7b", seq)
    attention = 6 * 28 * 16 * 128 * seq
    matmul_params = (gpu_throughput.flops_per_token(qwen) - attention) / 6
    assert 1.65e9 < matmul_params < 1.78e9
    llama = _spec(tmp_path / "l", "llama-8b-lora", seq)
    attention = 6 * 32 * 32 * 128 * seq
    rest = gpu_throughput.flops_per_token(llama) - attention
    # r x (in + out) for q, k, v, o, gate, up, down, in each of 32 layers
    adapters = 32 * 32 * (8192 + 5120 + 5120 + 8192 + 3 * (4096 + 14336))
    assert adapters == 83_886_080
    frozen = (rest - 6 * adapters) / 4
    assert 7.4e9 < frozen < 7.6e9  # 8.03B minus the 0.53B input embedding


@pytest.mark.slow
def test_gpu_throughput_smoke_runs_every_system_it_can(tmp_path: Path) -> None:
    """`gpu_throughput.py --smoke`: the runtime with 1 and 2 CPU workers and the plain loop
    report tokens/s; the paper's library (CUDA only) is skipped with a reason."""
    stdout = _run_benchmark("gpu_throughput.py", "--smoke", timeout_s=600)
    rows = {line.split()[1]: line for line in stdout.splitlines() if line.startswith("tiny ")}
    assert set(rows) == {"runtime-1w", "runtime-2w", "paper", "plain"}, stdout
    for system in ("runtime-1w", "runtime-2w", "plain"):
        assert float(rows[system].split()[2]) > 0, rows[system]
    assert "plan F[" in rows["runtime-2w"]
    assert "skipped: needs CUDA" in rows["paper"]
    last = stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"RESULT vs_paper=nan mfu=\d+\.\d{3}", last), last


@pytest.mark.slow
def test_packing_benchmark_smoke() -> None:
    """`packing.py --smoke`: three modes on the same conversations; documents packing
    gives the unpacked loss in fewer rows."""
    out = _run_benchmark("packing.py", "--smoke", timeout_s=600)
    table = [line.split() for line in out.splitlines()]
    rows = {f[0]: f for f in table if len(f) == 7 and f[1].isdigit()}
    assert set(rows) == {"none", "documents", "concat"}, out
    assert int(rows["documents"][1]) < int(rows["none"][1])
    assert "documents loss equals none: True" in out
    assert re.search(r"^RESULT documents_over_none_step_time=[0-9.]+$", out.splitlines()[-1])


@pytest.mark.slow
def test_sync_mode_benchmark_simulator_part() -> None:
    """`sync_mode.py --no-runtime`: the simulator's staleness 0 / 1 ratio for the demo job,
    with the planner's plans (split at staleness 0) and unsplit, the best unsplit plans
    over every partition and a forced plan (the runtime part, real daemons for minutes,
    is for the docs' figures)."""
    edge = "F[0:1,1:4] T[4:6] B[3:4,2:3,1:2,0:1]"
    stdout = _run_benchmark("sync_mode.py", "--no-runtime", "--plan", edge)
    labels = (
        "simulator",
        "simulator, unsplit",
        "simulator, every unsplit plan",
        f"simulator, {edge}",
    )
    for label in labels:
        assert re.search(rf"^{re.escape(label)} +\d+ +\d+ +\d\.\d\d$", stdout, re.M), stdout
    assert re.search(r"^# simulator, staleness 0: planner's plan \S*\[[^]]*/", stdout, re.M)
    last = re.fullmatch(
        r"RESULT sync_vs_async=(\d\.\d\d) unsplit=(\d\.\d\d)", stdout.splitlines()[-1]
    )
    assert last is not None and float(last[1]) > float(last[2]), stdout


@pytest.mark.slow
def test_sync_mode_benchmark_runtime_runs_a_forced_plan() -> None:
    """The runtime part with ``--plan``: the forced plan reaches the jobs (``train.plan``),
    both settings run, and the table has its row (a few steps; no timing asserted). The
    planner's staleness-0 plan splits stages by microbatch: real daemons run it."""
    edge = "F[0:1,1:4] T[4:6] B[3:4,2:3,1:2,0:1]"
    stdout = _run_benchmark(
        "sync_mode.py",
        *("--steps", "3", "--warmup", "1", "--repeats", "1", "--no-clip-runs"),
        *("--no-unsplit-runs", "--plan", edge),
        timeout_s=600,
    )
    assert re.search(r"^# runtime, staleness 0, run 0: plan \S*\[[^]]*/", stdout, re.M), stdout
    for staleness in (0, 1):
        assert f"# runtime, {edge}, staleness {staleness}, run 0: plan {edge}," in stdout, stdout
    assert re.search(rf"^runtime, {re.escape(edge)} +\d+ +\d+ +\d+\.\d\d$", stdout, re.M)
    assert re.fullmatch(r"RESULT sync_vs_async=\d+\.\d\d", stdout.splitlines()[-1])


def test_sync_mode_benchmark_rejects_a_plan_that_does_not_fit_the_demo() -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "sync_mode.py"),
            "--no-runtime",
            "--plan",
            "F[0:1] T[1:9] B[0:1]",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "--plan: " in result.stderr and "F[0:1] T[1:9] B[0:1]" in result.stderr


def test_every_plan_enumerates_each_partition_once() -> None:
    """The simulator rows' exhaustive search: 4^(t-1) plans per tail start t, all valid."""
    plans = list(sync_mode.every_plan(6))
    assert len(plans) == sum(4 ** (t - 1) for t in range(1, 6))
    assert len(set(plans)) == len(plans)
    for plan in plans:
        plan.validate(6)
    assert sync_mode.Plan.parse("F[0:4] T[4:6] B[3:4,2:3,0:2]") in plans


def test_run_all_tables_each_benchmarks_result(tmp_path: Path) -> None:
    """`run_all.py` runs the named benchmarks one by one and writes their RESULT figures as
    JSON and as a markdown table; a GPU-only default is a skipped row without a GPU."""
    out = _run_benchmark(
        "run_all.py", "--only", "plan_sim,overlap", "--smoke", "--out", str(tmp_path / "s")
    )
    assert out.strip().splitlines()[-1] == "RESULT benchmarks=2 ok=2 failed=0 skipped=0", out
    rows = json.loads((tmp_path / "s" / "results.json").read_text())
    assert [(r["name"], r["status"]) for r in rows] == [("plan_sim", "ok"), ("overlap", "ok")]
    assert rows[0]["command"] == "python benchmarks/plan_sim.py"  # its default is short
    assert rows[1]["command"] == "python benchmarks/overlap.py --smoke"
    assert set(rows[1]["result"]) == {"overlap_efficiency", "speedup"}
    table = (tmp_path / "s" / "results.md").read_text().splitlines()
    assert table[0].startswith("| benchmark |") and len(table) == 4
    assert "overlap_efficiency=" in table[3]
    if not torch.cuda.is_available():
        out = _run_benchmark("run_all.py", "--only", "bandwidth", "--out", str(tmp_path / "g"))
        assert "RESULT benchmarks=1 ok=0 failed=0 skipped=1" in out, out
    unknown = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run_all.py"), "--only", "nosuch"],
        capture_output=True,
        text=True,
    )
    assert unknown.returncode == 2 and "unknown benchmark(s) nosuch" in unknown.stderr


def test_overlap_benchmark_smoke_has_the_defaults_depth() -> None:
    """`overlap.py --smoke` runs the default's stage plan (8 decoder layers: four forward
    stages, the tail, four backward stages, gradient slots shared between layers; a
    4-layer smoke run once hid a default that deadlocked) to its RESULT line."""
    out = _run_benchmark("overlap.py", "--smoke", timeout_s=600)
    assert "one worker, 9 tasks per iteration" in out, out
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"RESULT overlap_efficiency=\d+\.\d\d speedup=\d+\.\d\d", last), last


@pytest.mark.slow
def test_checkpoint_benchmark_smoke() -> None:
    """`checkpoint.py --smoke`: the three ways run, checkpoints have bytes and a write
    bandwidth, and the RESULT line carries both figures (no timing asserted)."""
    out = _run_benchmark("checkpoint.py", "--smoke", timeout_s=600)
    rows = {f[0]: f for f in (line.split() for line in out.splitlines()) if len(f) >= 5}
    assert {"none", "background", "drained"} <= rows.keys(), out
    for mode in ("background", "drained"):
        assert float(rows[mode][5]) > 0 and float(rows[mode][7]) > 0, rows[mode]
    assert "# disk: sequential write" in out
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"RESULT checkpoint_stall_steps=-?\d+\.\d{3} write_vs_disk=\d+\.\d\d", last)


@pytest.mark.slow
def test_host_memory_benchmark_smoke() -> None:
    """`host_memory.py --smoke`: a tiny job through the daemons; the table has every
    predicted component and the measured figures, the RESULT line both numbers."""
    out = _run_benchmark("host_memory.py", "--smoke")
    rows = ("weights", "grads", "activations", "masters", "moments", "staging")
    for row in (*rows, "checkpoint_staging", "total"):
        assert re.search(rf"^predicted {row} +[\d,]+ +\d+\.\d\d$", out, re.M), (row, out)
    assert re.search(r"^measured arenas \(/dev/shm\) +[\d,]+", out, re.M), out
    assert re.fullmatch(
        r"RESULT host_bytes_per_param=\d+\.\d\d predicted=\d+\.\d\d", out.splitlines()[-1]
    )


@pytest.mark.slow
def test_multinode_benchmark_smoke() -> None:
    """`multinode.py --smoke`: one coordinator, then two in a gloo group; both step
    times and the all-reduce bytes are reported."""
    out = _run_benchmark("multinode.py", "--smoke", timeout_s=600)
    rows = {line.split()[0] + line.split()[1]: line.split() for line in out.splitlines()[1:3]}
    assert set(rows) == {"1node", "2nodes"}, out
    assert float(rows["2nodes"][3]) > 0 and int(rows["2nodes"][5]) > 0, out
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"RESULT step_ratio=\d+\.\d{3} allreduce_gbps=\d+\.\d{3}", last), last


def test_ipc_benchmark_runs_its_three_parts() -> None:
    """Its arenas go into a private directory below the arena root (a shared /dev/shm
    is refused for arena files), and the arena leaves nothing behind."""
    out = _run_benchmark(
        "ipc.py", "--roundtrips", "50", "--wakes", "5", "--copy-mib", "4", "--copy-reps", "1"
    )
    last = out.strip().splitlines()[-1]
    assert last.startswith("RESULT roundtrip_us=") and "arena_copy_ratio=" in last, out
