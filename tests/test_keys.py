"""`roundpipe keys` and roundpipe.shared.keys: key files, modes, roles, and the errors a
user sees for a wrong name, role or path."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from roundpipe import cli
from roundpipe.shared.keys import (
    KeyFileError,
    add_key,
    authorized_keys,
    connect_keys,
    coordinator_key_pair,
    init_keys,
)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_commands_make_authorise_list_and_remove(tmp_path: Path, capsys) -> None:
    keys = tmp_path / "keys"
    assert cli.main(["keys", "init", "--keys-dir", str(keys)]) == 0
    assert _mode(keys / "coordinator.key_secret") == 0o600
    assert _mode(keys / "coordinator.key") == 0o644
    assert _mode(keys) == 0o750
    # A user's own pair, authorised by its public half only.
    assert cli.main(["keys", "new", "--out", str(tmp_path / "alice")]) == 0
    assert _mode(tmp_path / "alice" / "client.key_secret") == 0o600
    public = tmp_path / "alice" / "client.key"
    assert (
        cli.main(
            ["keys", "add", "alice", "--role", "client", "--public-key", str(public)]
            + ["--keys-dir", str(keys)]
        )
        == 0
    )
    add_ops = ["keys", "add", "ops", "--role", "admin", "--keys-dir", str(keys)]
    assert cli.main([*add_ops, "--out", str(tmp_path)]) == 0
    assert _mode(tmp_path / "ops.key_secret") == 0o600
    capsys.readouterr()
    assert cli.main([*add_ops, "--out", str(tmp_path / "elsewhere")]) == 1
    assert "authorised already" in capsys.readouterr().err
    (keys / "authorized" / "junk.key").write_text("not a key\n")
    assert cli.main(["keys", "list", "--keys-dir", str(keys)]) == 0
    out, err = capsys.readouterr()
    rows = [line.split()[:2] for line in out.splitlines()[1:]]
    assert rows == [["alice", "client"], ["ops", "admin"], ["worker", "worker"]]
    assert "junk.key is ignored" in err
    assert cli.main(["keys", "remove", "alice", "--keys-dir", str(keys)]) == 0
    assert [k.name for k in authorized_keys(keys)] == ["ops", "worker"]
    assert cli.main(["keys", "remove", "alice", "--keys-dir", str(keys)]) == 1


def test_bad_names_roles_and_a_second_init_are_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    init_keys(keys)
    before = coordinator_key_pair(keys)
    with pytest.raises(KeyFileError, match="already holds a coordinator key"):
        init_keys(keys)
    assert coordinator_key_pair(keys) == before
    for name in ("../evil", ".hidden", "coordinator", "", "a b", "x" * 65, "evil\n"):
        with pytest.raises(KeyFileError, match="invalid key name"):
            add_key(keys, name, "client", out_dir=tmp_path)
    with pytest.raises(KeyFileError, match="invalid role"):
        add_key(keys, "eve", "root", out_dir=tmp_path)
    with pytest.raises(KeyFileError, match="keys init"):
        add_key(tmp_path / "nowhere", "eve", "client", out_dir=tmp_path)
    with pytest.raises(KeyFileError, match="is not a public key"):
        bad = tmp_path / "bad.key"
        bad.write_text("hello\n")
        add_key(keys, "eve", "client", public_key=bad)


def test_keys_list_of_a_directory_that_is_not_a_key_directory_says_so(
    tmp_path: Path, capsys
) -> None:
    """A wrong --keys-dir printed "no authorised keys" and exit 0: an operator who forgot
    the option was told nobody is authorised."""
    assert cli.main(["keys", "list", "--keys-dir", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert "authorized does not exist" in err and "keys init" in err


def test_connect_keys_say_what_is_missing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    for name in ("ROUNDPIPE_KEY", "ROUNDPIPE_COORDINATOR_KEY", "ROUNDPIPE_KEYS_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ROUNDPIPE_STATE_DIR", str(tmp_path / "state"))
    assert connect_keys() is None  # nothing configured: no CURVE
    with pytest.raises(KeyFileError, match="does not exist"):
        connect_keys(tmp_path / "missing.key_secret")
    keys = tmp_path / "keys"
    init_keys(keys)
    secret = add_key(keys, "bob", "client", out_dir=tmp_path)
    with pytest.raises(KeyFileError, match="no coordinator public key"):
        connect_keys(secret)
    with pytest.raises(KeyFileError, match="is not a key pair"):
        connect_keys(keys / "coordinator.key", keys / "coordinator.key")
    found = connect_keys(secret, keys / "coordinator.key")
    assert found is not None and found.server_key == coordinator_key_pair(keys)[0]


def test_a_key_path_that_is_no_key_file_is_refused_at_once(tmp_path: Path) -> None:
    """`--key /dev/zero` filled memory and a FIFO blocked forever (the coordinator, too,
    re-reading an authorized/ directory that held one): anything but a small regular
    file is refused before it is read, naming what it is."""
    import os
    import subprocess
    import sys
    import threading

    fifo = tmp_path / "pipe.key_secret"
    os.mkfifo(fifo)
    for path, said in [("/dev/zero", "is not a regular file"), (fifo, "is not a regular file")]:
        done = subprocess.run(
            [sys.executable, "-m", "roundpipe.cli", "jobs", "--key", str(path)]
            + ["--address", f"ipc://{tmp_path}/none.sock"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and said in done.stderr, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
    big = tmp_path / "big.key_secret"
    big.write_bytes(b"#" * (1 << 20))
    with pytest.raises(KeyFileError, match="not a key file"):
        connect_keys(big)
    # A /proc file is regular and says it is empty, yet reads on and on.
    with pytest.raises(KeyFileError, match="not a key file"):
        connect_keys("/proc/self/pagemap")
    keys = tmp_path / "keys"
    init_keys(keys)
    add_key(keys, "bob", "client", out_dir=tmp_path)
    os.mkfifo(keys / "authorized" / "eve.key")
    found: list = []
    reader = threading.Thread(target=lambda: found.extend(authorized_keys(keys)), daemon=True)
    reader.start()
    reader.join(timeout=60)
    assert not reader.is_alive(), "reading authorized/ blocked on a FIFO"
    names = [k.name for k in found]
    assert "bob" in names and "eve" not in names, names
