"""A job spec reads and writes only below the coordinator's allowed roots (issue 16, paths).

Each attack of the issue, against a real coordinator process with real files: a file
outside the read roots (a secret JSON file, /etc/shadow as text), ``../`` escapes, a
symbolic link planted inside a root that points out, output outside the write roots,
output through a planted link, a link planted after the job was accepted. Each is refused
with a message naming the field, the rule and the flag, and nothing is read or written.
Then a real job writes its state, checkpoints, export and log 0600 / 0700.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from runtime_helpers import DEMO_DATA, InProcessWorkers, out_of_descriptors, tiny_spec

from roundpipe.client import RoundPipeError
from roundpipe.cluster import LocalCluster
from roundpipe.coordinator.spec.errors import JobSpecError
from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.spec.paths import (
    GROUP_MODES,
    PRIVATE_MODES,
    OwnedDir,
    PathPolicy,
    PathRefused,
    check_ownership,
    modes,
    open_no_symlinks,
    set_modes,
)
from roundpipe.coordinator.spec.sections import PATH_ACCESS, PATH_FIELDS, SECTIONS
from roundpipe.coordinator.training.checkpoint import CheckpointDir, save_tensors
from roundpipe.protocol import ErrorReply, JobAccepted, Message, SubmitJob, decode, encode

SECRET = "TOPSECRET_KEY_7f3a"


# --------------------------------------------------------------------------- the policy


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """read/ and write/ roots, an outside secret/ and an outside victim/."""
    for name in ("read", "write", "secret", "victim"):
        (tmp_path / name).mkdir()
    (tmp_path / "secret" / "secret.json").write_text(f'{{"{SECRET}": 1}}\n')
    (tmp_path / "read" / "ok.jsonl").write_text('{"text": "hello"}\n')
    return tmp_path


def _policy(tree: Path) -> PathPolicy:
    return PathPolicy.create([tree / "read"], [tree / "write"])


def test_out_of_descriptors_is_the_hosts_problem_not_the_specs(tree: Path) -> None:
    """With every descriptor taken (a flood of connections), preparing the output
    directory raises the OSError itself (EMFILE: the job runner pauses the job, to be
    resumed), not a refusal of the spec's path (the job would fail for good)."""
    import errno

    policy = _policy(tree)
    with out_of_descriptors():
        with pytest.raises(OSError) as err:
            policy.prepare_output(tree / "write" / "out")
        assert err.value.errno == errno.EMFILE and not isinstance(err.value, PathRefused)
    assert policy.prepare_output(tree / "write" / "out").is_dir()


def test_read_outside_the_roots_is_refused_without_saying_whether_it_exists(tree: Path) -> None:
    policy = _policy(tree)
    messages = []
    for target in (tree / "secret" / "secret.json", tree / "secret" / "nothing-here.json"):
        with pytest.raises(PathRefused) as err:
            policy.check_read(str(target), "data.path")
        messages.append(str(err.value).replace(target.name, "X"))
        assert "access refused" in str(err.value) and "--allow-read" in str(err.value)
        assert str(err.value).startswith("data.path: ")
    assert messages[0] == messages[1]  # an existing and a missing file: the same answer
    assert policy.check_read(str(tree / "read" / "ok.jsonl")) == str(tree / "read" / "ok.jsonl")


def test_dotdot_and_outward_symlinks_are_refused(tree: Path) -> None:
    policy = _policy(tree)
    escape = f"{tree}/read/../secret/secret.json"
    with pytest.raises(PathRefused, match="outside every directory"):
        policy.check_read(escape, "data.path")
    (tree / "read" / "planted.json").symlink_to(tree / "secret" / "secret.json")
    with pytest.raises(PathRefused, match="leads out of it"):
        policy.check_read(str(tree / "read" / "planted.json"), "data.path")
    # A link that stays inside is fine, and the resolved path is what is kept.
    (tree / "read" / "alias.jsonl").symlink_to(tree / "read" / "ok.jsonl")
    assert policy.check_read(str(tree / "read" / "alias.jsonl")) == str(tree / "read" / "ok.jsonl")
    # Write roots are readable; read roots are not writable.
    assert policy.check_read(str(tree / "write" / "x")) == str(tree / "write" / "x")
    with pytest.raises(PathRefused, match="--allow-write"):
        policy.check_write(str(tree / "read" / "out"), "output.dir")


