"""Every ``roundpipe`` verb given bad input says what is wrong in one message on stderr
(never a traceback) and exits non-zero: a spec whose relative paths do not resolve, a
missing or malformed spec, a bad argument, a path that cannot be written, a coordinator
that is not running, a job id the (real) coordinator does not know.

Each case runs the installed ``roundpipe`` executable, as a user would.
"""

from __future__ import annotations

import copy
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from roundpipe.cluster import LocalCluster
from roundpipe.coordinator.spec.jobspec import JobSpec

ROUNDPIPE = str(Path(sys.executable).with_name("roundpipe"))
DEMO_SPEC = Path(__file__).resolve().parent.parent / "roundpipe" / "demo_data" / "demo_job.yaml"

# What stderr holds: "line" one line; "last" progress lines, then the one error line;
# "spec" the error line then one line per problem of the spec; "usage" argparse's usage
# lines then the error line.
LINE, LAST, SPEC, USAGE = "line", "last", "spec", "usage"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def roundpipe(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [ROUNDPIPE, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ROUNDPIPE_ADDRESS": f"tcp://127.0.0.1:{_free_port()}", **(env or {})},
    )


def assert_user_error(
    result: subprocess.CompletedProcess, status: int, shape: str, *needles: str
) -> None:
    """Exit ``status``, a clear message of ``shape`` naming every needle, no traceback."""
    shown = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == status, shown
    assert "Traceback" not in result.stdout + result.stderr, shown
    lines = result.stderr.rstrip("\n").splitlines()
    assert lines, shown
    if shape in (LINE, LAST):
        assert len(lines) == 1 or shape == LAST, shown
        assert [line for line in lines if ": error: " in line] == lines[-1:], shown
        assert lines[-1].startswith("roundpipe"), shown
    elif shape == SPEC:
        assert lines[0].startswith("roundpipe") and ": error: invalid job spec" in lines[0], shown
        assert lines[1].startswith("  - "), shown
    else:
        assert lines[0].startswith("usage: "), shown
        assert lines[-1].startswith("roundpipe") and ": error: " in lines[-1], shown
    for needle in needles:
        assert needle in result.stderr, shown


@pytest.fixture
def specs(tmp_path: Path) -> dict[str, Path]:
    """Spec files that are wrong in different ways (and the demo's valid one)."""
    text = DEMO_SPEC.read_text()
    unresolved = tmp_path / "unresolved.yaml"  # the demo spec moved away from its files
    unresolved.write_text(text)
    malformed = tmp_path / "malformed.yaml"
    malformed.write_text("model: [unclosed\n  x: :\n")
    not_a_mapping = tmp_path / "list.yaml"
    not_a_mapping.write_text("- 1\n")
    return {
        "unresolved": unresolved,
        "missing": tmp_path / "missing.yaml",
        "malformed": malformed,
        "list": not_a_mapping,
        "valid": DEMO_SPEC,
    }


@pytest.mark.parametrize("verb", [["chaos"], ["submit"], ["data", "inspect"]])
def test_bad_spec_files(verb: list[str], specs: dict[str, Path]) -> None:
    """A spec whose relative paths do not resolve (the chaos traceback this file was
    written for), a missing, a malformed and a non-mapping spec: exit 2, the problems."""
    prefix = f"roundpipe {' '.join(verb)}" if verb != ["submit"] else "roundpipe"
    result = roundpipe(*verb, str(specs["unresolved"]))
    assert_user_error(result, 2, SPEC, "data.path: data file", "does not exist", "tokenizer")
    assert result.stderr.startswith(f"{prefix}: error: ")
    assert_user_error(roundpipe(*verb, str(specs["missing"])), 2, SPEC, "cannot read job spec")
    assert_user_error(roundpipe(*verb, str(specs["malformed"])), 2, SPEC, "not valid YAML")
    assert_user_error(roundpipe(*verb, str(specs["list"])), 2, SPEC, "expected a mapping")
    assert_user_error(roundpipe(*verb, str(specs["list"].parent)), 2, SPEC, "Is a directory")


def test_numbers_past_64_bits_are_spec_errors(tmp_path: Path) -> None:
    """An integer the protocol (msgpack) cannot carry passed validation and `roundpipe
    submit` died with a traceback as it encoded the request: it is a spec problem
    naming its field (validation's, where the field is an integer; else the client's,
    before anything is sent)."""
    good = yaml.safe_load(DEMO_SPEC.read_text())
    good["model"]["tokenizer"] = str(DEMO_SPEC.parent / good["model"]["tokenizer"])
    good["data"]["path"] = str(DEMO_SPEC.parent / good["data"]["path"])
    for section, key, needles in (
        ("output", "keep_last", ["output.keep_last", "within 64 bits"]),
        ("optimizer", "grad_clip", ["optimizer.grad_clip", "cannot be sent", "smaller value"]),
    ):
        d = copy.deepcopy(good)
        d.setdefault(section, {})[key] = 2**64
        spec_file = tmp_path / f"{key}.yaml"
        spec_file.write_text(yaml.safe_dump(d))
        assert_user_error(roundpipe("submit", str(spec_file)), 2, SPEC, *needles)
    # What msgpack carries is fine: a seed of 64 random bits.
    good["train"]["seed"] = 2**64 - 1
    JobSpec.from_dict(good)


def test_demo_bad_spec(specs: dict[str, Path]) -> None:
    for name, needle in (("missing", "cannot read job spec"), ("malformed", "not valid YAML")):
        result = roundpipe("demo", "--spec", str(specs[name]))
        assert_user_error(result, 2, SPEC, needle)


def test_chaos_bad_arguments(specs: dict[str, Path], tmp_path: Path) -> None:
    """Arguments the harness used to pass on to its workers (which then never came up,
    and the run hung) or trip over later: refused at once."""
    valid = str(specs["valid"])
    for argv, needle in (
        (["--workers", "0"], "argument --workers: expected an integer >= 1, got '0'"),
        (["--trials", "-1"], "argument --trials"),
        (["--coordinator-kills", "x"], "argument --coordinator-kills"),
        (["--point", "bogus"], "argument --point: ROUNDPIPE_FAULT: action 'bogus'"),
        (["--point", "kill@when=never"], "when= must be"),
        (["--emulate-pcie", "fast"], "cannot read --emulate-pcie 'fast'"),
        (["--emulate-pcie", "0"], "expected a positive bandwidth"),
    ):
        assert_user_error(roundpipe("chaos", valid, *argv), 2, USAGE, needle)
    assert_user_error(roundpipe("chaos"), 2, USAGE, "required: spec")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = roundpipe("chaos", valid, "--workdir", str(blocker / "work"), "--trials", "1")
    assert_user_error(result, 1, LINE, f"cannot create directory '{blocker / 'work'}'")
    assert "chaos: seed" not in result.stdout  # nothing started


def test_unwritable_output_paths(tmp_path: Path) -> None:
    """A path the command must write under a regular file: one line naming it (the
    central OSError handler of roundpipe.cli)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    png = blocker / "t.png"
    result = roundpipe(
        "plan", "--architecture", "llama", "--set", "num_hidden_layers=2", "--set",
        "hidden_size=64", "--set", "intermediate_size=128", "--set", "num_attention_heads=4",
        "--set", "num_key_value_heads=4", "--set", "vocab_size=128",
        "--workers", "2", "--seq-len", "32", "--timeline", str(png),
    )  # fmt: skip
    assert_user_error(result, 1, LINE, f"'{png}': Not a directory")
    result = roundpipe("demo", "--cpu", "--workers", "1", "--output", str(blocker / "out"))
    assert_user_error(result, 1, LAST, str(blocker / "out"), "Not a directory")
    result = roundpipe("plan", "--model-config", str(tmp_path / "none.json"), "--workers", "2",
                       "--seq-len", "32")  # fmt: skip
    assert_user_error(result, 2, LINE, "cannot read model config")
    (tmp_path / "list.json").write_text("[1]")
    result = roundpipe("plan", "--model-config", str(tmp_path / "list.json"), "--workers", "2",
                       "--seq-len", "32")  # fmt: skip
    assert_user_error(result, 2, LINE, "holds a JSON list, not an object")
    # A misspelt --set key: refused as a job spec's model.config refuses it (it priced
    # the default 28-layer model).
    result = roundpipe("plan", "--architecture", "qwen3", "--set", "num_hidden_layer=2",
                       "--workers", "2", "--seq-len", "32")  # fmt: skip
    assert_user_error(
        result, 2, LINE, "--set num_hidden_layer: unknown Qwen3Config field (did you mean "
        "'num_hidden_layers'?)"
    )  # fmt: skip


def test_no_coordinator_running() -> None:
    """Every verb that talks to a coordinator, with none there: exit 1, one line."""
    for argv in (["status", "job-x"], ["jobs"], ["workers"], ["cancel", "job-x"],
                 ["resume", "job-x"], ["logs", "job-x"], ["timeline", "job-x"]):  # fmt: skip
        result = roundpipe(*argv, "--timeout", "0.3")
        assert_user_error(result, 1, LINE, "no reply from the RoundPipe coordinator")
    result = roundpipe("status", "job-x", "--address", "nonsense")
    assert_user_error(result, 2, LINE, "invalid coordinator address 'nonsense'")


def test_an_empty_job_id_is_a_usage_error() -> None:
    """``J=$(roundpipe submit bad.yaml); roundpipe status "$J"``: an empty job id failed
    with a traceback (the request refused it), in every verb that takes one."""
    for verb in ("status", "cancel", "resume", "logs", "timeline"):
        result = roundpipe(verb, "", "--timeout", "0.3")
        assert_user_error(result, 2, USAGE, "a job id is not empty")


def test_output_that_cannot_be_written_is_named() -> None:
    """``roundpipe data inspect SPEC > /dev/full`` (as ``roundpipe logs JOB > job.log``
    on a full disk): exit 1 naming the output, not a traceback."""
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [ROUNDPIPE, "data", "inspect", str(DEMO_SPEC)],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    result.stdout = ""
    assert_user_error(result, 1, LINE, "cannot write the output: No space left on device")


def test_the_daemons_check_their_address_as_the_client_does(tmp_path: Path) -> None:
    """A worker given a malformed coordinator address died with ZeroMQ's traceback
    ("Invalid argument"), and port 99999 was taken as 34463 by every program; each now
    refuses it as a usage error naming what is wrong."""
    bin_dir = Path(sys.executable).parent
    cases = [
        ([str(bin_dir / "roundpipe-worker"), "--cpu", "--coordinator", "foo"], "'foo'"),
        (
            [str(bin_dir / "roundpipe-coordinator"), "--state-dir", str(tmp_path)]
            + ["--address", "tcp://127.0.0.1:99999"],
            "its port '99999' is not a number from 1 to 65535",
        ),
        ([ROUNDPIPE, "jobs", "--address", "tcp://127.0.0.1:99999"], "its port '99999'"),
        # (to bind, the coordinator's; a worker that connected to it died of a traceback)
        ([str(bin_dir / "roundpipe-worker"), "--cpu", "--coordinator", "tcp://*:7420"], "'*'"),
    ]
    for argv, needle in cases:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        shape = LINE if argv[0] == ROUNDPIPE else USAGE
        assert_user_error(result, 2, shape, "invalid", needle)
    assert not list(tmp_path.iterdir())  # the coordinator stopped before anything


def test_addresses_are_checked_as_zeromq_takes_them() -> None:
    from roundpipe.shared.defaults import endpoint_problem

    for good in ("tcp://127.0.0.1:7420", "tcp://[::1]:7420", "tcp://eth0:1", "ipc://x.sock"):
        assert endpoint_problem(good) is None, good
    assert endpoint_problem("tcp://*:7420", connect=False) is None  # to bind
    for bad in ("tcp://*:7420", "tcp://h:\u00b2", "tcp://h:\u0667\u0664", "tcp://h:0", "foo"):
        assert endpoint_problem(bad) is not None, bad  # never raises


def test_output_that_failed_leaves_the_callers_stdout(tmp_path: Path, monkeypatch) -> None:
    """In one process (tests, a program calling main()): after output failed, the
    caller's standard output is its own again (it was left pointing at /dev/null)."""
    from roundpipe.cli import main

    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)
        assert main(["keys", "new", "--out", str(tmp_path / "k1")]) == 1
        assert sys.stdout is full


