"""scripts/gpu_check.sh --smoke: the one-command GPU check, rehearsed without a GPU."""

from __future__ import annotations

import json
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def gpu_check(*args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/gpu_check.sh ARGS`` from the repository root."""
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def passing_steps(out: Path, *args: str, timeout: int) -> list[dict]:
    """Run the check with ``ARGS --out OUT``; it must pass. The steps of its summary."""
    result = gpu_check(*args, "--out", str(out), timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    pack = tmp_path / "gpu-check.tgz"  # as the device tool brings it back
    # --install: the checkout installed into a scratch directory, as on the GPU machine
    # (there, a parity step that named the checkout's demo data was refused by a
    # coordinator that may read only the installed package's)
    steps = passing_steps(out, "--smoke", "--quick", "--install", "--pack", str(pack), timeout=900)
    assert [s["step"] for s in steps] == [
        "env",
        "cuda-tests",
        "bandwidth",
        "parity",
        "overlap",
        "optimizer",
        "moe",
        "sync-mode",
    ]
    assert all(s["exit"] == 0 for s in steps), steps
    with tarfile.open(pack) as archive:
        packed = {Path(name).name for name in archive.getnames()}
    assert {"summary.json", "env.json", "parity.json"} <= packed
    assert {f"{s['step']}.log" for s in steps} <= packed
    # the parity run's daemon logs come back with it (a hang there must show its cause)
    with tarfile.open(pack) as archive:
        parity_logs = {n for n in archive.getnames() if "parity-work" in n and n.endswith(".log")}
    assert {"coordinator.log", "w0.log"} <= {Path(n).name for n in parity_logs}, parity_logs
    env = json.loads((out / "env.json").read_text())
    assert {"torch", "dev_shm_bytes", "ulimit_l", "cores", "nvidia_smi"} <= env.keys()
    assert {"gxx", "python_h"} <= env.keys()  # what vs-paper's optimizer compile needs
    assert env["packages"]["setuptools"] and env["packages"]["pyzmq"], env["packages"]
    assert json.loads((out / "parity.json").read_text())["ok"] is True
    # The overlap, optimizer and moe steps run exactly the benchmarks' --smoke commands;
    # their logs are checked here as the benchmark smoke tests did (one run, not two).
    check_overlap_smoke((out / "overlap.log").read_text())
    check_optimizer_smoke((out / "optimizer.log").read_text())
    check_moe_smoke((out / "moe.log").read_text())


def check_overlap_smoke(stdout: str) -> None:
    """`benchmarks/overlap.py --smoke` runs the default's stage plan (8 decoder layers:
    four forward stages, the tail, four backward stages, gradient slots shared between
    layers; a 4-layer smoke run once hid a default that deadlocked) to its RESULT line,
    over two timed iterations, so an iteration's last task prefetches the next one's
    first."""
    assert "one worker, 9 tasks per iteration, 2 timed iteration(s)" in stdout, stdout
    last = stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"RESULT overlap_efficiency=\d+\.\d\d speedup=\d+\.\d\d", last), last


def check_optimizer_smoke(stdout: str) -> None:
    """`benchmarks/optimizer.py --smoke --no-paper`: every system of the table runs, each
    with the bytes per parameter its passes move (one pass 32, two passes 36), and the
    RESULT line carries its three ratios, the paper's nan (no timing asserted)."""
    lines = stdout.strip().splitlines()
    table = {
        line.split()[0]: line.split()
        for line in lines
        if line and not line.startswith(("#", "RESULT"))
    }
    rows = set(table)
    assert "runtime kernel compiled" in stdout
    assert [table[name][4] for name in ("runtime", "runtime-torch", "torch-fused", "stream")] == [
        "32",
        "36",
        "36",
        "32",
    ]
    assert {
        "runtime",
        "runtime-dft",
        "runtime-torch",
        "torch-fused",
        "loop",
        "paper",
        "stream",
        "copy",
        "in-place",
    } <= rows
    assert re.search(r"^paper +skipped \(--no-paper\)$", stdout, re.MULTILINE)
    assert re.fullmatch(
        r"RESULT optimizer_vs_bound=\d+\.\d\d vs_torch_fused=\d+\.\d\d vs_paper_adam=nan",
        lines[-1],
    )


