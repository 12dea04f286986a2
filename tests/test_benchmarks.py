"""The end-to-end benchmark scripts run and report what they claim (no timing asserted).

The overlap, optimizer and moe benchmarks' --smoke runs are steps of
``scripts/gpu_check.sh --smoke``: tests/test_gpu_check.py checks their output there
(one run, not two)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_throughput  # noqa: E402 -- benchmarks/ is not a package
import sync_mode  # noqa: E402


def _run_benchmark(script: str, *args: str, timeout_s: float = 300) -> str:
    """Run ``benchmarks/<script> args`` to completion; its stdout. A run that succeeds
    leaves nothing in its temporary directory (``$TMPDIR``): run on a shared server, or
    many times by this suite, a benchmark must not fill /tmp."""
    with tempfile.TemporaryDirectory(prefix="rp-bench-tmp-") as tmp:
        result = subprocess.run(
            [sys.executable, str(BENCHMARKS / script), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "TMPDIR": tmp},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        # torchinductor_<user> is torch's compile cache, made when torch._dynamo is
        # imported and shared by every later run: not the benchmark's.
        left = sorted(
            p.name for p in Path(tmp).iterdir() if not p.name.startswith("torchinductor_")
        )
        assert not left, f"{script} left {left} in $TMPDIR"
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
    """`gpu_throughput.py --smoke`: for a tied-embedding Qwen3 and a Llama LoRA job (the
    default's kinds of model), 8 layers, bf16, the runtime with 1 and 2 CPU workers (each
    with several stages, as on a GPU) and the plain loop report tokens/s; the paper's
    library (CUDA only) is skipped with a reason. The CUDA path itself needs a GPU."""
    stdout = _run_benchmark("gpu_throughput.py", "--smoke", timeout_s=600)
    assert "bfloat16 matmul peak" in stdout, stdout
    for model in ("tiny", "tiny-lora"):
        rows = {
            line.split()[1]: line for line in stdout.splitlines() if line.split()[:1] == [model]
        }
        assert set(rows) == {"runtime-1w", "runtime-2w", "paper", "plain"}, (model, stdout)
        for system in ("runtime-1w", "runtime-2w", "plain"):
            assert float(rows[system].split()[2]) > 0, rows[system]
        assert f"plan {gpu_throughput.SMOKE_ONE_WORKER_PLAN}" in rows["runtime-1w"]
        assert re.search(r"plan F\[\d+:\d+.*\] T\[\d+:10\] B\[\d", rows["runtime-2w"])
        # the planner's plan: the job wrote its measured profile, which predicts its step
        assert re.search(r"the planner predicts [0-9.e+-]+ s per step", rows["runtime-2w"])
        assert "skipped: needs CUDA" in rows["paper"]
    last = stdout.strip().splitlines()[-1]
    # runtime-1w runs a pinned plan here (no profile: plan_error nan); on a GPU, the planner's
    assert re.fullmatch(r"RESULT vs_paper=nan mfu=\d+\.\d{3} plan_error=nan", last), last


@pytest.mark.slow
def test_qlora_benchmark_smoke() -> None:
    """`qlora.py --smoke`: the same LoRA job on a bf16, NF4 and int8 base through the
    trainer and emulated-bus workers; the issue's bounds on host bytes and uploads hold,
    and `roundpipe plan` predicts both within 5% (no timing asserted)."""
    out = _run_benchmark("qlora.py", "--smoke", timeout_s=600)
    m = re.fullmatch(
        r"RESULT host_bytes_per_frozen_param=([0-9.]+) upload_ratio=([0-9.]+) "
        r"loss_diff=([0-9.e+-]+)",
        out.splitlines()[-1],
    )
    assert m, out
    per_param, ratio, loss_diff = (float(g) for g in m.groups())
    assert per_param <= 0.6 and ratio <= 0.3 and loss_diff < 5e-3, out
    rows = {f[0]: f for f in (line.split() for line in out.splitlines()) if len(f) == 8}
    assert float(rows["int8"][1]) <= 1.1, out
    errors = re.search(r"upload ([+-][0-9.]+)%, host ([+-][0-9.]+)%", out)
    assert errors and all(abs(float(e)) <= 5 for e in errors.groups()), out


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
def test_sync_mode_benchmark_runtime_runs_the_defaults_cases() -> None:
    """The runtime part as the default runs it, a few steps and one repeat: the planner's
    plans (split by microbatch at staleness 0), the unsplit plan forced at both settings
    (``train.plan``, as ``--plan`` forces one) and the clipped runs, each in its table
    row; the RESULT line has both ratios (no timing asserted)."""
    stdout = _run_benchmark(
        "sync_mode.py", "--steps", "3", "--warmup", "1", "--repeats", "1", timeout_s=600
    )
    assert re.search(r"^# runtime, staleness 0, run 0: plan \S*\[[^]]*/", stdout, re.M), stdout
    unsplit = re.search(r"^# simulator, staleness 0: unsplit plan (\S+ \S+ \S+),", stdout, re.M)
    assert unsplit is not None, stdout
    for label in ("runtime", "runtime, unsplit", "runtime, clip 1.0"):
        for staleness in (0, 1):
            assert f"# {label}, staleness {staleness}, run 0: plan " in stdout, (label, stdout)
        assert re.search(rf"^{re.escape(label)} +\d+ +\d+ +\d+\.\d\d$", stdout, re.M), label
    for staleness in (0, 1):  # the forced plan reached the jobs
        assert f"# runtime, unsplit, staleness {staleness}, run 0: plan {unsplit[1]}," in stdout
    last = stdout.splitlines()[-1]
    assert re.fullmatch(r"RESULT sync_vs_async=\d+\.\d\d unsplit=\d+\.\d\d", last), last


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
    # two quick ones (packing's smoke, run here before, is tested on its own)
    out = _run_benchmark(
        "run_all.py", "--only", "plan_sim,paper_table", "--smoke", "--out", str(tmp_path / "s")
    )
    assert out.strip().splitlines()[-1] == "RESULT benchmarks=2 ok=2 failed=0 skipped=0", out
    rows = json.loads((tmp_path / "s" / "results.json").read_text())
    assert [(r["name"], r["status"]) for r in rows] == [("plan_sim", "ok"), ("paper_table", "ok")]
    assert rows[0]["command"] == "python benchmarks/plan_sim.py"  # its default is short
    assert rows[1]["command"] == "python benchmarks/paper_table.py --only Qwen3-1.7B,GPT-OSS-20B"
    assert set(rows[1]["result"]) == {"worst", "rows"}
    table = (tmp_path / "s" / "results.md").read_text().splitlines()
    assert table[0].startswith("| benchmark |") and len(table) == 4
    assert "worst=" in table[3]
    if not torch.cuda.is_available():
        out = _run_benchmark("run_all.py", "--only", "bandwidth", "--out", str(tmp_path / "g"))
        assert "RESULT benchmarks=1 ok=0 failed=0 skipped=1" in out, out
    unknown = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run_all.py"), "--only", "nosuch"],
        capture_output=True,
        text=True,
    )
    assert unknown.returncode == 2 and "unknown benchmark(s) nosuch" in unknown.stderr


@pytest.mark.slow
def test_checkpoint_benchmark_smoke() -> None:
    """`checkpoint.py --smoke`: the three ways run, checkpoints have bytes, a write
    bandwidth and the coordinator's CPU seconds per checkpoint, and the RESULT line
    carries both figures (no timing asserted)."""
    out = _run_benchmark("checkpoint.py", "--smoke", timeout_s=600)
    rows = {f[0]: f for f in (line.split() for line in out.splitlines()) if len(f) >= 5}
    assert {"none", "background", "drained"} <= rows.keys(), out
    assert re.search(r"^# model: .*, plan F\[.*\] T\[.*\] B\[.*\], 2 CPU workers$", out, re.M)
    for mode in ("background", "drained"):
        assert float(rows[mode][5]) > 0 and float(rows[mode][7]) > 0, rows[mode]
        assert len(rows[mode]) == 10 and re.fullmatch(r"-?\d+\.\d\d", rows[mode][9]), rows[mode]
    assert "# disk: sequential write" in out
    assert re.search(r"^# \d+ cores for the coordinator and the 2 workers$", out, re.M), out
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"RESULT checkpoint_stall_steps=-?\d+\.\d{3} write_vs_disk=\d+\.\d\d", last)


@pytest.mark.slow
def test_host_memory_benchmark_smoke() -> None:
    """`host_memory.py --smoke`: a narrow job through the daemons, under a plan of the
    default's shape (4 forward stages, the tail, 8 backward stages); the table has every
    predicted component and the measured figures, the RESULT line both numbers."""
    out = _run_benchmark("host_memory.py", "--smoke")
    plan = "plan F[0:2,2:4,4:6,6:8] T[8:10] B[7:8,6:7,5:6,4:5,3:4,2:3,1:2,0:1]"
    assert re.search(rf"^# [\d,]+ parameters, bfloat16, staleness 1, {re.escape(plan)}$", out, re.M)
    rows = ("weights", "grads", "activations", "masters", "moments", "staging")
    for row in (*rows, "checkpoint_staging", "total"):
        assert re.search(rf"^predicted {row} +[\d,]+ +\d+\.\d\d$", out, re.M), (row, out)
    assert re.search(r"^measured arenas \(/dev/shm\) +[\d,]+", out, re.M), out
    assert re.fullmatch(
        r"RESULT host_bytes_per_param=\d+\.\d\d predicted=\d+\.\d\d", out.splitlines()[-1]
    )


@pytest.mark.slow
def test_multinode_benchmark_smoke() -> None:
    """`multinode.py --smoke`: one coordinator, then two in a gloo group, replicated,
    sharded and with bf16 gradients: step times, bytes reduced and gathered, host bytes
    per node, and the sharded model bitwise the replicated one."""
    out = _run_benchmark("multinode.py", "--smoke", timeout_s=900)
    lines = out.splitlines()
    rows = {(r[0], r[1]): r for r in (line.split() for line in lines[1:5])}
    assert set(rows) == {("1", "replicated"), ("2", "replicated"), ("2", "sharded"), ("2", "bf16")}
    assert int(rows[("2", "replicated")][5]) > 0 and int(rows[("2", "replicated")][6]) == 0
    assert int(rows[("2", "sharded")][6]) > 0  # weights all-gathered
    assert int(rows[("2", "bf16")][5]) * 2 == int(rows[("2", "replicated")][5])
    assert float(rows[("2", "sharded")][7]) < float(rows[("2", "replicated")][7])
    # The model's inputs, measured: the loopback bandwidth, the one-node step shared.
    assert re.search(
        r"gloo all-reduce, per direction\): \d+\.\d{3} GB/s; one-node step with W nodes "
        r"sharing this machine: W=1 \d+\.\d{4}s, W=2 \d+\.\d{4}s",
        out,
    ), out
    last = lines[-1]
    assert re.fullmatch(
        r"RESULT sharded_host_ratio=0\.\d{3} bitwise_equal=1 plan_error=\d+\.\d{3}", last
    ), last


def test_ipc_benchmark_runs_its_three_parts() -> None:
    """Its arenas go into a private directory below the arena root (a shared /dev/shm
    is refused for arena files), and the arena leaves nothing behind."""
    out = _run_benchmark(
        "ipc.py", "--roundtrips", "50", "--wakes", "5", "--copy-mib", "4", "--copy-reps", "1"
    )
    last = out.strip().splitlines()[-1]
    assert last.startswith("RESULT roundtrip_us=") and "arena_copy_ratio=" in last, out


@pytest.mark.slow
def test_soak_benchmark_smoke() -> None:
    """`soak.py --smoke`: both phases of the default, shorter. The long job writes
    checkpoints that replace each other (one is left), the jobs phase runs past its 5
    warm-up jobs, so every process has a slope in both phases, and nothing is left in
    /dev/shm after stop. Growth is printed, not asserted: a few jobs cannot tell a
    leak from the allocator's ups and downs."""
    out = _run_benchmark("soak.py", "--smoke", timeout_s=600)
    assert re.search(r"^soak: 150 steps \(a checkpoint every 50\) in .*; 1 checkpoint", out, re.M)
    number = r"-?\d+\.\d"
    for process in ("coordinator", "worker-w1", "worker-w2"):
        for metric in ("rss MiB", "fds", "threads"):
            row = rf"^{process} +{re.escape(metric)} +{' +'.join([number] * 6)}$"
            assert re.search(row, out, re.M), (process, metric, out)
    assert re.search(r"; \d+ files at the end; after stop: 0 left$", out, re.M), out
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"RESULT rss_growth_mib_per_job=-?\d+\.\d{3} rss_growth_mib_per_1k_steps=-?\d+\.\d{3}",
        last,
    ), last


