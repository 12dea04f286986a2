"""Security, round two (issue 33), item 7: an idle-connection flood fails nothing.

1,100 idle unauthenticated TCP connections against a coordinator limited to 1,024 open
files left the admin without answers and a running job ``failed``: libzmq accepted
connections until the process ran out of descriptors, and the checkpoint that could no
longer open a file failed the job. Now the coordinator bounds its connections (a budget
from RLIMIT_NOFILE minus a reserve for job files; the oldest silent handshakes go
first), and a checkpoint that cannot open a file pauses the job instead.

The end-to-end test floods a real coordinator (RLIMIT_NOFILE 256, set by its launcher)
on loopback with more idle raw TCP connections than it may open files, while a job that
checkpoints every step runs; the unit test makes a checkpoint's output directory fail to
open (EMFILE) at a chosen step.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from runtime_helpers import DEMO_DATA, out_of_descriptors, tiny_spec, trained_in_process

from roundpipe.cluster import LocalCluster
from roundpipe.coordinator.spec.documents import read_documents
from roundpipe.coordinator.spec.errors import DataError
from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.spec.paths import PathPolicy
from roundpipe.coordinator.spec.tokenizers import load_tokenizer
from roundpipe.coordinator.training.hold_point import hold_env
from roundpipe.coordinator.training.job_errors import JobPaused

NOFILE = 256
HOLD_STEP = 4
FLOOD = 2 * NOFILE

# The coordinator, started with a hard and soft RLIMIT_NOFILE of its first argument.
_LAUNCH = (
    "import resource, sys; n = int(sys.argv.pop(1)); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
    "from roundpipe.coordinator.service.main import main; sys.exit(main(sys.argv[1:]))"
)


class _LimitedTcpCluster(LocalCluster):
    """A LocalCluster whose coordinator serves tcp:// on loopback with few descriptors."""

    def __init__(
        self, root: Path, arena_dir: Path, port: int, nofile: int, env: dict[str, str]
    ) -> None:
        self._port, self._nofile = port, nofile
        super().__init__(root, arena_dir, env=env)

    def start_coordinator(self):
        self.address = f"tcp://127.0.0.1:{self._port}"
        return super().start_coordinator()

    def _spawn(self, name, args, env=None, **kwargs):
        if name == "coordinator":
            assert args[:2] == ["-m", "roundpipe.coordinator.service.main"], args
            args = ["-c", _LAUNCH, str(self._nofile), *args[2:]]
        return super()._spawn(name, args, env, **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[_LimitedTcpCluster]:
    arena_dir = Path("/dev/shm") / f"rp-flood-{os.getpid()}"
    arena_dir.mkdir()
    # Jobs wait before iteration HOLD_STEP until the test creates `go`
    # (ROUNDPIPE_TRAIN_HOLD): the flood is in place before the job's later checkpoints.
    hold = hold_env(HOLD_STEP, tmp_path / "go")
    c = _LimitedTcpCluster(tmp_path / "c", arena_dir, _free_port(), NOFILE, hold)
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(arena_dir, ignore_errors=True)
    assert c.coordinator.proc.returncode == 0, c.logs()


def _flood(port: int, count: int) -> list[socket.socket]:
    """``count`` idle TCP connections (connects in flight: the backlog may be full)."""
    socks = []
    for _ in range(count):
        s = socket.socket()
        s.setblocking(False)
        err = s.connect_ex(("127.0.0.1", port))
        assert err in (0, errno.EINPROGRESS), os.strerror(err)
        socks.append(s)
    return socks


def test_idle_connection_flood_neither_silences_the_admin_nor_fails_a_job(
    cluster: _LimitedTcpCluster, tmp_path: Path
) -> None:
    cluster.add_worker("w1")
    cluster.wait_for_workers(1)
    d = tiny_spec(tmp_path / "out", steps=12).to_dict()
    d["output"].update(checkpoint_every=1, keep_last=2, checkpoint_staging=0)
    handle = cluster.client.submit(JobSpec.from_dict(d))
    deadline = time.monotonic() + 120
    while handle.status().step < 1:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.05)
    flood = _flood(cluster._port, FLOOD)
    try:
        # A new admin connection, queued behind the whole flood, is answered.
        admin = cluster.client_as("admin", timeout_s=20)
        try:
            assert any(j.job_id == handle.job_id for j in admin.jobs()), cluster.logs()
            assert [w.name for w in admin.workers()] == ["w1"]
        finally:
            admin.close()
        # The coordinator hung up idle handshakes beyond its budget, and said so.
        deadline = time.monotonic() + 60
        while "connection budget" not in cluster.coordinator.tail(200_000):
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.05)
        # The rest of the job, with its checkpoint every step, runs under the flood.
        assert handle.status().step < HOLD_STEP
        (tmp_path / "go").touch()
        status = handle.wait(timeout_s=300)
    finally:
        for s in flood:
            s.close()
    assert status.state in ("succeeded", "paused"), f"{status}\n{cluster.logs()}"
    assert status.state == "succeeded" or "roundpipe resume" in status.message, status
    assert cluster.coordinator.alive() and cluster.workers["w1"].alive(), cluster.logs()