def test_a_directory_holding_a_link_out_is_refused(tree: Path) -> None:
    """A model directory in the root whose weights file links to someone else's."""
    model = tree / "read" / "model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "sub" / "model.safetensors").symlink_to(tree / "secret" / "secret.json")
    with pytest.raises(PathRefused, match="holds a symbolic link 'sub/model.safetensors'"):
        _policy(tree).check_read(str(model), "model.path")
    (model / "sub" / "model.safetensors").unlink()
    (model / "sub" / "model.safetensors").symlink_to(tree / "read" / "ok.jsonl")  # inside
    assert _policy(tree).check_read(str(model), "model.path") == str(model)


def test_output_is_created_private_and_never_through_a_link(tree: Path) -> None:
    policy = _policy(tree)
    out = policy.prepare_output(tree / "write" / "a" / "b")
    for d in (tree / "write" / "a", out):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    # A link planted below the root after the check: the walk down refuses it.
    (tree / "write" / "planted").symlink_to(tree / "victim")
    with pytest.raises(PathRefused, match="symbolic link"):
        policy.prepare_output(tree / "write" / "planted" / "out")
    # A directory someone else can write to could be swapped under the coordinator.
    shared = tree / "write" / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PathRefused, match="directories it owns and nobody else can write"):
        policy.prepare_output(shared / "out")
    assert list((tree / "victim").iterdir()) == []


def test_a_link_appearing_after_acceptance_is_refused(tree: Path) -> None:
    policy = _policy(tree)
    (tree / "read" / "d").mkdir()
    (tree / "read" / "d" / "data.jsonl").write_text('{"text": "x"}\n')
    spec = policy.confine_spec(
        {"data": {"path": str(tree / "read" / "d" / "data.jsonl")}, "output": {}}
    )
    policy.recheck(spec)
    # Swap the directory for a link to the secret one (same file name inside).
    (tree / "read" / "d").rename(tree / "read" / "d-old")
    (tree / "secret" / "data.jsonl").write_text(f'{{"{SECRET}": 1}}\n')
    (tree / "read" / "d").symlink_to(tree / "secret")
    with pytest.raises(PathRefused, match="now leads elsewhere|leads out"):
        policy.recheck(spec)
    with pytest.raises(OSError):  # and the open itself follows no link
        open_no_symlinks(spec["data"]["path"])


def test_confine_spec_lists_every_refused_path(tree: Path) -> None:
    with pytest.raises(JobSpecError) as err:
        _policy(tree).confine_spec(
            {
                "model": {"path": "/etc", "tokenizer": str(tree / "read")},
                "data": {"path": "/etc/shadow"},
                "output": {"dir": "/etc/roundpipe-out"},
            }
        )
    assert sorted(e.path for e in err.value.errors) == ["data.path", "model.path", "output.dir"]


# --------------------------------------------------------------------------- paths are a type

NON_PATH_STRINGS = {
    "model.architecture",
    "model.config",
    "lora.target_modules",
    "lora.base_quantization",
    "lora.int8_scales",
    "train.recompute",
    "train.optimizer_sharding",
    "train.grad_transport",
    "optimizer.kernel",
    "data.columns",
    "data.format",
    "data.text_field",
    "data.split",
    "data.loss_on",
    "data.overlong",
    "data.packing",
    "train.dtype",
    "train.loss_scale",
    "train.plan",
    "optimizer.name",
    "optimizer.no_decay",
    "optimizer.schedule",
    "optimizer.schedule_convention",
    "optimizer.state_dtype",
    "output.checkpoint_staging",
}
"""Every string field of the spec that does not name a file: a new string field must be
added here or declared read_path()/write_path() (Note [paths are a type])."""


