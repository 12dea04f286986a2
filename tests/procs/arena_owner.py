"""A coordinator's arena side only: `python arena_owner.py ROOT NAMESPACE`.

Makes its private arena directory in ROOT (``prepare_arena_dir``) and one arena in it,
prints the directory and the arena's path (one a line), then sleeps, to be killed.
"""

import sys
import time

from roundpipe.shared.arena import Arena, prepare_arena_dir


def main() -> None:
    space = prepare_arena_dir(sys.argv[1], sys.argv[2])
    arena = Arena.create("params", 1 << 16, directory=space.path, namespace=sys.argv[2])
    print(space.path, flush=True)
    print(arena.path, flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