def check_moe_smoke(stdout: str) -> None:
    """`benchmarks/moe.py --smoke`: the grouped MoE layer, the expert loop and the dense
    layer of the same active parameter count all run (as forward + backward tasks of the
    executor)."""
    lines = stdout.strip().splitlines()
    rows = {line[:28].strip() for line in lines if line and not line.startswith(("#", "RESULT"))}
    assert {
        "moe grouped_mm (worker)",
        "moe eager (expert loop)",
        "dense, same active params",
    } <= rows
    assert re.fullmatch(r"RESULT moe_vs_dense=\d+\.\d\d grouped_vs_eager=\d+\.\d\d", lines[-1])


def test_gpu_check_runs_the_steps_asked_for(tmp_path: Path) -> None:
    """--steps: a GPU session splits the checks over several 10-minute commands."""
    steps = passing_steps(tmp_path / "out", "--smoke", "--steps", "env,bandwidth", timeout=300)
    assert [s["step"] for s in steps] == ["env", "bandwidth"]


def test_gpu_check_refuses_an_unknown_option(tmp_path: Path) -> None:
    result = gpu_check("--fast", timeout=60)
    assert result.returncode == 2 and "unknown option --fast" in result.stderr


def test_gpu_check_refuses_an_unknown_step_before_running_any(tmp_path: Path) -> None:
    """A misspelt --steps name would skip that step silently and waste a GPU call."""
    result = gpu_check("--out", str(tmp_path / "out"), "--steps", "env,vs_paper", timeout=60)
    assert result.returncode == 2
    assert "unknown step 'vs_paper'" in result.stderr and "vs-paper" in result.stderr
    assert not (tmp_path / "out" / "summary.json").exists()


def test_a_failed_install_is_packed_with_its_output(tmp_path: Path) -> None:
    """On the GPU machine only what is under $OUT comes back: an install that fails must
    leave its log there, packed, not only a line on stderr."""
    checkout = tmp_path / "checkout"  # a checkout whose pyproject.toml does not parse
    (checkout / "scripts").mkdir(parents=True)
    (checkout / "scripts" / "gpu_check.sh").write_text(
        (ROOT / "scripts" / "gpu_check.sh").read_text()
    )
    (checkout / "pyproject.toml").write_text("[project\nname = broken\n")
    out, pack = tmp_path / "out", tmp_path / "gpu-check.tgz"
    result = subprocess.run(
        [
            "bash",
            str(checkout / "scripts" / "gpu_check.sh"),
            "--out",
            str(out),
            "--install",
            "--pack",
            str(pack),
            "--steps",
            "env",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=checkout,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "installing this checkout failed" in result.stderr
    assert (out / "install.log").read_text().strip()
    steps = json.loads((out / "summary.json").read_text())
    assert [(s["step"], s["exit"]) for s in steps] == [("install", 2)]
    with tarfile.open(pack) as archive:
        assert {"install.log", "summary.json"} <= {Path(n).name for n in archive.getnames()}


@pytest.mark.slow
def test_the_float16_parity_run_of_gpu_check_runs(tmp_path: Path) -> None:
    """gpu_check.sh's parity-fp16 step on the GPU machine, rehearsed with the CPU worker
    behind the emulated bus: both float16 runs (loss scaling on) agree."""
    import sys

    result = subprocess.run(
        [sys.executable, "scripts/gpu_parity.py", "--smoke", "--dtype", "float16"]
        + ["--steps", "2", "--rtol", "1e-2", "--json", str(tmp_path / "p.json")]
        + ["--workdir", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert json.loads((tmp_path / "p.json").read_text())["ok"] is True