def test_every_string_field_of_the_spec_is_a_path_or_known_not_to_be() -> None:
    unclassified = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            dotted = f"{section}.{f.name}"
            if PATH_ACCESS in f.metadata:
                assert dotted not in NON_PATH_STRINGS, dotted
            elif "str" in str(f.type) and dotted not in NON_PATH_STRINGS:
                unclassified.append(dotted)
    assert unclassified == [], (
        f"spec fields {unclassified} take strings: declare each that names a file with "
        "read_path()/write_path() in coordinator/spec/sections.py, or add it to NON_PATH_STRINGS"
    )
    # The fields the issue names, among them the one a list once forgot.
    assert {f.dotted for f in PATH_FIELDS} >= {
        "model.path",
        "model.tokenizer",
        "model.resume_from",
        "data.path",
        "data.tokenizer",
        "data.chat_template",
        "output.dir",
    }


@pytest.mark.parametrize("field", PATH_FIELDS, ids=lambda f: f.dotted)
def test_every_path_typed_field_is_refused_outside_the_roots(tree: Path, field) -> None:
    """Whatever the field, a path outside the roots is refused before anything opens it,
    with the same answer whether it exists or not."""
    (tree / "secret" / "sub").mkdir()
    messages = []
    for target in (tree / "secret" / "secret.json", tree / "secret" / "nothing-here.json"):
        with pytest.raises(JobSpecError) as err:
            _policy(tree).confine_spec({field.section: {field.key: str(target)}})
        [error] = err.value.errors
        assert error.path == field.dotted
        flag = "--allow-read" if field.access == "read" else "--allow-write"
        assert "access refused" in error.message and flag in error.message
        assert SECRET not in str(err.value)
        messages.append(str(err.value).replace(target.name, "X"))
    assert messages[0] == messages[1]
    # Inside the roots it is accepted, resolved.
    inside = tree / ("read" if field.access == "read" else "write") / "ok.jsonl"
    confined = _policy(tree).confine_spec({field.section: {field.key: str(inside)}})
    assert confined[field.section][field.key] == str(inside)


