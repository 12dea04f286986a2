"""Sharded optimizer state (roundpipe.coordinator.training.sharded_optimizer): the shard
boundaries, the rank-major buffers, and a step over pieces that is bitwise the step over
whole tensors (Note [shard boundaries]). The group's end-to-end runs are in
tests/test_multinode_sharded.py."""

from __future__ import annotations

import pytest
import torch

from roundpipe.coordinator.training.optimizer import LayerwiseOptimizer, LRSchedule
from roundpipe.coordinator.training.sharded_optimizer import (
    ALIGN,
    ZeroShards,
    bucket_name,
    bucket_text,
    gradient_buckets,
    piece,
    span,
)

# Sizes around the alignment and the kernels' 16-element tails; one tiny tensor that
# the last ranks own nothing of.
SIZES = {"a.weight": (37, 29), "b.weight": (4097,), "norm.weight": (64,), "c.bias": (1,)}


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_pieces_cover_every_element_once_on_aligned_starts(world_size: int) -> None:
    for numel in (1, 15, 16, 255, 256, 257, 1000, 4097, 100_000):
        ranges = [piece(numel, r, world_size) for r in range(world_size)]
        assert ranges[0][0] == 0 and ranges[-1][1] == numel
        for (_, hi), (lo, _) in zip(ranges, ranges[1:]):
            assert hi == lo  # contiguous, in rank order
        for lo, hi in ranges:
            assert lo % ALIGN == 0 or lo == numel
            assert hi - lo <= span(numel, world_size)
            assert (hi - lo) % ALIGN == 0 or hi == numel  # a short piece ends the tensor


def test_rank_major_buffers_round_trip() -> None:
    """Packing every rank's pieces and unpacking them gives the tensors back; a single
    chunk carries one rank's pieces; padding is never read back."""
    torch.manual_seed(0)
    tensors = [torch.randn(s) for s in SIZES.values()]
    for w in (2, 3):
        shards = [ZeroShards(None, r, w, "float32") for r in range(w)]
        chunk = shards[0].chunk_numel(tensors)
        flat = torch.full((w * chunk,), float("nan"))
        shards[0].pack(tensors, flat, range(w))
        back = [torch.zeros_like(t) for t in tensors]
        shards[0].unpack(flat, back, range(w))
        assert all(torch.equal(a, b) for a, b in zip(tensors, back))
        for r, sh in enumerate(shards):
            mine = torch.zeros(chunk)
            sh.pack(tensors, mine, [r])
            assert torch.equal(mine, flat[r * chunk : (r + 1) * chunk].nan_to_num(0.0))


def _optimizer(masters, kernel: str, algorithm: str) -> LayerwiseOptimizer:
    return LayerwiseOptimizer(
        masters,
        schedule=LRSchedule(lr=3e-3, schedule="cosine", warmup_steps=1, total_steps=5),
        weight_decay=0.1,
        no_decay=("bias", "norm"),
        kernel=kernel,
        algorithm=algorithm,
        momentum=0.9 if algorithm == "sgd" else 0.0,
        threads=2,
    )


@pytest.mark.parametrize(
    "kernel,algorithm", [("auto", "adamw"), ("torch", "adamw"), ("torch", "sgd")]
)
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_step_over_pieces_is_bitwise_the_whole_step(
    kernel: str, algorithm: str, world_size: int
) -> None:
    """W optimizers, each over its pieces of the masters, fed the pieces of the same
    gradients, write bitwise the masters and bf16 weights of one optimizer over the
    whole tensors, step after step."""
    torch.manual_seed(1)
    whole = {0: {n: torch.randn(s) for n, s in SIZES.items()}, 1: {"d.weight": torch.randn(300)}}
    shards = [ZeroShards(None, r, world_size, "float32") for r in range(world_size)]
    parts = [sh.shard_masters(whole) for sh in shards]
    reference = _optimizer(whole, kernel, algorithm)
    sharded = [_optimizer(p, kernel, algorithm) for p in parts]
    for step in range(1, 5):
        grads = {
            layer: {n: torch.randn_like(t) for n, t in per.items()} for layer, per in whole.items()
        }
        outs = {
            layer: {n: torch.empty_like(t, dtype=torch.bfloat16) for n, t in per.items()}
            for layer, per in whole.items()
        }
        sharded_outs = {
            layer: {n: torch.empty_like(t) for n, t in per.items()} for layer, per in outs.items()
        }
        reference.step_layers(grads, step, outs=outs)
        for sh, opt in zip(shards, sharded):
            opt.step_layers(
                {i: {n: sh.own(g.clone()) for n, g in per.items()} for i, per in grads.items()},
                step,
                outs={i: {n: sh.own(o) for n, o in per.items()} for i, per in sharded_outs.items()},
            )
        for layer, per in whole.items():
            for n, master in per.items():
                joined = torch.cat([p[layer][n] for p in parts])
                assert torch.equal(
                    joined.view(-1).view(torch.int32), master.view(-1).view(torch.int32)
                ), (step, n)
                assert torch.equal(
                    sharded_outs[layer][n].view(torch.int16), outs[layer][n].view(torch.int16)
                )