# --------------------------------------------------------------------------- unit level


class _NoDescriptorsAt:
    """A PathPolicy whose ``open_output`` fails with EMFILE on its ``at``-th call and the
    ``times - 1`` calls after it (the first call is the trainer's own check in
    ``prepare``; each checkpoint, each try of one and the final model open it again)."""

    def __init__(self, policy: PathPolicy, at: int, times: float = 1) -> None:
        self._policy, self._at, self._times, self.calls = policy, at, times, 0

    def __getattr__(self, name):
        return getattr(self._policy, name)

    def open_output(self, path):
        self.calls += 1
        if self._at <= self.calls < self._at + self._times:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return self._policy.open_output(path)


def _train_with_paths(
    tmp_path: Path, arena_dir: Path, monkeypatch: pytest.MonkeyPatch, policy, staging, job_id
) -> None:
    """A 3-step job checkpointing every step, then its final model, its trainer confined
    by ``policy`` (if any); the retries of Note [out of descriptors] wait 0 s (twice)."""
    from roundpipe.coordinator.training import job_output
    from roundpipe.coordinator.training import trainer as trainer_module

    d = tiny_spec(tmp_path / "out", steps=3, staleness=1).to_dict()
    d["output"].update(checkpoint_every=1, keep_last=0, checkpoint_staging=staging)
    real_init = trainer_module.Trainer.__init__

    def init(self, *args, **kwargs):
        kwargs["paths"] = policy
        real_init(self, *args, **kwargs)

    with monkeypatch.context() as patch:  # undone on return: a test may train again
        patch.setattr(job_output, "DESCRIPTOR_RETRY_WAITS_S", (0.0, 0.0))
        if policy is not None:
            patch.setattr(trainer_module.Trainer, "__init__", init)
        with trained_in_process(JobSpec.from_dict(d), arena_dir, 2, job_id=job_id) as trainer:
            trainer.export()  # the final model, as the job runner writes it


STAGING = pytest.mark.parametrize("staging", [0, "auto"], ids=["drained", "background"])


@STAGING
def test_checkpoint_short_of_descriptors_for_a_moment_is_tried_again(
    tmp_path: Path, arena_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog, staging
) -> None:
    """The output directory cannot be opened for checkpoint step 2's first try (EMFILE,
    as for a moment under a flood of connections): the checkpoint is tried again and
    the job succeeds, every checkpoint written."""
    policy = _NoDescriptorsAt(PathPolicy.for_coordinator(tmp_path / "state", [], [tmp_path]), 3)
    with caplog.at_level("WARNING", logger="roundpipe.coordinator.training.job_output"):
        _train_with_paths(tmp_path, arena_dir, monkeypatch, policy, staging, "job-emfile-once")
    retries = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
    assert len(retries) == 1 and "cannot write checkpoint step 2" in retries[0], retries
    assert "Too many open files" in retries[0], retries
    for step in (1, 2, 3):
        assert (tmp_path / "out" / "checkpoints" / f"step-{step:08d}").is_dir()
    assert (tmp_path / "out" / "config.json").is_file()


