"""CUDA producer for tests/test_cuda.py: `python cuda_handoff_child.py ARENA_PATH`.

A CudaEngine downloads a payload whose compute is delayed by ~1 s of GPU sleep, with an
activation hand-off: ticket and counter at issue (before the bytes are there), landed
mark once they are. A consumer must wait on the ticket's interprocess event.
"""

import sys

import torch

from roundpipe.shared.arena import DATA_START, Arena
from roundpipe.shared.events import Counters, EventTable
from roundpipe.shared.handoff import HandoffBoard
from roundpipe.worker.transfer import CudaEngine, Priority

COUNTERS = Counters(num_layers=2, num_microbatches=1)
COUNTER = COUNTERS.act(1, 0)
DONE = COUNTERS.wgrad(0)  # the consumer stores it when it no longer needs this process
WORDS = 1 << 20


def payload_offset() -> int:
    from roundpipe.shared.handoff import events_arena_nbytes

    return DATA_START + (events_arena_nbytes(COUNTERS) + 4095) // 4096 * 4096


def main() -> None:
    arena = Arena.attach(sys.argv[1])
    table = EventTable(arena, DATA_START)
    board = HandoffBoard(table, COUNTERS)
    engine = CudaEngine(torch.device("cuda", 0))
    engine.register([arena])
    payload = arena.view(arena.ref(payload_offset(), torch.float32, (WORDS,)))
    source = torch.full((WORDS,), 42.0, device="cuda")
    torch.cuda._sleep(2_000_000_000)  # ~1 s of "compute" before the output exists
    result = source * 1.0

    def issued(mark) -> None:
        board.write_ticket(COUNTER, 1, mark)
        table.signal(COUNTER, 1)

    copy = engine.download(
        [(result, payload)],
        Priority.ACTIVATION,
        then=lambda: board.mark_landed(COUNTER, 1),
        on_issue=issued,
    )
    copy.wait(120)
    print("landed", flush=True)
    table.wait_at_least(DONE, 1, 120)  # keep the exported events alive while in use
    engine.unregister([arena])
    engine.close()


if __name__ == "__main__":
    main()
