"""Two (or more) coordinators on this machine forming one data-parallel group over
loopback (gloo), each a LocalCluster with its own CPU workers, state and keys."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path

from roundpipe.cluster import LocalCluster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_args(port: int, rank: int, world_size: int, timeout_s: float) -> list[str]:
    return [
        "--dist-init",
        f"tcp://127.0.0.1:{port}",
        "--rank",
        str(rank),
        "--world-size",
        str(world_size),
        "--dist-timeout",
        str(timeout_s),
    ]


@contextlib.contextmanager
def node_group(
    root: Path,
    name: str,
    *,
    num_nodes: int = 2,
    workers_per_node: int | Sequence[int] = 1,
    timeout_s: float = 60.0,
    extra_args: Sequence[str] = ("--wait-timeout", "120"),
    check_exit: bool = True,
    faults: dict[int, str] | None = None,
) -> Iterator[list[LocalCluster]]:
    """``num_nodes`` coordinators (rank i is element i), each with ``workers_per_node``
    CPU workers (or a count per rank; ``faults``: rank -> ROUNDPIPE_FAULT for its first
    worker); stopped afterwards (rank 0 last: it hosts the group's store)."""
    port = free_port()
    nodes: list[LocalCluster] = []
    arena_dirs = []
    try:
        for rank in range(num_nodes):
            arena_dir = Path("/dev/shm") / f"rp-{name}-{os.getpid()}-{rank}"
            arena_dir.mkdir()
            arena_dirs.append(arena_dir)
            nodes.append(
                LocalCluster(
                    root / f"node{rank}",
                    arena_dir,
                    coordinator_args=[
                        *group_args(port, rank, num_nodes, timeout_s),
                        *extra_args,
                    ],
                )
            )
        counts = (
            [workers_per_node] * num_nodes
            if isinstance(workers_per_node, int)
            else list(workers_per_node)
        )
        for rank, node in enumerate(nodes):
            for i in range(counts[rank]):
                fault = (faults or {}).get(rank) if i == 0 else None
                node.add_worker(f"n{rank}w{i + 1}", fault=fault)
        for node, count in zip(nodes, counts):
            node.wait_for_workers(count)
        yield nodes
    finally:
        for node in reversed(nodes[1:]):
            node.stop()
        if nodes:
            nodes[0].stop()
        for arena_dir in arena_dirs:
            shutil.rmtree(arena_dir, ignore_errors=True)
    if check_exit:
        for node in nodes:
            assert node.coordinator.proc.returncode == 0, node.logs()
