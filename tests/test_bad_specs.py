"""Bad job specs are refused at submit with rc 2 and a message, never a traceback, a
silent choice, gigabytes of memory, or a job that fails once started (issue 15, part 4).

Spec files are refused by `roundpipe submit` itself (nothing is sent); problems that need
the whole data file are found by the coordinator before it accepts the job."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml
from runtime_helpers import DEMO_DATA, TINY_QWEN3, coordinator_only, tiny_spec

from roundpipe.cluster import LocalCluster
from roundpipe.coordinator.spec.jobspec import MAX_SPEC_BYTES

CLI = [sys.executable, "-m", "roundpipe.cli"]


def _submit(spec_path: Path, address: str, *, limit_as: int | None = None, env: dict | None = None):
    def limit() -> None:
        if limit_as is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))

    return subprocess.run(
        [*CLI, "submit", str(spec_path), "--address", address],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
    )


def _good_yaml(tmp_path: Path) -> str:
    return tiny_spec(tmp_path / "out").to_yaml()


def test_spec_file_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    text = _good_yaml(tmp_path).replace("output:", "# caf\u00e9\noutput:")
    path.write_bytes(text.encode("latin-1"))
    result = _submit(path, "ipc:///nonexistent/c.sock")
    assert result.returncode == 2, result.stderr
    assert "not UTF-8 text: byte 0xe9 at line" in result.stderr
    assert "Traceback" not in result.stderr


def test_duplicate_key_is_refused_not_last_wins(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(_good_yaml(tmp_path).replace("  lr: 0.0003\n", "  lr: 0.0003\n  lr: 0.1\n"))
    assert path.read_text().count("  lr: ") == 2
    result = _submit(path, "ipc:///nonexistent/c.sock")
    assert result.returncode == 2, result.stderr
    assert "duplicate key 'lr'" in result.stderr and "first at line" in result.stderr


def test_alias_bomb_is_refused_in_small_memory(tmp_path: Path) -> None:
    """Eight levels of ten aliases: 10**8 module names once written out (3 GiB and more
    in the CLI before). Refused at once, inside a 1 GiB address space."""
    lines = ["a0: &a0 [q_proj, q_proj, q_proj, q_proj, q_proj, q_proj, q_proj, q_proj, q_proj]"]
    for i in range(1, 8):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
    spec = yaml.safe_load(_good_yaml(tmp_path))
    spec["lora"] = {"r": 4, "target_modules": "PLACEHOLDER"}
    body = yaml.safe_dump(spec).replace("PLACEHOLDER", "*a7")
    path = tmp_path / "job.yaml"
    path.write_text("\n".join(lines) + "\n" + body)
    result = _submit(path, "ipc:///nonexistent/c.sock", limit_as=1 << 30)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "expands to more than" in result.stderr and "aliases" in result.stderr


def test_spec_file_over_the_size_limit(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(_good_yaml(tmp_path) + "#" * MAX_SPEC_BYTES)
    result = _submit(path, "ipc:///nonexistent/c.sock")
    assert result.returncode == 2 and "larger than" in result.stderr, result.stderr


# --------------------------------------------------------------------------- data


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    with coordinator_only(tmp_path_factory.mktemp("badspecs"), "badspecs") as c:
        yield c


def _data_case(tmp_path: Path, name: str) -> tuple[Path, str]:
    """A data file whose first record is fine (so the client's own checks pass) and
    whose problem only reading all of it, or tokenizing it, shows."""
    corpus = (DEMO_DATA / "demo_corpus.jsonl").read_bytes().splitlines(keepends=True)
    data = tmp_path / f"{name}.jsonl"
    if name == "not-utf8":
        data.write_bytes(b"".join(corpus[:2]) + b'{"text": "caf\xe9"}\n')
        expect = ":3: not valid UTF-8"
    elif name == "empty":
        data.write_bytes(b'{"text": ""}\n' * 50)
        expect = "empty dataset"
    elif name == "vocab":  # token ids the model (vocab_size 512) does not have
        data.write_text('{"input_ids": [1, 2, 3, 4]}\n{"input_ids": [5, 700, 6]}\n')
        expect = "vocab_size is 512"
    else:  # a label id it does not have: the loss failed on the worker, every retry
        data.write_text(
            '{"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}\n'
            '{"input_ids": [5, 6, 7], "labels": [-100, 6, 700]}\n'
        )
        expect = "up to 700, but the model's vocab_size is 512"
    return data, expect


@pytest.mark.parametrize("case", ["not-utf8", "empty", "vocab", "vocab-labels"])
def test_data_problems_are_found_at_submit(
    cluster: LocalCluster, tmp_path: Path, case: str
) -> None:
    data, expect = _data_case(tmp_path, case)
    spec = tiny_spec(tmp_path / "out").to_dict()
    spec["data"]["path"] = str(data)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    jobs_before = len(cluster.client.jobs())
    result = _submit(path, cluster.address, env=cluster.key_env("admin"))
    assert result.returncode == 2, result.stderr + cluster.logs()
    assert "rejected the job" in result.stderr and expect in result.stderr, result.stderr
    assert len(cluster.client.jobs()) == jobs_before  # nothing accepted
    assert not (tmp_path / "out").exists()  # no empty checkpoints/ left behind


# --------------------------------------------------------------------------- memory

BIG_CONTEXT = {
    **TINY_QWEN3,
    "hidden_size": 1024,
    "head_dim": 256,
    "max_position_embeddings": 65536,
}


def _memory_spec(tmp_path: Path, rows: int, microbatches: int) -> Path:
    spec = tiny_spec(tmp_path / "out", config=BIG_CONTEXT, plan="F[0:2] T[2:6] B[0:2]").to_dict()
    spec["data"]["seq_len"] = 65536
    spec["batch"] = {"microbatch_size": rows, "num_microbatches": microbatches}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_job_that_cannot_fit_under_any_plan_is_refused_at_submit(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    # The io arena alone (token ids and labels of every microbatch, both parities):
    # 2 x 16 bytes x 64 rows x 65536 tokens = 128 MiB per microbatch; ask for 4x the RAM.
    per_microbatch = 2 * 16 * 64 * 65536
    microbatches = 4 * psutil.virtual_memory().available // per_microbatch + 1
    result = _submit(
        _memory_spec(tmp_path, 64, microbatches), cluster.address, env=cluster.key_env("admin")
    )
    assert result.returncode == 2, result.stderr + cluster.logs()
    assert "whatever its plan" in result.stderr and "GiB of host memory" in result.stderr
    assert "is available on this machine" in result.stderr


def test_job_whose_plan_does_not_fit_fails_before_allocating(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """seq_len 65536 on a small model: its activation slots (1 GiB per microbatch slot
    here) are sized, checked against the machine and refused; nothing is allocated."""
    cluster.add_worker("w-memory")
    cluster.wait_for_workers(1)
    per_boundary = 2 * 4 * 65536 * 1024 * 4  # parities x rows x tokens x hidden x fp32
    microbatches = 4 * psutil.virtual_memory().available // per_boundary + 1
    path = _memory_spec(tmp_path, 4, microbatches)
    result = subprocess.run(
        [*CLI, "submit", str(path), "--wait", "--address", cluster.address],
        env={**os.environ, **cluster.key_env("admin")},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 1, result.stderr + cluster.logs()
    assert "failed at 0/" in result.stderr and "GiB of host memory (arenas" in result.stderr
    assert "is available on this machine" in result.stderr
    assert not [p for p in cluster.arena_dir.iterdir() if p.name.startswith("rp.")]
