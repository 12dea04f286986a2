"""Optimizer state sharded across the nodes of a data-parallel group (ZeRO stage 1):
``train.optimizer_sharding: sharded`` (docs/multi-node.md).

Every node keeps the whole model's compute-dtype weights (both parities) and gradient
slots in its arenas, as in the replicated mode, but the fp32 masters and the optimizer
moments only of its *shard*: about 1/W of every trainable tensor. Per step and layer:

* the gradient is **reduce-scattered** (``ZeroShards.reduce_scatter``; Note [sharded
  collectives over gloo]): each node gets the sum over the nodes of its shard only,
  written back into its shard's elements of the gradient slot (the rest of the slot is
  left as it was, and never read);
* each node steps its shard's masters and moments (an ordinary ``LayerwiseOptimizer``
  over 1-D pieces), casting into its shard's elements of the weight arena;
* the updated weights are **all-gathered** (``ZeroShards.all_gather``) into every
  node's weight arena; only then is the layer's version published (Note [gathered
  before published]).

Note [shard boundaries]
~~~~~~~~~~~~~~~~~~~~~~~
Each trainable tensor of n elements is split on its own, flat: with
``span = ceil(ceil(n / W) / ALIGN) * ALIGN``, rank r owns elements
``[min(r * span, n), min((r + 1) * span, n))`` (the last ranks' pieces may be short or
empty). Why per tensor and not per layer: a tied alias (the LM head's contribution to
the embedding's gradient, Note [tied embeddings] in roundpipe.shared.model) has the
owner's shape but lives in another layer, and the two must be summed element by element
on the node that owns those elements; per tensor both split alike. Names are kept, so
weight decay (by name) is unchanged. Why ALIGN = 256: both AdamW kernels treat a
tensor's last ``numel % 16`` elements differently from the rest (Note [compiled AdamW
kernel], torch's scalar tail loop), so a piece must start on a 16-element boundary and
end either on one or at the tensor's end: then every element gets the arithmetic it
gets in the whole tensor, and the sharded masters are bitwise the replicated ones
(tests/test_sharded_optimizer.py). 256 is also the block of 8-bit states, for a later
int8 shard. Rank 0 always owns element 0, so it holds a piece of every tensor.

The collectives move one flat buffer per layer, *rank-major*: chunk r (of
``chunk_numel`` elements) is the concatenation of rank r's pieces of the layer's
tensors, each padded to its span. A reduce-scatter of that buffer leaves chunk r,
summed, on rank r; an all-gather of each rank's chunk builds it on every node. Only
the elements of pieces are ever read back; padding is never read.

Note [one layout for both reductions]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The replicated mode reduces each bucket's gradients (Note [gradient buckets]) with one
all-reduce of the same rank-major buffer (``ZeroShards.all_reduce``), not one per
tensor. A ring all-reduce
adds a chunk's elements in an order set by the chunk's place in the buffer (over 3
nodes: (a + b) + c for one chunk, (b + c) + a for the next), and so does the
reduce-scatter of that buffer, chunk r ending on rank r. In one layout both modes add
every element's terms in the same order, so their models stay bitwise equal at any node
count; one all-reduce per tensor would chunk each tensor its own way, and differ from
the sharded mode in the last bit at 3 nodes and more. One collective per bucket is also
cheaper: each costs an arrival and a round of gloo messages. The cost is a scratch
buffer of the largest bucket's gradient in the transport dtype
(``HostMemory.collectives``).

Note [sharded collectives over gloo]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's gloo backend has no reduce-scatter of its own: ``reduce_scatter_tensor`` clones
its input, all-reduces the clone and copies this rank's chunk out (ProcessGroupGloo).
So ``ZeroShards.reduce_scatter`` all-reduces its own packed buffer and unpacks only this
node's chunk: the same bits as gloo's reduce-scatter (tests/test_sharded_optimizer.py
compares them), without a fresh copy of the whole buffer per call (for 10 MB between
two processes on the 2-core developer machine: 11 ms against gloo's 15 ms). What it
costs, either way: a sharded job's gradients move as much as an all-reduce moves, 2
(W-1)/W of their bytes per node, not the (W-1)/W of a true reduce-scatter. The sharded
mode saves host memory, not traffic (``predict_data_parallel`` counts it so); a ring
reduce-scatter of our own over gloo's point-to-point sends would halve the gradient
bytes, not done.

gloo's all-gather allocates a fresh output buffer per call and copies every chunk out
of it. ``JobGroup.all_gather`` instead broadcasts each rank's chunk in place inside the
packed buffer, W broadcasts issued at once as one collective (one arrival): the same
bytes on the wire, (W-1)/W of the buffer per node, and copies, so exact; for 10 MB of
bf16 here 3.6 ms against gloo's 6.6 ms at 2 nodes, 6.6 against 9.7 ms at 3.

Note [gradient buckets]
~~~~~~~~~~~~~~~~~~~~~~~
Every collective has a fixed cost besides its bytes: the arrival in the store (Note
[arrive before a collective]), a round of gloo messages, and waking the threads that
take part, on the same cores as the workers when they are CPU workers. A layer of a
small model or of a LoRA adapter moves a few hundred KiB, so one collective per layer
is mostly fixed cost. As DDP buckets its all-reduces (``bucket_cap_mb``), consecutive
layers in the reduction order are grouped (``gradient_buckets``) until their gradients
reach ``train.grad_bucket_mb`` in the transport dtype; a layer larger than that is a
bucket of its own (an 8B model's layers are hundreds of MiB each: one per bucket, as
before). A bucket is one reduction (its layers' tensors packed rank-major as one
layer's are) and, sharded, one all-gather of its updated weights. Both modes bucket
alike, so Note [one layout for both reductions] still holds. What it costs: a
bucket's reduction starts only once all its layers' gradients are in (less overlap
with the backward), and the scratch is the largest bucket, not the largest layer.
Where layers share gradient slots (Note [gradient buffer] in
roundpipe.coordinator.training.layout), a backward task writes a layer's gradient only
after the layers above that share its slot are updated, which for a layer of the same
bucket (or one that a backward stage writes together with a layer of it) would wait
for the bucket itself: such a job reduces one layer at a time (``train.grad_buffer_stages:
0`` gives every layer a slot of its own, and buckets back). Each node plans for its own
workers, so the nodes tell each other at the start of each run whether they share
slots (``JobGroup.exchange``), and all take one layer at a time if any does: the nodes'
collectives must match one for one.
The collectives are named after the bucket's layers: ``grad/3`` for layer 3 alone,
``grad/0-5`` for layers 0 to 5, and ``weights/...`` alike.

Note [gathered before published]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Note [reduced before stepped] (roundpipe.coordinator.training.multinode) holds for the
shard: the optimizer steps layer l of step k once ``reduced[l] >= k``, reading only its
own elements of the slot, which hold the sum over the nodes. Then ``version[l] = k``
is stored only after the all-gather of l's step-k weights (with its bucket's, Note
[gradient buckets]) has written every node's pieces into params[k % 2]: so every reader of version k (the next forward, a backward
that reuses the grads slot, Note [gradient buffer]) sees the whole tensor, and the grads
slot with the reduced shard is not overwritten before the step read it. The all-gathers
are issued by the optimizer thread bucket by bucket in the reducer's order (descending
layers) on every node, each once all its layers are stepped, whatever set of layers the
optimizer happened to step together (that depends on timing and differs between
nodes), on a process group of their own
(``JobGroup.pg_gather``), so that they never interleave with the reducer thread's
reduce-scatters on the job's group; each arrives first as any collective (Note [arrive
before a collective]).

Note [clipping a sharded gradient]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``optimizer.grad_clip`` scales every gradient of a step by one coefficient from the
global norm (roundpipe.coordinator.training.optimizer), but after the reduce-scatter no
node holds a whole gradient. As ZeRO does, each node takes the sum of squares of its
pieces of each tensor, one all-reduce of that vector (one float64 per tensor, on the
optimizer thread's ``pg_gather`` between the step's last reduce-scatter and its first
all-gather) gives every node each tensor's squared norm, and the total is formed as
``torch.nn.utils.get_total_norm`` forms it: the norm of the per-tensor norms. Every
node thus scales by the same coefficient. It is not bitwise the replicated mode's: a
tensor's norm summed from pieces rounds differently from one ``vector_norm`` over the
whole tensor (last-bit differences of the coefficient; tests/test_multinode_sharded.py
bounds the weights' difference).

Note [sharded checkpoint]
~~~~~~~~~~~~~~~~~~~~~~~~~
A checkpoint stays free of topology (Note [checkpoint cut] in
roundpipe.coordinator.training.checkpointer): it holds whole tensors, never shards. At a
checkpoint step every node drains as rank 0 does, or, with staging on every node, goes
on training (Note [sharded background checkpoint]); then every node sends its pieces to
rank 0, one layer at a time (``gather_layers``, roundpipe.coordinator.training.
sharded_checkpoint): first the masters (gather ``checkpoint/STEP``), then the optimizer
states (``checkpoint/STEP/states``, Note [streamed checkpoint state]). Rank 0
writes the same files a replicated job writes (bitwise, tests/test_multinode_sharded.py),
atomically (Note [atomic checkpoint]): a node lost during a gather fails the collective
before the checkpoint is complete, and one lost while rank 0 writes is noticed only
afterwards, so the previous checkpoint stays intact either way
(tests/test_multinode_sharded.py kills a node in the middle of each gather with the
fault point below). The other nodes wait while rank 0 writes. Resuming, rank 0 reads the
whole state and broadcasts it layer by layer; each node keeps its pieces
(``GroupMember.sync``), so a checkpoint of any topology resumes sharded, and a sharded
one on any topology. The final model is gathered the same way, masters only, for rank 0
to export.

Note [sharded background checkpoint]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Background checkpoints (Note [background checkpoint] in
roundpipe.coordinator.training.snapshot) work per node: every node has a writer thread
and staging for its own pieces of the masters and states (rank 0 also for the whole
previous weights, which it alone writes), captured by its optimizer thread right after
each layer is published, that is after the layer's all-gather. Each writer then gathers
the staged pieces at rank 0 as a drained checkpoint does, while training goes on. Its
gathers run on a process group of its own (``JobGroup.pg_checkpoint``): the reducer
(``pg``) and the optimizer (``pg_gather``) issue collectives meanwhile, and collectives
of one group must be issued in the same order on every node, which only one thread per
group guarantees. Each writer writes its checkpoints in step order, so every node
gathers the same sequence. A gather is a collective: either every node stages or none,
so the nodes agree at the start of each run (``JobGroup.exchange``), and drain if one
cannot. A node lost during a background gather pauses the job on the others (the
writer's error reaches the run loop) and leaves the previous checkpoint, as drained.
What it costs: a background checkpoint is complete only once every node has sent its
pieces, a few seconds after its step, while training goes on; a node lost in that window
loses that checkpoint too (the job resumes from the one before), where a drained one
would have been complete before the next step began. On one node, or with replicated
state, only rank 0's own crash has that window.

Note [streamed checkpoint state]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Rank 0 must not need the whole training state at once, or a group of W servers would fit
no bigger a model than one server (12 bytes per trainable parameter on top of its own
pieces). The optimizer states (8 of those 12 bytes with AdamW) are therefore written as
they arrive: every tensor's name, dtype and shape are known before anything is gathered,
so the training-state file's safetensors header is written first and each layer's states
are appended as soon as that layer's gather completes (``save_tensor_stream`` in
roundpipe.coordinator.training.checkpoint); rank 0 holds one layer of them at a time
(twice: the gather's buffers and the whole tensors). The masters (4 bytes) are still
gathered whole: the model files are written by ``save_pretrained`` of a Hugging Face
model built from them. Streaming those too needs a model-file writer of our own (names,
tied weights, shards and index as ``save_pretrained`` makes them); not done yet.

Fault point (tests, docs/fault-tolerance.md): ``ROUNDPIPE_GATHER_FAULT="kill@NAME"`` in a
coordinator's environment SIGKILLs it in the middle of the gather called NAME (after its
first layer), e.g. ``kill@checkpoint/4`` (the masters) or ``kill@checkpoint/4/states``
(the optimizer states) for the checkpoint of step 4.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

import torch

__all__ = [
    "ALIGN",
    "GATHER_FAULT_ENV",
    "Collectives",
    "GatheredLayer",
    "ZeroShards",
    "bucket_cap_mb",
    "bucket_name",
    "bucket_text",
    "gradient_buckets",
    "piece",
    "span",
]


class Collectives(Protocol):
    """What the shards need of a job's group (roundpipe.coordinator.training.multinode's
    ``JobGroup``): collectives that arrive first (Note [arrive before a collective])."""

    def all_reduce(self, tensors: list[torch.Tensor], name: str, count: int, what: str) -> None: ...

    def all_gather(
        self, flat: torch.Tensor, name: str, count: int, what: str, step: int | None = None
    ) -> None: ...

    def gather(
        self,
        tensor: torch.Tensor,
        gathered: list[torch.Tensor] | None,
        name: str,
        count: int,
        what: str,
        *,
        background: bool = False,
    ) -> None: ...

    def all_reduce_optimizer(
        self, tensors: list[torch.Tensor], name: str, count: int, what: str
    ) -> None: ...


log = logging.getLogger(__name__)

GATHER_FAULT_ENV = "ROUNDPIPE_GATHER_FAULT"
ALIGN = 256
"""Pieces start on multiples of this many elements (Note [shard boundaries])."""
GatheredLayer = tuple[int, dict[str, torch.Tensor]]
"""A layer and its whole tensors by key, as ``ZeroShards.gather_layers`` yields them."""


def gradient_buckets(
    layer_bytes: Sequence[tuple[int, int]], cap_bytes: float
) -> list[tuple[int, ...]]:
    """``(layer, gradient bytes)`` in the reduction order, grouped into buckets of
    consecutive layers of at most ``cap_bytes`` together; a layer larger than that is a
    bucket of its own, and ``cap_bytes`` 0 makes one bucket per layer (Note [gradient
    buckets])."""
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    size = 0
    for layer, nbytes in layer_bytes:
        if current and size + nbytes > cap_bytes:
            buckets.append(tuple(current))
            current, size = [], 0
        current.append(layer)
        size += nbytes
    if current:
        buckets.append(tuple(current))
    return buckets


def bucket_cap_mb(grad_bucket_mb: float, shares_grad_slots: bool) -> float:
    """The bucket size a group reduces with: ``train.grad_bucket_mb``, or 0 (one layer
    per collective) where layers share gradient slots (Note [gradient buckets])."""
    return 0 if shares_grad_slots else grad_bucket_mb


def _layer_range(bucket: Sequence[int]) -> str:
    lo, hi = min(bucket), max(bucket)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def bucket_name(kind: str, bucket: Sequence[int]) -> str:
    """A bucket's collective: ``grad/3`` (layer 3 alone), ``grad/0-5`` (layers 0 to 5)."""
    return f"{kind}/{_layer_range(bucket)}"


