"""The job's first weights: W_0 into the params arena and the fp32 masters.

Loaded after the job's host memory was checked and its arenas created, each weight as it
is read (Note [loading into the arena]); with sharded optimizer state, a node other than
rank 0 keeps only its pieces of the masters (Note [sharded start-up]).
"""

from __future__ import annotations

import torch

from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.training.job_errors import JobFailed
from roundpipe.coordinator.training.layout import JobLayout
from roundpipe.coordinator.training.sharded_optimizer import ZeroShards
from roundpipe.shared.model import LayeredModel

__all__ = ["place_initial_weights"]

Masters = dict[int, dict[str, torch.Tensor]]


# Note [loading into the arena]
#     The weights are loaded after the job's host memory was checked and its arenas were
#     created, and each weight read from model.path goes into the params arena (and, if
#     it trains, becomes its fp32 master) as it is read. Loading the whole model first
#     held it in fp32 beside everything else: a LoRA job on a bf16 base peaked at ~6
#     bytes a parameter for a prediction of ~2, and a full fine-tune's check, taken with
#     the fp32 weights already held, counted its masters twice and refused jobs that
#     fit. A random base is still made whole by transformers, then placed: the peak is
#     one fp32 model beside the arenas (docs/memory.md).


# Note [sharded start-up]
#     With sharded optimizer state, the nodes start from rank 0's state: rank 0 keeps the
#     whole fp32 masters it loaded (or restored) until sync has broadcast them a layer
#     at a time, and each node keeps its pieces. The other nodes keep only their pieces
#     of the masters as each weight is read; of the whole ones they keep the shapes
#     (meta tensors), and receive each layer into buffers of that layer alone. Resuming,
#     rank 0 leaves the optimizer states in the checkpoint's file and reads each layer's
#     as sync sends it (checkpointer.CheckpointMoments). Before, every node held the
#     whole masters (4 bytes a trainable parameter) until sync, and rank 0 resuming the
#     whole states too (8 more with AdamW), beyond what the memory check counted for it:
#     it now counts, on rank 0, the whole masters and a layer's states (as when it
#     writes a checkpoint), and on the others a layer's masters and states.


def _as_master(w: torch.Tensor) -> torch.Tensor:
    """The fp32 master of a freshly loaded weight: the tensor itself when it is an fp32
    tensor that owns exactly its storage (the loaders' output, dropped after loading),
    else a copy. Taking it over instead of copying keeps the loading peak at one fp32
    model, not two (docs/memory.md)."""
    owns = (
        w.dtype == torch.float32
        and w.is_contiguous()
        and w.storage_offset() == 0
        and w.untyped_storage().nbytes() == w.numel() * w.element_size()
        and not w.requires_grad
    )
    return w if owns else w.to(torch.float32).clone()


def place_initial_weights(
    model: LayeredModel, layout: JobLayout, spec: JobSpec, *, pieces_of: ZeroShards | None = None
) -> tuple[Masters, Masters]:
    """W_0 into params parity 0 and the fp32 masters (coordinator memory), after the
    arenas exist and host memory was checked (Note [loading into the arena]). Returns
    ``(masters, whole)``: the fp32 masters, and the whole ones (the same dict). With
    ``pieces_of`` (a sharded node other than rank 0), ``masters`` holds only this node's
    pieces, cut as each weight is read, and ``whole`` their shapes alone (meta tensors:
    Note [sharded start-up])."""
    trainable = {
        (layer, s.name)
        for layer in range(model.num_layers)
        for s in model.layer_params(layer)
        if s.trainable
    }
    placed: set[tuple[int, str]] = set()
    masters: Masters = {}
    whole: Masters = {} if pieces_of is not None else masters

    def place(layer: int, name: str, w: torch.Tensor) -> None:
        refs = layout.params.get(layer, {}).get(name)
        if refs is None:
            return
        layout.view(refs[0]).copy_(w)
        if (layer, name) in trainable:
            master = _as_master(w)
            if pieces_of is not None:
                masters.setdefault(layer, {})[name] = pieces_of.own(master).clone()
                master = torch.empty(master.shape, dtype=master.dtype, device="meta")
            whole.setdefault(layer, {})[name] = master
        placed.add((layer, name))

    if spec.model.path is not None:
        # A quantised base is quantised as it is read (Note [quantised base] in
        # roundpipe.shared.quantized_base): its parts go into the arena.
        model.load_weights(dtype=torch.float32, seed=spec.init_seed, quantize_base=True, sink=place)
    else:  # transformers builds a random model whole, in fp32
        weights = model.init_weights(spec.init_seed)
        if model.quantized_base is not None:
            model.quantized_base.quantize_weights(weights)
        for layer, per in weights.items():
            for name in list(per):
                place(layer, name, per.pop(name))
        del weights
    unset = [
        f"{layer}:{name}"
        for layer, names in layout.params.items()
        for name in names
        if (layer, name) not in placed
    ]
    if unset:
        raise JobFailed(f"the model's weights left {len(unset)} unset, e.g. {unset[:5]}")
    return masters, whole