@pytest.mark.parametrize("field", PATH_FIELDS, ids=lambda f: f.dotted)
def test_every_path_field_is_made_absolute_and_relative_to_the_yaml(
    tmp_path: Path, field, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Normalisation walks the same schema: a relative path in a spec file is taken
    relative to the file, for every path field (data.chat_template was left relative)."""
    from roundpipe.coordinator.spec import jobspec

    assert getattr(SECTIONS[field.section](**{field.key: "rel/x"}), field.key) == (
        os.path.abspath("rel/x")
    )
    monkeypatch.setattr(jobspec, "_validate", lambda spec: [])  # the paths alone
    spec = JobSpec.from_dict({field.section: {field.key: "rel/x"}}, base_dir=tmp_path)
    assert getattr(getattr(spec, field.section), field.key) == str(tmp_path / "rel" / "x")


def test_ownership_outputs_and_logs_belong_to_their_owner(tree: Path) -> None:
    alice_out = str(tree / "write" / "alice-out")
    alice_job = str(tree / "write" / "jobs" / "job-a")
    owned = [OwnedDir(alice_out, "alice", "job-7f"), OwnedDir(alice_job, "alice", "job-7f")]

    def refused(spec: dict, owner: str, admin: bool = False) -> list[str]:
        try:
            check_ownership(spec, owner, admin=admin, owned=owned)
        except JobSpecError as exc:
            for e in exc.errors:  # names neither the other owner nor their job
                text = e.message.replace(repr(spec[e.path.split(".")[0]][e.path.split(".")[1]]), "")
                assert "alice" not in text and "job-7f" not in text, text
            return [e.path for e in exc.errors]
        return []

    into = {"output": {"dir": alice_out + "/sub"}}
    around = {"output": {"dir": str(tree / "write")}}
    read_ckpt = {"model": {"resume_from": alice_out}}
    read_log = {"data": {"path": alice_job + "/job.log"}, "output": {"dir": str(tree / "w2")}}
    assert refused(into, "bob") == ["output.dir"]
    assert refused(around, "bob") == ["output.dir"]
    assert refused(into, "bob", admin=True) == ["output.dir"]  # admins read, never overwrite
    assert refused(read_ckpt, "bob") == ["model.resume_from"]
    assert refused(read_log, "bob") == ["data.path"]
    assert refused(read_ckpt, "bob", admin=True) == []
    for spec in (into, around, read_ckpt, read_log):
        assert refused(spec, "alice") == []
    # A sibling whose name merely starts the same is someone else's directory.
    assert refused({"output": {"dir": alice_out + "-2"}}, "bob") == []


@pytest.mark.parametrize("chosen", [PRIVATE_MODES, GROUP_MODES], ids=["private", "group"])
def test_checkpoint_modes_come_from_the_code_not_the_umask(tmp_path: Path, chosen) -> None:
    """Under a lax umask (022, which wrote state.safetensors 0644), a checkpoint's files
    and directories get the chosen modes: 0600/0700, or 0640/0750 with --group-access."""
    saved = os.umask(0o022)
    try:
        set_modes(chosen)
        os.umask(0o022)

        def fill(d: Path) -> None:
            (d / "training_state").mkdir(mode=modes().dir)
            save_tensors(d / "training_state" / "state.safetensors", {"w": torch.zeros(3)})

        written = CheckpointDir(tmp_path / "checkpoints").write(1, fill, {"job_id": "j"})
    finally:
        set_modes(PRIVATE_MODES)
        os.umask(saved)
    entries = [tmp_path / "checkpoints", *(tmp_path / "checkpoints").rglob("*")]
    assert written / "training_state" / "state.safetensors" in entries
    for p in entries:
        expected = chosen.dir if p.is_dir() else chosen.file
        assert stat.S_IMODE(p.stat().st_mode) == expected, p


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_output_swapped_while_a_checkpoint_is_written_receives_nothing(
    tree: Path, arena_dir: Path, lora: bool
) -> None:
    """In a write root others can write to, the output directory is renamed away and a
    link put in its place after the trainer checked it, while the checkpoint's files are
    being written: they all land in the checked directory, the link's target gets
    nothing, and the next checkpoint is refused."""
    from runtime_helpers import tiny_spec

    from roundpipe.coordinator.training.job_errors import JobFailed
    from roundpipe.coordinator.training.trainer import Trainer

    (tree / "write").chmod(0o777)  # the shared write root the attack needs
    out = tree / "write" / "swapped"
    spec = tiny_spec(out, steps=2, lora={"r": 4} if lora else None)
    trainer = Trainer(
        "job-swap",
        spec,
        arena_dir=arena_dir,
        namespace="swaptest",
        output_dir=out,
        paths=PathPolicy.create([tree / "read", DEMO_DATA], [tree / "write"]),
    )

    def swap_then_write(directory: Path, *weights) -> None:
        out.rename(tree / "write" / "swapped-away")
        out.symlink_to(tree / "victim")
        write_model(directory, *weights)

    try:
        trainer.prepare(1)
        exporter = trainer.exporter  # writes the checkpoints' model files
        write_model = exporter.write_hf_model
        exporter.write_hf_model = swap_then_write  # type: ignore[method-assign]
        path = trainer.save_checkpoint(1)
        exporter.write_hf_model = write_model  # type: ignore[method-assign]
        assert path == out / "checkpoints" / "step-00000001"
        with pytest.raises(JobFailed, match="symbolic link"):
            trainer.save_checkpoint(2)
        with pytest.raises(JobFailed, match="symbolic link"):
            trainer.export()
    finally:
        trainer.close()
    assert list((tree / "victim").iterdir()) == []
    away = CheckpointDir(tree / "write" / "swapped-away" / "checkpoints")
    assert [c.step for c in away.complete("job-swap")] == [1]
    assert away.find_latest("job-swap") is not None
    if lora:
        assert (tree / "write" / "swapped-away" / "base_model" / "config.json").is_file()


def test_output_swapped_while_a_background_checkpoint_is_written_receives_nothing(
    tree: Path, arena_dir: Path
) -> None:
    """As above, with the checkpoint written in the background while training goes on
    (coordinator.snapshot): the writer thread holds the checked directory open for the
    whole write, so its files land there; the next background checkpoint is refused and
    the job fails with the reason; the link's target gets nothing."""
    from roundpipe.coordinator.training.job_errors import JobFailed
    from roundpipe.coordinator.training.trainer import Trainer

    (tree / "write").chmod(0o777)
    out = tree / "write" / "swapped-bg"
    spec = tiny_spec(out, steps=6).to_dict()
    spec["output"]["checkpoint_every"] = 1
    trainer = Trainer(
        "job-swap-bg",
        JobSpec.from_dict(spec),
        arena_dir=arena_dir,
        namespace="swapbg",
        output_dir=out,
        paths=PathPolicy.create([tree / "read", DEMO_DATA], [tree / "write"]),
    )
    writers: list[str] = []

    def swap_then_write(directory: Path, *weights) -> None:
        if not writers:  # the first checkpoint's files: swap under them
            out.rename(tree / "write" / "swapped-bg-away")
            out.symlink_to(tree / "victim")
        writers.append(threading.current_thread().name)
        write_model(directory, *weights)

    pool = None
    try:
        trainer.prepare(2)
        assert trainer.staging_bytes > 0  # written in the background
        exporter = trainer.exporter  # writes the checkpoints' model files
        write_model = exporter.write_hf_model
        exporter.write_hf_model = swap_then_write  # type: ignore[method-assign]
        pool = InProcessWorkers(trainer, 2)
        with pytest.raises(JobFailed, match="symbolic link"):
            trainer.run(pool)
    finally:
        if pool is not None:
            pool.close()
        trainer.close()
    assert writers == ["rp-checkpoints-job-swap-bg"]
    assert list((tree / "victim").iterdir()) == []
    away = CheckpointDir(tree / "write" / "swapped-bg-away" / "checkpoints")
    assert [c.step for c in away.complete("job-swap-bg")] == [1]


# --------------------------------------------------------------------------- the coordinator


@pytest.fixture(scope="module")
def confined(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Path]]:
    """A coordinator that may read below read/ and write below write/ only (the test
    session's own roots are cleared from its environment)."""
    base = tmp_path_factory.mktemp("paths")
    for name in ("read", "write", "secret", "victim"):
        (base / name).mkdir()
    arena_dir = Path("/dev/shm") / f"rp-paths-{os.getpid()}"
    arena_dir.mkdir()
    cluster = LocalCluster(
        base / "cluster",
        arena_dir,
        env={"ROUNDPIPE_ALLOW_READ": "", "ROUNDPIPE_ALLOW_WRITE": ""},
        allow_read=[base / "read"],
        allow_write=[base / "write"],
        coordinator_args=["--wait-timeout", "120"],
    )
    try:
        cluster.wait_for_workers(0)
        cluster.add_key("user", "client")  # the attacker: an ordinary authenticated user
        yield cluster, base
    finally:
        cluster.stop()
        for entry in arena_dir.iterdir():
            entry.unlink()
        arena_dir.rmdir()
        assert cluster.coordinator.proc.returncode == 0, cluster.logs()