@pytest.mark.slow
def test_cpu_overhead_benchmark_smoke() -> None:
    """`cpu_overhead.py --smoke`: the default's 8 layers, microbatches, threads and plans,
    narrower (hidden and sequence 128) and 3 steps instead of 8: the plain loop and the
    runtime with one and two CPU workers report tokens/s and the RESULT line both
    ratios."""
    out = _run_benchmark("cpu_overhead.py", "--smoke", timeout_s=600)
    assert "hidden 128 x 8 layers, seq 128, 3 microbatches" in out, out
    for system in ("plain loop + checkpointing", "runtime, 1 CPU worker", "runtime, 2 CPU workers"):
        row = re.search(rf"^{re.escape(system)} +(\d+\.\d) +\d+\.\d\d$", out, re.M)
        assert row is not None and float(row[1]) > 0, (system, out)
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"RESULT ratio_1w=\d+\.\d\d ratio_2w=\d+\.\d\d", last), last


@pytest.mark.slow
def test_long_context_gpu_benchmark_smoke() -> None:
    """`long_context_gpu.py --smoke`: the GPU benchmark's path on a CPU worker (the job
    per length through the daemons, the plan the coordinator chose priced by the planner,
    the table and the RESULT line); rows of 4,096 and 8,192 tokens take the long-row
    attention and chunked MLP. The 1.7B at 73K tokens needs a GPU (gpu_check.sh's
    long-context step)."""
    out = _run_benchmark("long_context_gpu.py", "--smoke", timeout_s=300)
    rows = {f[0]: f for f in (line.split() for line in out.splitlines()) if len(f) >= 6}
    for n in ("4096", "8192"):
        assert rows[n][1] == "yes" and float(rows[n][4]) > 0, out  # trained; planner GiB
    assert re.fullmatch(r"RESULT max_seq_tokens=8192 planner_max=\d+", out.splitlines()[-1])


