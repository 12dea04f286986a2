"""Child process for the shared-memory tests: run as `python shm_child.py ROLE ARGS...`.

Roles:
  owner DIR NS                 create an arena, print its path, then sleep (to be killed)
  attach_write PATH            attach, fill data with 7s, print "ready", then sleep
  consumer PATH N SLOTS WORDS  event-table hand-off consumer (see test_events.py)
  producer PATH N SLOTS WORDS  event-table hand-off producer
  waker PATH N                 N times: wait for ping counter, sleep a little, stamp, signal
"""

import sys
import time

import torch

from roundpipe.shared.arena import DATA_START, Arena
from roundpipe.shared.events import EventTable

# Layout used by the hand-off roles: event table at DATA_START (64 counters), payload
# slots after it. Counter 0: produced sequence; counter 1: consumed sequence.
TABLE_OFFSET = DATA_START
PAYLOAD_OFFSET = DATA_START + 4096


def payload(arena: Arena, slots: int, words: int) -> torch.Tensor:
    return arena.view(arena.ref(PAYLOAD_OFFSET, torch.int64, (slots, words)))


def main() -> None:
    role = sys.argv[1]
    if role == "owner":
        arena = Arena.create("victim", 1 << 16, directory=sys.argv[2], namespace=sys.argv[3])
        print(arena.path, flush=True)
        time.sleep(600)
    elif role == "attach_write":
        arena = Arena.attach(sys.argv[2])
        arena.view(arena.ref(DATA_START, torch.uint8, (4096,))).fill_(7)
        print("ready", flush=True)
        time.sleep(600)
    elif role in ("producer", "consumer"):
        n, slots, words = (int(x) for x in sys.argv[3:6])
        arena = Arena.attach(sys.argv[2])
        table = EventTable(arena, TABLE_OFFSET)
        data = payload(arena, slots, words)
        if role == "producer":
            for i in range(1, n + 1):
                # Do not overwrite a slot before the consumer has read it.
                table.wait_at_least(1, i - slots, timeout_s=30)
                row = data[i % slots]
                row.fill_(i)
                row[0] = -i  # first and last words differ: a torn read shows up as a mix
                table.signal(0, i)
        else:
            bad = 0
            for i in range(1, n + 1):
                table.wait_at_least(0, i, timeout_s=30)
                row = data[i % slots]
                if int(row[0]) != -i or not bool((row[1:] == i).all()):
                    bad += 1
                table.signal(1, i)
            print(f"bad={bad}", flush=True)
    elif role == "waker":
        n = int(sys.argv[3])
        arena = Arena.attach(sys.argv[2])
        table = EventTable(arena, TABLE_OFFSET)
        stamps = arena.view(arena.ref(PAYLOAD_OFFSET, torch.float64, (n,)))
        for i in range(1, n + 1):
            table.wait_at_least(2, i, timeout_s=30)  # parent is ready to wait
            time.sleep(0.002)  # let the parent fall asleep in its wait
            stamps[i - 1] = time.perf_counter()
            table.signal(0, i)
    else:
        raise SystemExit(f"unknown role {role}")


if __name__ == "__main__":
    main()