def _submit_raw(cluster: LocalCluster, spec: dict, name: str = "user") -> Message:
    """What a hostile client sends: no local validation, any paths."""
    sock = cluster.dealer(name)
    try:
        sock.send_multipart(encode(SubmitJob(spec=spec)))
        assert sock.poll(120_000), "the coordinator did not answer"
        return decode(sock.recv_multipart())
    finally:
        sock.close()


def _spec(base: Path, **paths: str) -> dict:
    spec = tiny_spec(base / "write" / "unused", steps=2).to_dict()
    for key, value in paths.items():
        section, _, field = key.partition("__")
        spec[section][field] = value
    return spec


def _refused(cluster: LocalCluster, spec: dict, field: str, flag: str, name: str = "user") -> str:
    jobs = len(cluster.client.jobs())
    reply = _submit_raw(cluster, spec, name)
    assert isinstance(reply, ErrorReply) and reply.code == "bad_spec", reply
    assert f"{field}: access refused" in reply.message and flag in reply.message, reply.message
    assert SECRET not in reply.message
    assert len(cluster.client.jobs()) == jobs  # nothing accepted
    return reply.message


def test_coordinator_refuses_reads_outside_its_roots(confined) -> None:
    cluster, base = confined
    secret = base / "secret" / "secret.json"
    secret.write_text(f'{{"{SECRET}": "value"}}\n')
    secret.chmod(0)  # "root-only": the submitter could not read it
    # The secret JSON file as data: its keys leaked in the format error before.
    _refused(cluster, _spec(base, data__path=str(secret)), "data.path", "--allow-read")
    # /etc/shadow as plain text: it trained before.
    shadow = "/etc/shadow" if os.path.exists("/etc/shadow") else "/etc/passwd"
    spec = _spec(base, data__path=shadow, data__format="text")
    _refused(cluster, spec, "data.path", "--allow-read")
    # `..` out of the read root, and a link planted inside it that points out.
    escape = f"{base}/read/../secret/secret.json"
    _refused(cluster, _spec(base, data__path=escape), "data.path", "--allow-read")
    (base / "read" / "planted.jsonl").symlink_to(secret)
    message = _refused(
        cluster, _spec(base, data__path=str(base / "read" / "planted.jsonl")), "data.path", "--"
    )
    assert "leads out of it" in message
    # A model directory and a tokenizer outside the roots.
    _refused(cluster, _spec(base, model__tokenizer=str(base / "secret")), "model.tokenizer", "--")
    (base / "secret" / "config.json").write_text(f'{{"{SECRET}": 1}}')
    spec = _spec(base, model__path=str(base / "secret"))
    del spec["model"]["architecture"], spec["model"]["config"], spec["model"]["init_seed"]
    _refused(cluster, spec, "model.path", "--allow-read")
    _refused(
        cluster, _spec(base, model__resume_from=str(base / "secret")), "model.resume_from", "--"
    )


