"""Arenas: zero-copy views across real processes, bounds checks, ownership and cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from roundpipe.protocol import TensorRef
from roundpipe.shared.arena import (
    ALIGNMENT,
    DATA_START,
    Arena,
    ArenaAllocator,
    ArenaError,
    remove_stale_arenas,
)


def test_views_are_zero_copy_and_shared(arena_dir: Path) -> None:
    with Arena.create("params0", 1 << 20, directory=arena_dir) as owner:
        ref = owner.ref(DATA_START, torch.float32, (4, 8))
        mine = owner.view(ref)
        mine.copy_(torch.arange(32, dtype=torch.float32).view(4, 8))
        other = Arena.attach(owner.path)
        theirs = other.view(ref)
        assert torch.equal(theirs, mine)
        theirs[1, 2] = -5.0  # a write through one mapping is seen through the other
        assert mine[1, 2].item() == -5.0
        assert mine.data_ptr() != theirs.data_ptr()  # two mappings, one set of pages
        other.close()


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
        torch.float64,
        torch.int8,
        torch.int16,
    ],
)
def test_every_training_dtype_round_trips(arena_dir: Path, dtype: torch.dtype) -> None:
    with Arena.create("acts", 1 << 16, directory=arena_dir) as arena:
        alloc = ArenaAllocator("acts")
        alloc.alloc(torch.uint8, (3,))  # misalign the bump pointer on purpose
        ref = alloc.alloc(dtype, (5, 7))
        assert ref.offset % ALIGNMENT == 0
        source = (torch.randn(5, 7) * 10).to(dtype)
        arena.view(ref).copy_(source)
        assert torch.equal(Arena.attach(arena.path).view(ref), source)


def test_strided_view(arena_dir: Path) -> None:
    with Arena.create("grads", 4096, directory=arena_dir) as arena:
        base = arena.view(arena.ref(DATA_START, torch.float32, (6, 4)))
        base.copy_(torch.arange(24.0).view(6, 4))
        transposed = arena.view(arena.ref(DATA_START, torch.float32, (4, 6), stride=(1, 4)))
        assert torch.equal(transposed, base.t())
        # stride None (row-major, what the allocator hands out) views the same bytes as
        # the explicit row-major stride
        explicit = arena.view(arena.ref(DATA_START, torch.float32, (6, 4), stride=(4, 1)))
        assert arena.ref(DATA_START, torch.float32, (6, 4)).stride is None
        assert base.is_contiguous() and base.data_ptr() == explicit.data_ptr()
        assert torch.equal(base, explicit)


def test_descriptors_are_bounds_checked(arena_dir: Path) -> None:
    with Arena.create("io", 4096, directory=arena_dir) as arena:
        end = arena.nbytes

        def bad(
            offset: int,
            shape: tuple[int, ...],
            stride: tuple[int, ...],
            dtype: str = "float32",
            name: str = "io",
        ) -> str:
            ref = TensorRef(arena=name, offset=offset, dtype=dtype, shape=shape, stride=stride)
            with pytest.raises(ArenaError) as err:
                arena.view(ref)
            return str(err.value)

        assert "outside the data region" in bad(end - 8, (4,), (1,))
        assert "outside the data region" in bad(0, (1,), (1,))  # the header is not data
        assert "outside the data region" in bad(DATA_START, (2, 2), (1, 10_000))
        assert "not a multiple" in bad(DATA_START + 2, (1,), (1,))
        assert "used on arena" in bad(DATA_START, (1,), (1,), name="other")
        # The last element exactly at the end is fine; an empty tensor anywhere in range too.
        assert (
            arena.view(
                TensorRef(arena="io", offset=end - 4, dtype="float32", shape=(1,), stride=(1,))
            ).numel()
            == 1
        )
        assert (
            arena.view(
                TensorRef(
                    arena="io", offset=DATA_START, dtype="float32", shape=(0, 3), stride=(3, 1)
                )
            ).numel()
            == 0
        )


def test_allocator_capacity_error(arena_dir: Path) -> None:
    alloc = ArenaAllocator("small", capacity=DATA_START + 1024)
    alloc.alloc(torch.float32, (128,))
    with pytest.raises(ArenaError, match="is full"):
        alloc.alloc(torch.float32, (1024,))


def test_full_directory_is_a_clear_error(arena_dir: Path) -> None:
    with pytest.raises(ArenaError, match="cannot allocate .* MiB free"):
        Arena.create("huge", 1 << 60, directory=arena_dir)
    assert list(arena_dir.iterdir()) == []  # nothing half-made is left behind


def test_bad_names_and_missing_files(arena_dir: Path) -> None:
    with pytest.raises(ArenaError, match="arena name"):
        Arena.create("no/slashes", 10, directory=arena_dir)
    with pytest.raises(ArenaError, match="does not exist"):
        Arena.create("x", 10, directory=arena_dir / "nope")
    with pytest.raises(ArenaError, match="owner .* has exited"):
        Arena.attach(arena_dir / "rp.default.1.1.gone")
    junk = arena_dir / "junk"
    junk.write_bytes(b"\0" * 8192)
    junk.chmod(0o600)  # passes the ownership checks: the header is what is wrong
    with pytest.raises(ArenaError, match="not a RoundPipe arena"):
        Arena.attach(junk)
    junk.unlink()


def test_only_the_owner_destroys(arena_dir: Path) -> None:
    owner = Arena.create("params1", 4096, directory=arena_dir)
    attached = Arena.attach(owner.path)
    with pytest.raises(ArenaError, match="only its owner"):
        attached.destroy()
    attached.close()
    assert owner.path.exists()
    owner.destroy()
    assert not owner.path.exists()


def test_sigkill_of_attached_process_leaves_arena_intact(arena_dir: Path, spawn_child) -> None:
    with Arena.create("master", 1 << 16, directory=arena_dir) as owner:
        child = spawn_child("shm_child.py", "attach_write", owner.path)
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
            os.kill(child.pid, signal.SIGKILL)
            assert child.wait(timeout=30) == -signal.SIGKILL
        finally:
            child.kill()
        assert owner.path.exists()
        data = owner.view(owner.ref(DATA_START, torch.uint8, (4096,)))
        assert bool((data == 7).all())  # the child's writes survived it
        # And the arena still works for a new attacher.
        again = Arena.attach(owner.path)
        assert again.view(owner.ref(DATA_START, torch.uint8, (1,))).item() == 7
        again.close()


def test_next_owner_removes_leftovers_of_a_killed_owner(arena_dir: Path, spawn_child) -> None:
    child = spawn_child("shm_child.py", "owner", arena_dir, "jobs")
    try:
        assert child.stdout is not None
        dead_path = Path(child.stdout.readline().strip())
        assert dead_path.exists()
        live = Arena.create("live", 4096, directory=arena_dir, namespace="jobs")
        other_ns = Arena.create("live", 4096, directory=arena_dir, namespace="otherns")
        stranger = arena_dir / "rp.jobs.not-a-pid.file"
        stranger.write_text("not ours")
        # While the first owner lives, nothing is removed.
        assert remove_stale_arenas(arena_dir, "jobs") == []
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
    assert dead_path.exists()  # SIGKILL runs no cleanup: this is the leftover
    assert remove_stale_arenas(arena_dir, "jobs") == [dead_path]
    assert not dead_path.exists()
    assert live.path.exists() and other_ns.path.exists() and stranger.exists()
    live.destroy()
    other_ns.destroy()
    stranger.unlink()


def test_pid_reuse_is_not_mistaken_for_a_live_owner(arena_dir: Path) -> None:
    # Our own pid with a start time that is not ours: a previous process with this pid.
    fake = arena_dir / f"rp.reuse.{os.getpid()}.12345.params0"
    fake.write_bytes(b"\0" * DATA_START)
    assert remove_stale_arenas(arena_dir, "reuse") == [fake]


def test_a_view_outlives_the_arena_it_came_from(arena_dir: Path) -> None:
    """close() while a tensor view is alive (a transfer or compute thread finishing its
    task): the view still reads and writes the memory, which is unmapped when the view
    goes. close() unmapped it at once, and the next read segfaulted (in a child here)."""
    code = f"""
import gc, torch
from roundpipe.shared.arena import Arena
arena = Arena.create("outlive", 1 << 20, directory={str(arena_dir)!r})
view = arena.view(arena.ref(4096, torch.float32, (1024,)))
view.fill_(2.0)
arena.destroy()
gc.collect()
view += 1
print(float(view.sum()))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3072.0"
