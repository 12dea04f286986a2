"""Arenas against other local users (issue 33, item 6): names nobody can predict, private
directories, and refusals of what someone else could have planted.

The arena root (/dev/shm by default) is writable by every local user. Before, arena names
were ``rp.<namespace>.<pid>.<start>.<name>``, all of which another user can read off the
process table, so creating them first made every job fail with "already exists". These
tests play that user with real files and processes; ownership by a *foreign* user needs
root to set up, so the owner checks are also driven with a faked expected uid
(``uid=`` / ``owner_uid=``), and for real where the tests run as root.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from runtime_helpers import first_iteration, tiny_spec

from roundpipe.cluster import LocalCluster
from roundpipe.coordinator.service.daemon import Coordinator, _namespace_for
from roundpipe.shared.arena import (
    Arena,
    ArenaError,
    check_arena_file,
    check_arena_root,
    check_private_dir,
    prepare_arena_dir,
    process_start_cs,
    remove_stale_arenas,
)
from roundpipe.worker.runtime import WorkerCore

PROCS = Path(__file__).resolve().parent / "procs"
ME = os.geteuid()
OTHER = ME + 4242  # a uid that owns nothing here: stands for "the coordinator's user"
NOBODY = 65534
TOKEN = r"[0-9a-f]{16}"
as_root = pytest.mark.skipif(ME != 0, reason="giving files to another user needs root")


@pytest.fixture
def shared_root(tmp_path: Path) -> Iterator[Path]:
    """A stand-in for /dev/shm: world-writable with the sticky bit (RAM-backed if we can)."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    root = Path(tempfile.mkdtemp(prefix="rp-shared-", dir=base))
    root.chmod(0o1777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _squat(root: Path, namespace: str, *pid: int) -> list[Path]:
    out = subprocess.run(
        [sys.executable, str(PROCS / "arena_squatter.py"), str(root), namespace, *map(str, pid)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [Path(line) for line in out.stdout.split()]


def _private_dirs(root: Path, namespace: str) -> list[Path]:
    return [
        p for p in root.iterdir() if re.fullmatch(rf"rp\.{namespace}\.\d+\.\d+\.{TOKEN}\.d", p.name)
    ]


# --------------------------------------------------------------------------- squatting


@pytest.mark.slow
def test_a_job_runs_although_every_predictable_arena_name_was_taken(
    tmp_path: Path, shared_root: Path
) -> None:
    address_dir = tmp_path / "c"
    namespace = _namespace_for(f"ipc://{address_dir}/coordinator.sock")
    squatted = _squat(shared_root, namespace)  # before the coordinator exists
    cluster = LocalCluster(address_dir, shared_root)
    try:
        assert cluster.address == f"ipc://{address_dir}/coordinator.sock"
        cluster.add_worker("w1")
        cluster.wait_for_workers(1)
        # The coordinator's pid and start time are public: squat its job's arena names.
        squatted += _squat(shared_root, namespace, cluster.coordinator.proc.pid)
        assert len(squatted) == 4 + 1 + 6 * 3
        job = cluster.client.submit(tiny_spec(tmp_path / "out", steps=2))
        status = job.wait(timeout_s=300)
        assert status.state == "succeeded", (status.message, cluster.logs())
        # The job's arenas were in a directory of its own, removed with them.
        used = re.findall(
            rf"\[layout\] \d+ arenas, .* in ({re.escape(str(shared_root))}/\S+):",
            cluster.coordinator.log_path.read_text(),
        )
        assert len(used) == 1 and re.fullmatch(
            rf"rp\.{namespace}\.\d+\.\d+\.{TOKEN}\.d", Path(used[0]).name
        )
        assert not Path(used[0]).exists() and not _private_dirs(shared_root, namespace)
    finally:
        leftovers = cluster.stop()
    assert all(p in squatted for p in leftovers), leftovers
    assert all(p.is_symlink() or p.exists() for p in squatted)  # nothing of theirs touched


def test_names_are_not_predictable(arena_dir: Path, shared_root: Path) -> None:
    """Same namespace, pid, start time and arena name: still two different files (before,
    the second was "already exists"), and two coordinators get different directories."""
    a = Arena.create("params", 4096, directory=arena_dir, namespace="ns")
    b = Arena.create("params", 4096, directory=arena_dir, namespace="ns")
    try:
        predictable = f"rp.ns.{os.getpid()}.{process_start_cs(os.getpid())}.params"
        for arena in (a, b):
            assert re.fullmatch(rf"{re.escape(predictable)}\.{TOKEN}", arena.path.name)
        assert a.path != b.path
        assert stat.S_IMODE(a.path.stat().st_mode) == 0o600
    finally:
        a.destroy()
        b.destroy()
    first = prepare_arena_dir(shared_root, "ns")
    second = prepare_arena_dir(shared_root, "ns")
    try:
        assert first.created and second.created and first.path != second.path
        assert {first.path, second.path} == set(_private_dirs(shared_root, "ns"))
        with Arena.create("params", 4096, directory=first.path, namespace="ns") as arena:
            assert arena.path.parent == first.path
    finally:
        first.close()
        second.close()
    assert list(shared_root.iterdir()) == []


def test_each_job_gets_a_private_directory_of_its_own(tmp_path: Path, shared_root: Path) -> None:
    """Two jobs of one coordinator (same namespace, pid and start time): two directories,
    mode 0700, holding their arenas; each goes with its job."""
    first, _ = first_iteration(tmp_path / "a", shared_root, "job-a", "jobns")
    second, _ = first_iteration(tmp_path / "b", shared_root, "job-b", "jobns")
    try:
        dirs = [t.layout.space.path for t in (first, second)]
        assert dirs[0] != dirs[1] and set(dirs) == set(_private_dirs(shared_root, "jobns"))
        for trainer, directory in zip((first, second), dirs):
            st = directory.lstat()
            assert stat.S_ISDIR(st.st_mode) and st.st_uid == ME
            assert stat.S_IMODE(st.st_mode) == 0o700
            infos = trainer.job_setup().arenas
            assert {Path(i.path).parent for i in infos} == {directory}
            assert all(stat.S_IMODE(os.stat(i.path).st_mode) == 0o600 for i in infos)
    finally:
        first.close()
        second.close()
    assert list(shared_root.iterdir()) == []


def test_a_private_root_is_used_as_it_is(arena_dir: Path) -> None:
    assert stat.S_IMODE(arena_dir.stat().st_mode) == 0o700  # mktemp -d
    with prepare_arena_dir(arena_dir, "ns") as space:
        assert space.path == arena_dir and not space.created
    assert arena_dir.is_dir()  # not ours to remove


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o711, 0o770, 0o707, 0o1777])
def test_an_arena_directory_others_can_access_is_refused(arena_dir: Path, mode: int) -> None:
    loose = arena_dir / "loose"
    loose.mkdir()
    try:
        loose.chmod(mode)
        with pytest.raises(ArenaError) as err:
            Arena.create("params", 4096, directory=loose)
        message = str(err.value)
        assert str(loose) in message and f"mode {mode:04o}" in message
        assert f"owner uid {ME}" in message and "chmod 700" in message
        assert list(loose.iterdir()) == []
    finally:
        loose.rmdir()


def test_a_root_others_can_write_without_sticky_bit_is_refused(
    tmp_path: Path, shared_root: Path
) -> None:
    open_root = shared_root / "open"
    open_root.mkdir()
    open_root.chmod(0o777)
    with pytest.raises(ArenaError) as err:
        prepare_arena_dir(open_root, "ns")
    message = str(err.value)
    assert str(open_root) in message and "mode 0777" in message and f"uid {ME}" in message
    assert "sticky" in message and "chmod +t" in message
    assert list(open_root.iterdir()) == []
    # The coordinator says so before it binds anything (main() prints it, exits 2).
    coordinator = Coordinator(f"ipc://{tmp_path}/c.sock", tmp_path / "state", open_root)
    with pytest.raises(ArenaError, match="sticky"):
        coordinator.bind()
    assert not (tmp_path / "c.sock").exists()
    coordinator.ctx.term()
    # With the sticky bit (as /dev/shm) the coordinator gets a private directory in it.
    open_root.chmod(0o1777)
    with prepare_arena_dir(open_root, "ns") as space:
        assert space.path.parent == open_root
        assert stat.S_IMODE(space.path.stat().st_mode) == 0o700
    assert list(open_root.iterdir()) == []


def test_a_directory_of_another_user_is_refused(arena_dir: Path) -> None:
    """The owner checks, with the expected uid faked (a foreign owner needs root)."""
    with pytest.raises(ArenaError) as err:
        check_private_dir(os.stat(arena_dir), arena_dir, OTHER)
    message = str(err.value)
    assert f"arena directory {arena_dir} is owned by uid {ME}" in message
    assert f"not by the coordinator's user (uid {OTHER})" in message
    assert "removed" in message and "--arena-dir" in message
    # As the coordinator of user OTHER: this root is someone else's (or root's, and then
    # the directory made in it is someone else's).
    with pytest.raises(ArenaError, match=rf"owned by uid {ME}"):
        prepare_arena_dir(arena_dir, "ns", uid=OTHER)
    assert list(arena_dir.iterdir()) == []
    if ME != 0:
        with pytest.raises(ArenaError, match="neither the coordinator's user .* nor root"):
            check_arena_root(arena_dir, uid=OTHER)


def test_a_worker_refuses_an_arena_of_another_user(arena_dir: Path) -> None:
    with Arena.create("params", 4096, directory=arena_dir) as arena:
        with pytest.raises(ArenaError) as err:
            Arena.attach(arena.path, owner_uid=OTHER)
        message = str(err.value)
        assert f"arena {arena.path} is owned by uid {ME}" in message
        assert f"not by the coordinator's user (uid {OTHER})" in message
        assert "Workers must run as the coordinator's user" in message
        with pytest.raises(ArenaError, match="owned by"):
            check_arena_file(os.stat(arena.path), arena.path, OTHER)
        Arena.attach(arena.path).close()  # the right owner maps it
        arena.path.chmod(0o640)
        with pytest.raises(ArenaError, match="mode 0640"):
            Arena.attach(arena.path)


@as_root
def test_foreign_owners_for_real(arena_dir: Path, shared_root: Path) -> None:
    foreign = arena_dir / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, NOBODY, NOBODY)
    with pytest.raises(ArenaError, match=rf"{foreign} is owned by uid {NOBODY}"):
        Arena.create("params", 4096, directory=foreign)
    foreign.rmdir()
    os.chown(shared_root, NOBODY, NOBODY)  # a root owned by another user, sticky or not
    with pytest.raises(ArenaError, match=rf"owned by uid {NOBODY}.*neither"):
        prepare_arena_dir(shared_root, "ns")
    os.chown(shared_root, 0, 0)
    with Arena.create("params", 4096, directory=arena_dir) as arena:
        os.chown(arena.path, NOBODY, NOBODY)
        with pytest.raises(ArenaError, match=rf"owned by uid {NOBODY}"):
            Arena.attach(arena.path)