class _Gloo:
    """The collectives ZeroShards needs, straight on the default gloo group (no arrival:
    every process of the test takes part in every one)."""

    def all_gather(self, flat, name, count, what, step=None) -> None:  # gloo's own
        mine = flat.chunk(torch.distributed.get_world_size())[torch.distributed.get_rank()]
        torch.distributed.all_gather_into_tensor(flat, mine.clone())

    def all_reduce(self, tensors, name, count, what) -> None:
        for t in tensors:
            torch.distributed.all_reduce(t)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _one_layout_rank(rank: int, world: int, port: int, out) -> None:
    """One node of ``test_both_reductions_add_in_one_order``."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    g = torch.Generator().manual_seed(rank)
    # A layer's gradients: sizes that do and do not divide into aligned pieces, and
    # magnitudes far apart, so that the order of the additions shows in the last bit.
    shapes = [(300, 257), (257,), (64, 1000), (7,), (1, 4097)]
    grads = [torch.randn(s, generator=g) * 10.0 ** (i - 2) for i, s in enumerate(shapes)]
    shards = ZeroShards(_Gloo(), rank, world, "float32")
    replicated = [t.clone() for t in grads]
    shards.all_reduce(replicated, "grad/0", 1, "layer 0")
    sharded = [t.clone() for t in grads]
    shards.reduce_scatter(sharded, "grad/0", 1, "layer 0")
    shards.all_gather(sharded, "weights/0", 1, "layer 0")  # the summed pieces, whole
    # gloo's own reduce-scatter of the same packed buffer (Note [sharded collectives
    # over gloo]), then the same all-gather
    native = [t.clone() for t in grads]
    chunk = shards.chunk_numel(native)
    flat, mine = torch.empty(world * chunk), torch.empty(chunk)
    shards.pack(native, flat, range(world))
    dist.reduce_scatter_tensor(mine, flat)
    shards.unpack(mine, native, [rank])
    shards.all_gather(native, "weights/0", 1, "layer 0")
    per_tensor = [t.clone() for t in grads]
    for t in per_tensor:
        dist.all_reduce(t)
    out.put((rank, _same(replicated, sharded), _same(per_tensor, sharded), _same(native, sharded)))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_both_reductions_add_in_one_order(world: int) -> None:
    """Note [one layout for both reductions], on real gloo processes: the replicated
    mode's all-reduce of the rank-major buffer gives every node exactly the sums the
    sharded mode's reduce-scatter gives each piece's owner, at 2 nodes and at 3, where
    one all-reduce per tensor does not (a ring adds in an order set by position); and
    the sharded mode's reduce-scatter, an all-reduce of its own buffer, gives the bits
    of gloo's reduce-scatter (Note [sharded collectives over gloo])."""
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_one_layout_rank, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert all(same for _, same, _, _ in results), results
    assert all(same for _, _, _, same in results), results
    per_tensor_same = all(same for _, _, same, _ in results)
    assert per_tensor_same == (world == 2), results  # a + b == b + a; three terms: not so


def test_gradient_buckets_group_consecutive_layers_up_to_the_cap() -> None:
    """Note [gradient buckets]: layers keep the reduction order; a bucket grows while the
    next layer fits under the cap; a layer over the cap is a bucket of its own; cap 0 is
    one bucket per layer. The collectives are named after the bucket's layers."""
    layers = [(5, 40), (4, 30), (3, 30), (2, 200), (1, 10), (0, 90)]
    assert gradient_buckets(layers, 100) == [(5, 4, 3), (2,), (1, 0)]
    assert gradient_buckets(layers, 70) == [(5, 4), (3,), (2,), (1,), (0,)]
    assert gradient_buckets(layers, 0) == [(5,), (4,), (3,), (2,), (1,), (0,)]
    assert gradient_buckets(layers, 10**9) == [(5, 4, 3, 2, 1, 0)]
    assert gradient_buckets([], 100) == []
    assert bucket_name("grad", (5, 4, 3)) == "grad/3-5"
    assert bucket_name("weights", (2,)) == "weights/2"
    assert (bucket_text((1, 0)), bucket_text((2,))) == ("layers 0-1", "layer 2")
