"""The checkpoint directory: atomic writes, validation, fallback, pruning, stale leftovers.

Tiny tensors only; the trainer's use of it is tested in tests/test_resume.py.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from roundpipe.coordinator.spec.checkpoint_format import (
    LATEST,
    MANIFEST,
    MANIFEST_DIGEST,
    CheckpointError,
    sealed,
    step_name,
)
from roundpipe.coordinator.training import checkpoint as checkpoint_module
from roundpipe.coordinator.training.checkpoint import (
    STATE_FILE,
    CheckpointDir,
    as_os_error,
    load_tensors,
    resolve_checkpoint,
    save_tensor_stream,
    save_tensors,
    verify_checkpoint,
)


def fill_with(step: int):
    def fill(directory: Path) -> None:
        (directory / "config.json").write_text(json.dumps({"step": step}))
        (directory / STATE_FILE).parent.mkdir()
        save_tensors(directory / STATE_FILE, {"w": torch.full((4, 5), float(step))})

    return fill


def write(ckpts: CheckpointDir, step: int, job: str = "job-a") -> Path:
    return ckpts.write(step, fill_with(step), {"job_id": job})


def state_step(path: Path) -> float:
    return float(dict(load_tensors(path / STATE_FILE))["w"][0, 0])


# --------------------------------------------------------------------------- tensors


def test_save_tensors_is_standard_safetensors(tmp_path: Path) -> None:
    storage = torch.arange(24, dtype=torch.float32)
    tensors = {
        "a": storage[:12].view(3, 4),  # views of one storage, as arena views are
        "b": storage[12:],
        "half": torch.randn(3, 2).to(torch.bfloat16),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
        "rng": torch.get_rng_state(),
    }
    save_tensors(tmp_path / "x.safetensors", tensors, {"format": "test"})
    loaded = load_file(str(tmp_path / "x.safetensors"))
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "test"}


def test_a_stream_of_parts_is_one_standard_safetensors_file(tmp_path: Path) -> None:
    """Note [streamed checkpoint state]: the header first, then the tensors part by part
    (a sharded checkpoint's optimizer states, one gathered layer at a time); no part is
    asked for before the one before it was written."""
    layers = [
        {f"exp_avg/l{i}.w": torch.randn(3, 4), f"exp_avg_sq/l{i}.w": torch.rand(5)}
        for i in range(3)
    ]
    first = {"prev/w": torch.randn(2, 2).to(torch.bfloat16), "rng": torch.get_rng_state()}
    entries = [(k, t.dtype, tuple(t.shape)) for part in [first, *layers] for k, t in part.items()]
    asked: list[int] = []
    path = tmp_path / "state.safetensors"

    def parts():
        yield first
        for i, part in enumerate(layers):
            asked.append(i)
            assert path.stat().st_size > 8 + 64 * i  # what came before is in the file
            yield part

    save_tensor_stream(path, entries, parts(), {"format": "test"})
    assert asked == [0, 1, 2]
    loaded = load_file(str(path))
    for part in [first, *layers]:
        for key, t in part.items():
            assert loaded[key].dtype == t.dtype and torch.equal(loaded[key], t), key
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "test"}


def test_a_stream_that_does_not_match_its_header_is_refused(tmp_path: Path) -> None:
    entries = [("a", torch.float32, (2,)), ("b", torch.float32, (3,))]
    with pytest.raises(ValueError, match=r"got tensor b torch.float32\[4\] where the header"):
        save_tensor_stream(
            tmp_path / "x", entries, iter([{"a": torch.zeros(2)}, {"b": torch.zeros(4)}])
        )
    with pytest.raises(ValueError, match="the parts ended before tensor b"):
        save_tensor_stream(tmp_path / "y", entries, iter([{"a": torch.zeros(2)}]))
    with pytest.raises(ValueError, match="where the header has no more tensors"):
        save_tensor_stream(
            tmp_path / "z", entries[:1], iter([{"a": torch.zeros(2), "b": torch.zeros(3)}])
        )


# --------------------------------------------------------------------------- writing


def test_write_is_complete_and_pointer_moves(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path / "checkpoints")
    path = write(ckpts, 3)
    assert path == tmp_path / "checkpoints" / "step-00000003"
    assert (ckpts.root / LATEST).read_text() == "step-00000003\n"
    info = verify_checkpoint(path)
    assert info.step == 3 and info.job_id == "job-a"
    assert set(info.manifest["files"]) == {"config.json", STATE_FILE}
    assert sorted(p.name for p in ckpts.root.iterdir()) == [LATEST, "step-00000003"]
    write(ckpts, 5)
    assert ckpts.find_latest().step == 5
    assert state_step(ckpts.find_latest().path) == 5


def test_failed_write_leaves_nothing_and_keeps_latest(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path)
    write(ckpts, 2)

    def full_disk(directory: Path) -> None:
        (directory / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / "x"))

    with pytest.raises(OSError) as info:
        ckpts.write(4, full_disk, {"job_id": "job-a"})
    assert info.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-00000002"]
    assert ckpts.find_latest().step == 2


def test_library_io_errors_become_os_errors(tmp_path: Path) -> None:
    class SafetensorError(Exception):
        pass

    exc = SafetensorError("Error while serializing: I/O error: No space left (os error 28)")
    mapped = as_os_error(exc, tmp_path)
    assert isinstance(mapped, OSError) and mapped.errno == errno.ENOSPC
    assert as_os_error(ValueError("shape mismatch"), tmp_path) is None

    def fill(directory: Path) -> None:
        raise exc

    with pytest.raises(OSError):
        CheckpointDir(tmp_path).write(1, fill, {"job_id": "j"})
    assert list(tmp_path.iterdir()) == []


def test_a_pointer_that_cannot_be_written_leaves_no_new_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk at ``latest``: the write fails as a whole. The complete directory it
    had renamed into place goes (a later run would have resumed from a checkpoint the
    job reported as not written), and a checkpoint of the same step it was replacing
    comes back."""
    from roundpipe.coordinator.training import checkpoint as checkpoint_module

    ckpts = CheckpointDir(tmp_path)
    write(ckpts, 1)
    write(ckpts, 2, job="old-job")
    real = checkpoint_module._write_synced

    def full_at_latest(path: Path, data: bytes) -> None:
        if path.name.startswith(f".tmp-{LATEST}-"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(checkpoint_module, "_write_synced", full_at_latest)
    with pytest.raises(OSError):
        write(ckpts, 3)
    with pytest.raises(OSError):
        write(ckpts, 2, job="new-job")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, step_name(1), step_name(2)]
    assert ckpts.find_latest().job_id == "old-job"


def test_same_step_is_replaced(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path)
    write(ckpts, 4, job="old-job")
    write(ckpts, 4, job="new-job")
    info = ckpts.find_latest()
    assert info.job_id == "new-job" and info.step == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-00000004"]


# --------------------------------------------------------------------------- reading


def test_damaged_latest_falls_back_to_previous(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path)
    for step in (1, 2, 3):
        write(ckpts, step)
    state = tmp_path / step_name(3) / STATE_FILE
    data = bytearray(state.read_bytes())
    data[-1] ^= 0xFF  # same size, one bit pattern changed: only the checksum sees it
    state.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        verify_checkpoint(tmp_path / step_name(3))
    assert ckpts.find_latest().step == 2
    # Truncated file: caught by its size.
    (tmp_path / step_name(2) / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="bytes"):
        verify_checkpoint(tmp_path / step_name(2))
    assert ckpts.find_latest().step == 1
    # Manifest gone: not a checkpoint at all.
    (tmp_path / step_name(1) / MANIFEST).unlink()
    assert ckpts.find_latest() is None


def test_a_damaged_manifest_is_not_trusted(tmp_path: Path) -> None:
    """One bit flipped in a manifest ("step": 3 -> 2, or any field) fails its own digest,
    and the previous checkpoint is found; a manifest whose step is not its directory's
    is damaged too (before, a flipped step resumed past the data and the job finished
    at once with the old weights as its model). A manifest without a digest (written
    before there was one) is still read."""
    ckpts = CheckpointDir(tmp_path)
    for step in (1, 2, 3):
        write(ckpts, step)
    manifest = tmp_path / step_name(3) / MANIFEST
    text = manifest.read_text()
    assert '"step": 3' in text
    manifest.write_text(text.replace('"step": 3', '"step": 2'))
    with pytest.raises(CheckpointError, match="checkpoint.json fails its SHA-256 check"):
        verify_checkpoint(tmp_path / step_name(3))
    assert ckpts.find_latest().step == 2
    # Resealed by hand: the digest holds, the directory's name does not.
    body = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(sealed(body)))
    with pytest.raises(CheckpointError, match="says step 2, its name step 3"):
        verify_checkpoint(tmp_path / step_name(3))
    old = tmp_path / step_name(2) / MANIFEST
    body = json.loads(old.read_text())
    del body[MANIFEST_DIGEST]
    old.write_text(json.dumps(body))
    assert verify_checkpoint(tmp_path / step_name(2)).step == 2


