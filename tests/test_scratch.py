"""roundpipe.scratch.work_dir: a one-off run's directory is removed when the run succeeds,
kept (and named on stderr) when it fails, and never removed when the user named it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from roundpipe.scratch import work_dir


def test_a_temporary_directory_goes_when_the_run_succeeds(tmp_path: Path) -> None:
    with work_dir("rp-x-", parent=tmp_path) as root:
        (root / "daemon.log").write_text("fine")
        assert root.parent == tmp_path and root.name.startswith("rp-x-")
    assert not root.exists()
    with pytest.raises(SystemExit), work_dir("rp-x-", parent=tmp_path) as root:
        sys.exit(0)  # a clean exit is a success
    assert not root.exists()


@pytest.mark.parametrize("failure", [RuntimeError("boom"), SystemExit(1), KeyboardInterrupt()])
def test_a_failed_run_keeps_its_directory_and_says_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], failure: BaseException
) -> None:
    with pytest.raises(type(failure)), work_dir("rp-x-", parent=tmp_path) as root:
        (root / "daemon.log").write_text("why it failed")
        raise failure
    assert (root / "daemon.log").read_text() == "why it failed"
    assert f"kept in {root}" in capsys.readouterr().err


def test_a_directory_the_user_named_is_made_and_never_removed(tmp_path: Path) -> None:
    named = tmp_path / "mine" / "work"
    with work_dir("rp-x-", named) as root:
        assert root == named and root.is_dir()
    assert named.is_dir()
    with pytest.raises(RuntimeError), work_dir("rp-x-", named):
        raise RuntimeError("boom")
    assert named.is_dir()


def test_a_run_that_failed_before_writing_anything_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A usage error (argparse's exit 2) inside the block: the directory is empty, so
    there is nothing to keep."""
    with pytest.raises(SystemExit), work_dir("rp-x-", parent=tmp_path):
        sys.exit(2)
    assert list(tmp_path.iterdir()) == [] and capsys.readouterr().err == ""