@STAGING
def test_checkpoint_that_cannot_open_its_directory_pauses_the_job(
    tmp_path: Path, arena_dir: Path, monkeypatch: pytest.MonkeyPatch, staging
) -> None:
    """The output directory cannot be opened for checkpoint step 2, try after try
    (EMFILE: the process stays out of descriptors). The job pauses, naming the error
    and what to do; step 1's checkpoint is kept."""
    policy = _NoDescriptorsAt(
        PathPolicy.for_coordinator(tmp_path / "state", [], [tmp_path]), 3, times=float("inf")
    )
    with pytest.raises(JobPaused) as info:
        _train_with_paths(tmp_path, arena_dir, monkeypatch, policy, staging, "job-emfile")
    message = str(info.value)
    for part in ("checkpoint step 2", "Too many open files", "EMFILE", "roundpipe resume"):
        assert part in message, message
    assert policy.calls == 2 + 3  # prepare, step 1, then step 2's three tries
    assert (tmp_path / "out" / "checkpoints" / "step-00000001").is_dir()
    assert not (tmp_path / "out" / "checkpoints" / "step-00000002").exists()


def test_final_model_short_of_descriptors_for_a_moment_is_tried_again(
    tmp_path: Path, arena_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final model's first try cannot open the output directory (EMFILE): it is
    written on the next, and the job succeeds."""
    counting = _NoDescriptorsAt(PathPolicy.for_coordinator(tmp_path / "a", [], [tmp_path]), 0, 0)
    _train_with_paths(tmp_path / "a", arena_dir, monkeypatch, counting, 0, "job-count")
    final = counting.calls  # prepare, the 3 checkpoints, then the final model
    assert final == 5, final
    policy = _NoDescriptorsAt(PathPolicy.for_coordinator(tmp_path / "b", [], [tmp_path]), final)
    _train_with_paths(tmp_path / "b", arena_dir, monkeypatch, policy, 0, "job-final-once")
    assert policy.calls == final + 1
    assert (tmp_path / "b" / "out" / "config.json").is_file()


def test_readers_out_of_descriptors_raise_the_hosts_error_not_a_data_error(
    tmp_path: Path,
) -> None:
    """With every descriptor taken, loading the tokenizer and reading a data file raise
    the OSError (EMFILE: the job pauses, to be resumed), not a DataError (the job would
    fail for good, as one did under CI's flood: its checkpoint's HF export reloads the
    tokenizer). A file that is really missing still gets its DataError."""
    import transformers  # noqa: F401  (its imports open files of their own)

    load_tokenizer(DEMO_DATA / "tokenizer")  # warm: the failure below is the descriptors'
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "one"}\n')
    with out_of_descriptors():
        with pytest.raises(OSError) as err:
            load_tokenizer(DEMO_DATA / "tokenizer")
        assert err.value.errno == errno.EMFILE and not isinstance(err.value, DataError)
        for fmt in ("jsonl_text", "text"):
            with pytest.raises(OSError) as err:
                list(read_documents(data, fmt))
            assert err.value.errno == errno.EMFILE, fmt
    with pytest.raises(DataError, match="data file not found"):
        list(read_documents(tmp_path / "missing.jsonl", "jsonl_text"))


def test_checkpoint_whose_tokenizer_cannot_be_read_pauses_the_job(
    tmp_path: Path, arena_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From checkpoint step 2 on, the HF export cannot read the tokenizer's files
    (EMFILE, wrapped by transformers in an error of its own): the checkpoint is tried
    again, then the job pauses (not fails), naming the error and what to do; step 1's
    checkpoint is kept."""
    import transformers

    from roundpipe.coordinator.spec import tokenizers

    real_load, real_from_pretrained = (
        tokenizers.load_tokenizer,
        transformers.AutoTokenizer.from_pretrained,
    )
    exports = []

    def failing_from_pretrained(*args, **kwargs):
        try:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), "tokenizer_config.json")
        except OSError as exc:
            raise ValueError("Can't load tokenizer") from exc

    def load_for_export(path):  # the exporter looks it up at each checkpoint
        exports.append(path)
        if len(exports) >= 2:
            monkeypatch.setattr(
                transformers.AutoTokenizer, "from_pretrained", failing_from_pretrained
            )
        try:
            return real_load(path)
        finally:
            monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", real_from_pretrained)

    monkeypatch.setattr(tokenizers, "load_tokenizer", load_for_export)
    with pytest.raises(JobPaused) as info:
        _train_with_paths(tmp_path, arena_dir, monkeypatch, None, 0, "job-emfile-tok")
    message = str(info.value)
    for part in ("checkpoint step 2", "Too many open files", "roundpipe resume"):
        assert part in message, message
    assert len(exports) == 1 + 3  # step 1, then step 2's three tries
    assert (tmp_path / "out" / "checkpoints" / "step-00000001").is_dir()


