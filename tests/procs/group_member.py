"""A coordinator's part in a data-parallel group, alone: join as ``--rank R`` of
``--world-size W`` at 127.0.0.1:PORT, print "joined" (or the GroupError), then stay in
the group until stdin closes. tests/test_multinode.py starts several."""

from __future__ import annotations

import argparse
import sys

from roundpipe.coordinator.training.multinode import GroupError, GroupSettings, NodeGroup


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    settings = GroupSettings(
        host="127.0.0.1", port=args.port, rank=args.rank, world_size=args.world_size, timeout_s=60
    )
    try:
        NodeGroup.join(settings)
    except GroupError as exc:
        print(f"refused: {exc}", flush=True)
        return 3
    print("joined", flush=True)
    sys.stdin.read()  # until the test closes it
    return 0


if __name__ == "__main__":
    sys.exit(main())
