"""Shared fixtures: a private arena directory per test and helpers to run child processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).parent
PROCS_DIR = TESTS_DIR / "procs"

# Nothing in the runtime may touch the Hugging Face hub; make any attempt fail at once.
os.environ["HF_HUB_OFFLINE"] = "1"

# Test helper modules (tests/*_helpers.py) are imported by bare name. With
# --import-mode=importlib pytest does not put this folder on sys.path, so do it once here.
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


@pytest.fixture(scope="session", autouse=True)
def allowed_roots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every coordinator a test starts may read and write below pytest's temporary root
    (where the tests put their data and outputs): a coordinator's paths are confined to
    configured roots (coordinator.paths), and LocalCluster's children inherit this."""
    base = tmp_path_factory.getbasetemp()
    saved = {k: os.environ.get(k) for k in ("ROUNDPIPE_ALLOW_READ", "ROUNDPIPE_ALLOW_WRITE")}
    os.environ["ROUNDPIPE_ALLOW_READ"] = os.environ["ROUNDPIPE_ALLOW_WRITE"] = str(base)
    yield base
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def arena_dir(tmp_path: Path) -> Iterator[Path]:
    """A fresh arena directory (RAM-backed when /dev/shm is usable) removed afterwards."""
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path
    directory = Path(
        subprocess.check_output(["mktemp", "-d", str(base / "rp-test-XXXXXX")], text=True).strip()
    )
    yield directory
    for entry in directory.iterdir():
        entry.unlink()
    directory.rmdir()


SpawnChild = Callable[..., "subprocess.Popen[str]"]


@pytest.fixture
def spawn_child() -> Iterator[SpawnChild]:
    """Start ``tests/procs/<script> ARGS`` in fresh interpreters; kill leftovers at teardown."""
    children: list[subprocess.Popen[str]] = []

    def spawn(script: str, *args: object) -> subprocess.Popen[str]:
        child = subprocess.Popen(
            [sys.executable, str(PROCS_DIR / script), *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        children.append(child)
        return child

    yield spawn
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)
        for stream in (child.stdout, child.stderr):
            if stream is not None:
                stream.close()