def test_a_chat_template_naming_the_coordinators_secret_key_is_refused(confined) -> None:
    """data.chat_template was confined by no list: any client could name the
    coordinator's own secret key and get it copied into the exported model."""
    cluster, base = confined
    secret_key = cluster.keys_dir / "coordinator.key_secret"
    secret_text = secret_key.read_text().split("secret-key")[1].split('"')[1]
    spec = _spec(base, data__chat_template=str(secret_key), output__dir=str(base / "write" / "t"))
    message = _refused(cluster, spec, "data.chat_template", "--allow-read")
    assert secret_text not in message
    assert not (base / "write" / "t").exists()


def test_outputs_and_logs_belong_to_their_owner(confined) -> None:
    """Bob may neither write into nor read from alice's job (her chosen output, her
    default output, her log); alice may reuse her own; an admin may read hers."""
    cluster, base = confined
    for name in ("alice", "bob"):
        cluster.add_key(name, "client")
    alice_out = base / "write" / "alice-model"
    reply = _submit_raw(cluster, _spec(base, output__dir=str(alice_out)), "alice")
    assert isinstance(reply, JobAccepted), reply
    default = _submit_raw(cluster, _spec(base, output__dir=None), "alice")
    assert isinstance(default, JobAccepted), default
    jobs_root = (base / "cluster" / "state" / "jobs").resolve()
    accepted = [reply.job_id, default.job_id]
    try:
        for out in (alice_out, alice_out / "sub", base / "write", jobs_root / default.job_id):
            message = _refused(cluster, _spec(base, output__dir=str(out)), "output.dir", "", "bob")
            assert "belongs to another owner" in message and "alice" not in message.replace(
                str(out), ""
            )
        bob_out = str(base / "write" / "bob-model")
        _refused(
            cluster,
            _spec(base, model__resume_from=str(alice_out), output__dir=bob_out),
            "model.resume_from",
            "",
            "bob",
        )
        log = jobs_root / default.job_id / "job.log"
        spec = _spec(base, data__path=str(log), data__format="text", output__dir=bob_out)
        _refused(cluster, spec, "data.path", "", "bob")
        # Alice may write into her own output again (a second run beside the first).
        again = _submit_raw(cluster, _spec(base, output__dir=str(alice_out)), "alice")
        assert isinstance(again, JobAccepted), again
        accepted.append(again.job_id)
        # An admin reads anyone's output (what it then finds there is another matter).
        admin = _submit_raw(
            cluster, _spec(base, model__resume_from=str(alice_out), output__dir=bob_out), "admin"
        )
        assert not (isinstance(admin, ErrorReply) and "another owner" in admin.message), admin
        if isinstance(admin, JobAccepted):
            accepted.append(admin.job_id)
    finally:
        for job_id in accepted:  # the module's later tests wait for their own jobs only
            with contextlib.suppress(RoundPipeError):  # bad_state: it has ended already
                cluster.client.cancel(job_id)