def test_a_symlink_at_an_arena_path_is_refused(arena_dir: Path, tmp_path: Path) -> None:
    with Arena.create("params", 4096, directory=arena_dir) as arena:
        link = tmp_path / "planted"
        link.symlink_to(arena.path)
        with pytest.raises(ArenaError, match=rf"{link} is a symbolic link: refused"):
            Arena.attach(link)
    linked_dir = tmp_path / "dir-link"
    linked_dir.symlink_to(arena_dir)
    with pytest.raises(ArenaError, match="is a symbolic link: refused"):
        Arena.create("params", 4096, directory=linked_dir)
    assert list(arena_dir.iterdir()) == []


def test_a_worker_maps_no_planted_arena(tmp_path: Path, arena_dir: Path) -> None:
    """A real JobSetup whose arena paths are links to the real arenas: refused, and
    nothing of the job stays set up; the real paths map."""
    trainer, _ = first_iteration(tmp_path, arena_dir, "job-planted", "planted")
    core = WorkerCore(0)
    try:
        setup = trainer.job_setup()
        planted = tmp_path / "planted"
        planted.mkdir()
        arenas = []
        for info in setup.arenas:
            link = planted / Path(info.path).name
            link.symlink_to(info.path)
            arenas.append(msgspec.structs.replace(info, path=str(link)))
        with pytest.raises(ArenaError, match="symbolic link"):
            core.setup_job(msgspec.structs.replace(setup, arenas=arenas))
        assert "job-planted" not in core.jobs
        core.setup_job(setup)
        assert "job-planted" in core.jobs
        core.teardown_job("job-planted")
    finally:
        core.close()
        trainer.close()


# --------------------------------------------------------------------------- cleanup


def test_the_next_coordinator_removes_a_dead_ones_directory(shared_root: Path, spawn_child) -> None:
    child = spawn_child("arena_owner.py", shared_root, "jobs")
    assert child.stdout is not None
    dead_dir, dead_arena = (
        Path(child.stdout.readline().strip()),
        Path(child.stdout.readline().strip()),
    )
    assert dead_arena.parent == dead_dir and dead_dir.parent == shared_root, child.stderr
    live = prepare_arena_dir(shared_root, "jobs")
    other_ns = prepare_arena_dir(shared_root, "otherns")
    try:
        assert remove_stale_arenas(shared_root, "jobs") == []  # its owner lives
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        assert dead_arena.exists()  # SIGKILL runs no cleanup: this is the leftover
        # Not this user's: never touched (uid faked).
        assert remove_stale_arenas(shared_root, "jobs", uid=OTHER) == []
        with prepare_arena_dir(shared_root, "jobs") as successor:
            assert not dead_dir.exists()
            assert live.path.is_dir() and other_ns.path.is_dir() and successor.path.is_dir()
    finally:
        live.close()
        other_ns.close()
    assert list(shared_root.iterdir()) == []