def test_missing_or_garbage_pointer_scans_directories(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path)
    write(ckpts, 1)
    write(ckpts, 2)
    (tmp_path / LATEST).write_text("../../etc\n")
    assert ckpts.pointer() is None and ckpts.find_latest().step == 2
    (tmp_path / LATEST).unlink()
    assert ckpts.find_latest().step == 2
    # An output directory is the submitter's: what `latest` is there is read at every
    # coordinator start. Bytes that are not UTF-8 (they stopped the start), a FIFO (it
    # would wait for a writer forever), a symbolic link, a directory: no pointer.
    (tmp_path / LATEST).write_bytes(b"\xff\xfe" * 1000)
    assert ckpts.pointer() is None and ckpts.find_latest().step == 2
    (tmp_path / LATEST).unlink()
    os.mkfifo(tmp_path / LATEST)
    assert ckpts.pointer() is None
    (tmp_path / LATEST).unlink()
    (tmp_path / LATEST).symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_text(step_name(1) + "\n")
    assert ckpts.pointer() is None
    (tmp_path / LATEST).unlink()
    (tmp_path / LATEST).mkdir()
    assert ckpts.pointer() is None and ckpts.find_latest().step == 2


def test_find_latest_only_returns_the_jobs_own(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path)
    write(ckpts, 2, job="mine")
    write(ckpts, 4, job="other")
    assert ckpts.find_latest().job_id == "other"
    assert ckpts.find_latest(job_id="mine").step == 2
    assert ckpts.find_latest(job_id="nobody") is None