def test_coordinator_refuses_writes_outside_its_roots(confined) -> None:
    cluster, base = confined
    for out in ("/etc/roundpipe-evil", f"{base}/write/../victim/out", str(base / "read" / "out")):
        _refused(cluster, _spec(base, output__dir=out), "output.dir", "--allow-write")
        assert not Path(out).exists()
    (base / "write" / "planted").symlink_to(base / "victim")
    message = _refused(
        cluster,
        _spec(base, output__dir=str(base / "write" / "planted" / "out")),
        "output.dir",
        "--",
    )
    assert "leads out of it" in message
    assert list((base / "victim").iterdir()) == []


def test_link_planted_after_acceptance_fails_the_job_and_writes_nothing(confined) -> None:
    cluster, base = confined
    out = base / "write" / "race"
    reply = _submit_raw(cluster, _spec(base, output__dir=str(out)))
    assert isinstance(reply, JobAccepted), reply  # queued: there is no worker yet
    out.symlink_to(base / "victim")  # planted between the check and the job's start
    cluster.add_worker("w-race")
    status = cluster.client.job(reply.job_id).wait(timeout_s=120)
    assert status.state == "failed", status
    assert "access refused" in status.message and "symbolic link" in status.message
    assert list((base / "victim").iterdir()) == []


@pytest.mark.slow
def test_output_swapped_for_a_link_mid_job_stops_the_writes(confined) -> None:
    """The output directory renamed away and replaced by a link while the job runs (a
    write root others can write to): the next checkpoint is refused, nothing lands in
    the link's target."""
    cluster, base = confined
    out = base / "write" / "swapped"
    spec = _spec(base, output__dir=str(out))
    spec["train"]["steps"] = 400
    spec["output"]["checkpoint_every"] = 1
    reply = _submit_raw(cluster, spec)
    assert isinstance(reply, JobAccepted), reply
    if not cluster.workers:
        cluster.add_worker("w-swap")
    deadline = time.monotonic() + 120
    while not (out / "checkpoints" / "latest").exists():
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.05)
    out.rename(base / "write" / "swapped-away")
    out.symlink_to(base / "victim")
    status = cluster.client.job(reply.job_id).wait(timeout_s=120)
    assert status.state == "failed", status
    assert "access refused" in status.message and "symbolic link" in status.message, status
    assert list((base / "victim").iterdir()) == []


@pytest.mark.slow
def test_job_files_are_private(confined) -> None:
    cluster, base = confined
    out = base / "write" / "private"
    spec = _spec(base, output__dir=str(out))
    spec["output"]["checkpoint_every"] = 1
    reply = _submit_raw(cluster, spec)
    assert isinstance(reply, JobAccepted), reply
    cluster.add_worker("w-private")
    status = cluster.client.job(reply.job_id).wait(timeout_s=180)
    assert status.state == "succeeded", (status, cluster.logs())
    state_file = next(out.glob("checkpoints/step-*/training_state/state.safetensors"))
    job_dir = base / "cluster" / "state" / "jobs" / reply.job_id
    files = [p for p in [*out.rglob("*"), *job_dir.rglob("*")] if not p.is_dir()]
    dirs = [out, job_dir, *(p for p in [*out.rglob("*"), *job_dir.rglob("*")] if p.is_dir())]
    assert state_file in files and job_dir / "job.log" in files
    assert any(p.name.endswith(".safetensors") and p.parent == out for p in files)  # export
    wrong = [
        f"{p} {stat.S_IMODE(p.stat().st_mode):04o}"
        for p, mode in [*((f, 0o600) for f in files), *((d, 0o700) for d in dirs)]
        if stat.S_IMODE(p.stat().st_mode) != mode
    ]
    assert wrong == []
    assert stat.S_IMODE((base / "cluster" / "state" / "jobs").stat().st_mode) == 0o700


def test_shipped_demo_data_is_always_readable() -> None:
    policy = PathPolicy.for_coordinator("/nonexistent-state", environ={})
    assert policy.check_read(str(DEMO_DATA / "demo_corpus.jsonl"))
    assert policy.check_write("/nonexistent-state/jobs/j/output")
    with pytest.raises(PathRefused):
        policy.check_read("/nonexistent-state/jobs.db")