@pytest.mark.slow
def test_long_context_benchmark_smoke() -> None:
    """`long_context.py --smoke`: capped CPU workers through the daemons train up to a
    length and fail loudly past it, the error naming the cap; the planner's longest
    sequence for the cap is near the bisection's (coarse here), and every run that
    trained stayed under the planner's per-worker figure + 10% (no timing asserted)."""
    out = _run_benchmark("long_context.py", "--smoke", timeout_s=900)
    m = re.fullmatch(
        r"RESULT max_seq_tokens=([0-9]+) predicted_over_measured=([0-9.]+)",
        out.splitlines()[-1],
    )
    assert m, out
    longest, ratio = int(m.group(1)), float(m.group(2))
    assert longest >= 4096, out
    # The smoke's bisection stops within 4,096 tokens of a ~12K boundary.
    assert 0.6 <= ratio <= 1.6, out
    failure = next(line for line in out.splitlines() if line.startswith("an over-cap run"))
    assert "the worker's memory cap of 500.0 MiB was exceeded" in failure, out
    table = [f for f in (line.split() for line in out.splitlines()) if len(f) == 10]
    trained = [f for f in table if f[1] == "yes"]
    assert trained and any(f[1] == "CAP" for f in table), out
    for f in trained:
        assert float(f[9]) <= 1.1, f  # peak RssAnon / the planner's figure


