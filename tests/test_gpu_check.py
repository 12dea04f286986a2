"""scripts/gpu_check.sh --smoke: the one-command GPU check, rehearsed without a GPU."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--smoke", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    steps = json.loads((out / "summary.json").read_text())
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
    env = json.loads((out / "env.json").read_text())
    assert {"torch", "dev_shm_bytes", "ulimit_l", "cores", "nvidia_smi"} <= env.keys()
    assert json.loads((out / "parity.json").read_text())["ok"] is True
    assert "RESULT overlap_efficiency=" in (out / "overlap.log").read_text()
    assert "RESULT optimizer_vs_bound=" in (out / "optimizer.log").read_text()


def test_gpu_check_runs_the_steps_asked_for(tmp_path: Path) -> None:
    """--steps: a GPU session splits the checks over several 10-minute commands."""
    out = tmp_path / "out"
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--smoke", "--steps", "env,bandwidth"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    steps = json.loads((out / "summary.json").read_text())
    assert [s["step"] for s in steps] == ["env", "bandwidth"]


def test_gpu_check_refuses_an_unknown_option(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--fast"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2 and "unknown option --fast" in result.stderr