def test_final_model_safetensors_short_of_descriptors_is_tried_again(
    tmp_path: Path, arena_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """safetensors reports EMFILE in an error type of its own ("... (os error 24)"): the
    final model's JobPaused was chained to that, not to the OSError it stands for, so
    the retry (Note [out of descriptors]) did not see the errno and the job paused."""
    import transformers.modeling_utils as modeling_utils
    from safetensors import SafetensorError

    real = modeling_utils.safe_save_file
    calls = []

    def once_short(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise SafetensorError(
                "Error while serializing: I/O error: Too many open files (os error 24)"
            )
        return real(*args, **kwargs)

    counting = _NoDescriptorsAt(PathPolicy.for_coordinator(tmp_path / "s", [], [tmp_path]), 0, 0)
    from roundpipe.coordinator.training import trainer as trainer_module

    real_export = trainer_module.Trainer.export

    def export(self, directory=None):  # the checkpoints' own writes go through unharmed
        monkeypatch.setattr(modeling_utils, "safe_save_file", once_short)
        return real_export(self, directory)

    monkeypatch.setattr(trainer_module.Trainer, "export", export)
    _train_with_paths(tmp_path, arena_dir, monkeypatch, counting, 0, "job-st-once")
    assert len(calls) == 2  # the first try failed, the second wrote the model
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_cancel_ends_a_retry_wait(
    tmp_path: Path, arena_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drained checkpoint short of descriptors waits before its next try: a cancel then
    ended the job only after every wait (15.5 s), as "paused". Now at once, cancelled."""
    from roundpipe.coordinator.training import job_output
    from roundpipe.coordinator.training import trainer as trainer_module
    from roundpipe.coordinator.training.job_errors import JobCancelled

    policy = _NoDescriptorsAt(
        PathPolicy.for_coordinator(tmp_path / "state", [], [tmp_path]), 3, times=float("inf")
    )
    monkeypatch.setattr(job_output, "DESCRIPTOR_RETRY_WAITS_S", (600.0,))  # only a cancel ends it
    real_retry = job_output.JobOutput.retry_short_of_descriptors

    def retry(self, what, write, wait=None):
        def write_then_cancel():
            try:
                return write()
            except JobPaused:  # short of descriptors: the job is cancelled meanwhile
                self.cancelled.set()
                raise

        return real_retry(self, what, write_then_cancel, wait)

    monkeypatch.setattr(job_output.JobOutput, "retry_short_of_descriptors", retry)
    d = tiny_spec(tmp_path / "out", steps=3, staleness=1).to_dict()
    d["output"].update(checkpoint_every=1, keep_last=0, checkpoint_staging=0)
    real_init = trainer_module.Trainer.__init__

    def init(self, *args, **kwargs):
        kwargs["paths"] = policy
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(trainer_module.Trainer, "__init__", init)
    with pytest.raises(JobCancelled):
        with trained_in_process(JobSpec.from_dict(d), arena_dir, 2, job_id="job-cancel-wait"):
            pass