def bucket_text(bucket: Sequence[int]) -> str:
    """``layer 3`` or ``layers 0-5``: a bucket, for messages."""
    return ("layer " if len(set(bucket)) == 1 else "layers ") + _layer_range(bucket)


def span(numel: int, world_size: int) -> int:
    """Elements per rank of a tensor of ``numel`` elements (a multiple of ALIGN)."""
    per_rank = -(-numel // world_size)
    return -(-per_rank // ALIGN) * ALIGN


def piece(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """The flat element range ``[lo, hi)`` rank ``rank`` owns (Note [shard boundaries])."""
    s = span(numel, world_size)
    return min(rank * s, numel), min((rank + 1) * s, numel)


def _flat(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("a sharded tensor must be contiguous")
    return t.view(-1)


class ZeroShards:
    """This node's shard of a job's trainable tensors, and the collectives that move
    gradients and weights between the shards (module docstring)."""

    def __init__(self, group: Collectives | None, rank: int, world_size: int, transport: str):
        self.group = group
        self.rank, self.world_size = rank, world_size
        self.transport = getattr(torch, transport)
        """The dtype gradients are reduced in (``train.grad_transport``)."""
        self._scratch: dict[str, torch.Tensor] = {}
        self.bytes_reduced = 0
        """Bytes this node sent into reduce-scatters so far (its whole buffer)."""
        self.bytes_gathered = 0

    # -- pieces -----------------------------------------------------------------------

    def own(self, t: torch.Tensor) -> torch.Tensor:
        """This node's piece of ``t``: a flat view (empty when it owns none)."""
        lo, hi = piece(t.numel(), self.rank, self.world_size)
        return _flat(t)[lo:hi]

    def chunk_numel(self, tensors: Sequence[torch.Tensor]) -> int:
        return sum(span(t.numel(), self.world_size) for t in tensors)

    def shard_masters(
        self, masters: Mapping[int, Mapping[str, torch.Tensor]]
    ) -> dict[int, dict[str, torch.Tensor]]:
        """This node's pieces of the fp32 masters, as tensors of their own (copies: the
        full masters can then be freed). Every layer and name is present; a piece this
        node does not own is an empty tensor."""
        return {
            layer: {name: self.own(t).clone() for name, t in per.items()}
            for layer, per in masters.items()
        }

    def _pairs(self, tensors: Sequence[torch.Tensor], buf: torch.Tensor, ranks: Sequence[int]):
        """``(slice of buf, that rank's piece of a tensor)`` for the pieces of ``ranks``:
        ``buf`` is rank-major (chunks for ``range(W)``), or one chunk when ``ranks ==
        [r]`` and ``buf`` holds a single chunk."""
        chunk = self.chunk_numel(tensors)
        single = buf.numel() == chunk
        for r in ranks:
            offset = 0 if single else r * chunk
            for t in tensors:
                lo, hi = piece(t.numel(), r, self.world_size)
                yield buf[offset : offset + hi - lo], _flat(t)[lo:hi]
                offset += span(t.numel(), self.world_size)

    def pack(
        self, tensors: Sequence[torch.Tensor], out: torch.Tensor, ranks: Sequence[int]
    ) -> None:
        """Copy the pieces of ``ranks`` of ``tensors`` into ``out`` (see :meth:`_pairs`)."""
        for slot, own in self._pairs(tensors, out, ranks):
            slot.copy_(own)

    def unpack(
        self, src: torch.Tensor, tensors: Sequence[torch.Tensor], ranks: Sequence[int]
    ) -> None:
        """The reverse of :meth:`pack`: ranks' pieces from ``src`` into ``tensors``."""
        for slot, own in self._pairs(tensors, src, ranks):
            own.copy_(slot)

    def _buffer(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A scratch buffer of at least ``numel`` elements, reused (one per role: each
        role is used by one thread)."""
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self._scratch[key] = torch.zeros(numel, dtype=dtype)
        return buf[:numel]

    # -- collectives ------------------------------------------------------------------

    def reduce_scatter(
        self, tensors: Sequence[torch.Tensor], name: str, count: int, what: str
    ) -> None:
        """Sum this node's pieces of ``tensors`` over the nodes, in place (the other
        elements are left as they were), by an all-reduce of the packed buffer (Note [sharded
        collectives over gloo]). The reducer thread's."""
        self._all_reduce(tensors, [self.rank], name, count, what)

    def all_reduce(self, tensors: Sequence[torch.Tensor], name: str, count: int, what: str) -> None:
        """Sum ``tensors`` over the nodes, in place and whole: the replicated mode's
        reduction, as one collective in the layout of ``reduce_scatter`` (Note [one
        layout for both reductions]). The reducer thread's."""
        self._all_reduce(tensors, range(self.world_size), name, count, what)

    def _all_reduce(
        self,
        tensors: Sequence[torch.Tensor],
        ranks: Sequence[int],
        name: str,
        count: int,
        what: str,
    ) -> None:
        """Pack ``tensors`` rank-major in the transport dtype, all-reduce the buffer, and
        write the sums of ``ranks``' pieces back."""
        assert self.group is not None
        w, chunk = self.world_size, self.chunk_numel(tensors)
        flat = self._buffer("ar", w * chunk, self.transport)
        self.pack(tensors, flat, range(w))
        self.group.all_reduce([flat], name, count, what)
        self.unpack(flat, tensors, ranks)
        self.bytes_reduced += flat.numel() * flat.element_size()

    def all_gather(
        self,
        tensors: Sequence[torch.Tensor],
        name: str,
        count: int,
        what: str,
        step: int | None = None,
    ) -> None:
        """Fill the other nodes' pieces of ``tensors`` (the updated weights) from them.
        The optimizer thread's (Note [gathered before published]); ``step`` as
        ``JobGroup.all_gather``'s."""
        assert self.group is not None and tensors
        w, chunk = self.world_size, self.chunk_numel(tensors)
        flat = self._buffer("ag", w * chunk, tensors[0].dtype)
        self.pack(tensors, flat, [self.rank])
        self.group.all_gather(flat, name, count, what, step)
        self.unpack(flat, tensors, [r for r in range(w) if r != self.rank])
        self.bytes_gathered += flat.numel() * flat.element_size()

    def grad_norm(
        self,
        grads: Mapping[int, Mapping[str, torch.Tensor]],
        name: str,
        count: int,
        what: str,
    ) -> torch.Tensor:
        """The L2 norm over all of a step's gradients (``{layer: {name: grad}}``) when
        each node holds the summed gradient of its pieces only (Note [clipping a sharded
        gradient]): every node gets the same 0-dim float32 norm. The optimizer thread's."""
        assert self.group is not None
        tensors = [g for layer in sorted(grads) for g in grads[layer].values()]
        if not tensors:
            return torch.zeros((), dtype=torch.float32)
        squares = torch.stack(
            [
                torch.linalg.vector_norm(self.own(g), dtype=torch.float32).double() ** 2
                for g in tensors
            ]
        )
        self.group.all_reduce_optimizer([squares], name, count, what)
        norms = squares.sqrt().float()  # each tensor's norm, as get_total_norm's first pass
        return torch.linalg.vector_norm(norms)

    def gather_full(
        self,
        pieces: Mapping[int, Sequence[tuple[str, torch.Tensor, torch.Size]]],
        name: str,
        what: str,
    ) -> dict[int, dict[str, torch.Tensor]] | None:
        """Rank 0 gets whole fp32 tensors whose pieces every node holds (the final
        model's masters, a checkpoint's): ``pieces`` is, per layer, a list of ``(key,
        this node's piece, the whole tensor's shape)``. Returns ``{layer: {key: whole
        tensor}}`` at rank 0, None elsewhere. See :meth:`gather_layers`."""
        full = dict(self.gather_layers(pieces, name, what))
        return full if self.rank == 0 else None

    def gather_layers(
        self,
        pieces: Mapping[int, Sequence[tuple[str, torch.Tensor, torch.Size]]],
        name: str,
        what: str,
        *,
        background: bool = False,
    ) -> Iterator[GatheredLayer]:
        """One gather per layer, in ascending order: yields ``(layer, {key: whole
        tensor})`` at rank 0 (``{}`` elsewhere) after each, so that rank 0 can write a
        layer before the next is gathered (Note [streamed checkpoint state]) and every
        node holds one layer's buffer at a time. Every node must run it to the end.
        ``background``: from the checkpoint writer threads, on their own process group
        (Note [sharded background checkpoint])."""
        assert self.group is not None
        w = self.world_size
        for i, layer in enumerate(sorted(pieces)):
            entries = [(key, own, torch.Size(shape)) for key, own, shape in pieces[layer]]
            chunk = sum(span(shape.numel(), w) for _, _, shape in entries)
            mine = torch.zeros(chunk, dtype=torch.float32)
            offset = 0
            for _, own, shape in entries:
                mine[offset : offset + own.numel()].copy_(own)
                offset += span(shape.numel(), w)
            gathered = [torch.empty(chunk) for _ in range(w)] if self.rank == 0 else None
            self.group.gather(mine, gathered, name, i + 1, what, background=background)
            if i == 0 and os.environ.get(GATHER_FAULT_ENV) == f"kill@{name}":
                log.error("[multinode] %s: killed in gather %s", GATHER_FAULT_ENV, name)
                os.kill(os.getpid(), signal.SIGKILL)  # a crash in the middle of the gather
            if gathered is None:
                yield layer, {}
                continue
            per = {key: torch.empty(shape) for key, _, shape in entries}
            for r in range(w):
                offset = 0
                for key, _, shape in entries:
                    lo, hi = piece(shape.numel(), r, w)
                    per[key].view(-1)[lo:hi].copy_(gathered[r][offset : offset + hi - lo])
                    offset += span(shape.numel(), w)
            yield layer, per