def test_likely_resume_agrees_with_find_latest_without_reading_checksums(
    tmp_path: Path,
) -> None:
    """The checkpoint a paused job's message names: ``latest`` if it is the job's and
    intact, else the newest intact one, as ``find_latest`` picks; a file cut short is
    seen by its size (no checksum is read)."""
    ckpts = CheckpointDir(tmp_path)
    write(ckpts, 2)
    write(ckpts, 4)
    write(ckpts, 6)
    write(ckpts, 8, job="other")
    (tmp_path / LATEST).write_text(step_name(4) + "\n")  # 6: written, pointer not moved
    assert ckpts.likely_resume("job-a").step == ckpts.find_latest("job-a").step == 4
    with open(tmp_path / step_name(4) / STATE_FILE, "r+b") as f:
        f.truncate(10)
    assert ckpts.likely_resume("job-a").step == ckpts.find_latest("job-a").step == 6
    assert ckpts.likely_resume("nobody") is None


def test_resolve_checkpoint_accepts_step_checkpoints_or_output_dir(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path / "out" / "checkpoints")
    write(ckpts, 1)
    write(ckpts, 2)
    for given in (ckpts.root / step_name(1), ckpts.root, tmp_path / "out"):
        expected = 1 if given.name == step_name(1) else 2
        assert resolve_checkpoint(given).step == expected
    with pytest.raises(CheckpointError, match="not a RoundPipe checkpoint"):
        resolve_checkpoint(tmp_path)


# --------------------------------------------------------------------------- housekeeping


def test_prune_keeps_last_n_of_the_job_and_never_latest(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path)
    write(ckpts, 1, job="other")
    for step in (2, 3, 4, 5):
        write(ckpts, step)
    removed = ckpts.prune(2, "job-a")
    assert sorted(p.name for p in removed) == [step_name(2), step_name(3)]
    assert [c.step for c in ckpts.complete()] == [1, 4, 5]
    assert ckpts.prune(0, "job-a") == []  # 0 keeps all


def test_prune_counts_only_intact_checkpoints_and_removes_damaged_ones(tmp_path: Path) -> None:
    """A damaged checkpoint (a file cut short) counted toward ``keep_last``: a good one
    was removed in its place, leaving fewer to resume from than asked for. A damaged
    ``latest`` is kept (it is never removed), and a directory whose manifest cannot be
    read is left alone (whose it is is unknown)."""
    ckpts = CheckpointDir(tmp_path)
    for step in (2, 4, 6):
        write(ckpts, step)
    with open(tmp_path / step_name(4) / STATE_FILE, "r+b") as f:
        f.truncate(10)
    write(ckpts, 8)
    removed = ckpts.prune(3, "job-a")
    assert [p.name for p in removed] == [step_name(4)]
    assert [c.step for c in ckpts.complete()] == [2, 6, 8]  # three intact ones kept

    with open(tmp_path / step_name(8) / STATE_FILE, "r+b") as f:  # the latest, damaged
        f.truncate(10)
    (tmp_path / step_name(6) / MANIFEST).write_text("{")
    removed = ckpts.prune(1, "job-a")
    assert [p.name for p in removed] == []  # 2: the one intact checkpoint; 6: unreadable
    assert ckpts.find_latest().step == 2
    write(ckpts, 10)
    assert sorted(p.name for p in ckpts.prune(1, "job-a")) == [step_name(2), step_name(8)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, step_name(6), step_name(10)]


