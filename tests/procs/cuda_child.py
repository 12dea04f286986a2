"""CUDA producer for tests/test_cuda.py: `python cuda_child.py ARENA_PATH`.

Publishes an interprocess event ring, then writes a payload into the arena with an
asynchronous device-to-host copy that a GPU sleep delays, records the event, and signals
the counters *without* synchronising the host. A consumer that reads the payload without
waiting on the event would see stale bytes. It exits once the consumer signals slot 2.
"""

import sys

import torch

from roundpipe.shared.arena import DATA_START, Arena
from roundpipe.shared.events import EventTable
from roundpipe.worker.cuda import CudaEventRing, EventHandleBoard, pin_arena

TABLE_OFFSET = DATA_START
BOARD_OFFSET = DATA_START + 1024
PAYLOAD_OFFSET = DATA_START + 8192
WORDS = 1 << 20


def main() -> None:
    arena = Arena.attach(sys.argv[1])
    pin_arena(arena)
    table = EventTable(arena, TABLE_OFFSET)
    board = EventHandleBoard(arena, BOARD_OFFSET, num_producers=1, ring_size=4)
    ring = CudaEventRing(0, size=4)
    board.publish(0, ring.handles)
    payload = arena.view(arena.ref(PAYLOAD_OFFSET, torch.float32, (WORDS,)))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        source = torch.full((WORDS,), 42.0, device="cuda")
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time before the copy starts
        payload.copy_(source, non_blocking=True)
        slot = ring.record(stream)
    table.signal(1, slot + 1)  # which slot holds the record (+1: 0 means "none yet")
    table.signal(0, 1)
    print("signalled", flush=True)
    stream.synchronize()
    # Keep the event's process alive until the consumer says it is done with it (slot
    # 2): an event whose exporter has exited is another case (issue 32 measures it).
    table.wait_at_least(2, 1, timeout_s=300)


if __name__ == "__main__":
    main()