def test_run_all_stops_what_a_benchmark_left_running_past_its_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A benchmark past its limit was killed alone: the daemons it had started (a
    coordinator and workers training a 10,000-step job) ran on for an hour, taking the
    cores from every benchmark and test after it. Its whole process group goes now."""
    import importlib.util

    loaded = importlib.util.spec_from_file_location("run_all", BENCHMARKS / "run_all.py")
    run_all = importlib.util.module_from_spec(loaded)
    monkeypatch.setitem(sys.modules, "run_all", run_all)  # its dataclasses look it up
    loaded.loader.exec_module(run_all)
    pid_file = tmp_path / "daemon.pid"
    (tmp_path / "stuck.py").write_text(
        "import subprocess, sys, time\n"
        "daemon = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(daemon.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(600)\n"
    )
    monkeypatch.setattr(run_all, "HERE", tmp_path)
    bench = run_all.Benchmark("stuck", smoke=None, limit_s=5)
    outcome = run_all.run_one(bench, smoke=False, scale=1.0, has_gpu=False)
    assert outcome.status == "timeout (5 s)" and "started" in outcome.tail
    daemon = Path(f"/proc/{pid_file.read_text()}/stat")
    # gone, or a zombie waiting for init to reap it
    assert not daemon.exists() or daemon.read_text().split(") ")[1].startswith("Z")