def test_local_files_that_are_not_there(tmp_path: Path) -> None:
    result = roundpipe("logs", "job-x", "--state-dir", str(tmp_path / "nowhere"))
    assert_user_error(result, 1, LINE, "no log for job job-x")
    result = roundpipe("logs", "../job-x", "--state-dir", str(tmp_path))
    assert_user_error(result, 2, LINE, "invalid job id '../job-x'")
    result = roundpipe("timeline", str(tmp_path))  # a directory: read as an output dir
    assert_user_error(result, 1, LINE, "no timeline trace")
    result = roundpipe("timeline", str(tmp_path), "--steps", "x")
    assert_user_error(result, 2, LINE, "--steps 'x'")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A real coordinator (no workers: nothing here runs a job)."""
    root = tmp_path_factory.mktemp("cli-errors")
    arena = Path(f"/dev/shm/rp-cli-errors-{os.getpid()}")
    arena.mkdir()
    c = LocalCluster(root, arena)
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(arena, ignore_errors=True)


def test_unknown_job_id(cluster: LocalCluster) -> None:
    """Verbs naming a job the coordinator does not know: exit 1, one line naming it."""
    env = {"ROUNDPIPE_ADDRESS": cluster.address, **cluster.key_env("admin")}
    for argv in (["status", "job-nope"], ["cancel", "job-nope"], ["resume", "job-nope"],
                 ["logs", "job-nope"], ["timeline", "job-nope"]):  # fmt: skip
        assert_user_error(roundpipe(*argv, env=env), 1, LINE, "unknown job 'job-nope'")
    assert roundpipe("jobs", env=env).returncode == 0  # the same connection works


def test_demo_stop_counts_only_real_problems(tmp_path: Path) -> None:
    """A Ctrl-C while the daemons still start: the demo's own SIGTERM ends them before
    their handlers are set (status -15), which was then printed as an error."""

    from roundpipe import demo

    starting = subprocess.Popen(["sleep", "60"])  # SIGTERM's default action: -15
    crashed = subprocess.Popen(["sh", "-c", "exit 3"])
    crashed.wait()
    daemons = [
        demo._Daemon("w0", starting, tmp_path / "w0.log"),
        demo._Daemon("w1", crashed, tmp_path / "w1.log"),
    ]
    assert demo._stop(daemons, grace_s=30) == ["w1 exited with status 3"]
    assert starting.returncode == -15