def test_a_pointer_that_cannot_be_replaced_is_named_in_the_error(tmp_path: Path) -> None:
    """``latest`` made a directory: the write fails naming ``latest``, not the pointer's
    temporary file (removed by then), and leaves no temporary behind."""
    ckpts = CheckpointDir(tmp_path)
    (tmp_path / LATEST).mkdir()
    (tmp_path / LATEST / "something").write_text("x")
    with pytest.raises(OSError) as info:
        write(ckpts, 1)
    assert info.value.filename == str(tmp_path / LATEST)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_prune_removes_checkpoints_newer_than_latest(tmp_path: Path) -> None:
    """A run killed after renaming step 6 but before moving the pointer, resumed from
    step 4: once step 5 is the latest, the stale step 6 goes (it is rewritten later)."""
    ckpts = CheckpointDir(tmp_path)
    write(ckpts, 4)
    write(ckpts, 6)
    (tmp_path / LATEST).write_text(step_name(4) + "\n")
    write(ckpts, 5)
    ckpts.prune(3, "job-a")
    assert [c.step for c in ckpts.complete()] == [4, 5]


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path)
    write(ckpts, 1)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    live_pid = os.getppid()  # pytest's parent: alive while the test runs
    stale = tmp_path / f".tmp-step-00000002-{dead_pid}-abcd1234"
    trash = tmp_path / f".trash-step-00000000-{dead_pid}-abcd1234"
    live = tmp_path / f".tmp-step-00000002-{live_pid}-abcd1234"
    for d in (stale, trash, live):
        d.mkdir()
        (d / "f").write_text("partial")
    ckpts.ensure_writable()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([LATEST, step_name(1), live.name])
    assert ckpts.find_latest().step == 1


def test_unwritable_directory_fails_the_probe(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError):
        CheckpointDir(blocker / "checkpoints").ensure_writable()


def test_a_read_only_file_system_is_named_by_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a read-only mount the probe cannot be created, and unlinking it (though it is
    not there) fails with EROFS too: that second error replaced the first, naming the
    probe file, which never existed, instead of the directory."""

    def read_only(*_args, **_kwargs):
        raise OSError(errno.EROFS, "Read-only file system", "(the probe)")

    ckpts = CheckpointDir(tmp_path / "checkpoints")
    monkeypatch.setattr(checkpoint_module, "_write_synced", read_only)
    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(OSError) as err:
        ckpts.ensure_writable()
    assert err.value.errno == errno.EROFS and err.value.filename == str(ckpts.root)


def test_the_final_model_is_on_disk_before_the_job_succeeds(
    tmp_path: Path, arena_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``save_pretrained`` writes in place and syncs nothing, and the job store records
    "succeeded" durably right after the export: every file of the export (and of a LoRA
    job's randomly initialised base) and their directories are fsynced. A base-model
    copy left by a writer killed between its write and its rename is removed."""
    from runtime_helpers import tiny_spec, trained_in_process

    synced: set[str] = set()
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], text=True, capture_output=True
    )
    out = tmp_path / "out"
    out.mkdir()
    left = out / f".tmp-base_model-{int(dead.stdout)}-abcd1234"
    left.mkdir()
    (left / "model.safetensors").write_text("partial")
    (out / "base_model").write_text("a file where the base goes: replaced, not left as trash")
    spec = tiny_spec(out, steps=2, lora={"r": 4})
    monkeypatch.setattr(os, "fsync", recording_fsync)
    with trained_in_process(spec, arena_dir, 1) as trainer:
        trainer.export(tmp_path / "export")
    monkeypatch.undo()
    exported = tmp_path / "export"
    files = [str(p) for p in exported.iterdir() if p.is_file()]
    assert files and set(files) <= synced, sorted(set(files) - synced)
    assert str(exported) in synced
    # The base's files are synced before their directory is renamed into place; then
    # the rename itself, in the output directory.
    assert (out / "base_model" / "model.safetensors").is_file() and str(out) in synced
    assert not left.exists() and not list(out.glob(".trash-*"))
