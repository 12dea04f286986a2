"""Checkpoints of a job whose optimizer state is sharded over the nodes of a group
(``train.optimizer_sharding: sharded``; Note [sharded checkpoint] in
roundpipe.coordinator.training.sharded_optimizer).

No node holds a whole layer's masters and moments, so every checkpoint is a collective:
each node sends its pieces to rank 0, one layer at a time, and rank 0 writes the files a
replicated job writes (``Checkpointer.write``). Two ways, as on one node:

* drained (``save``): at the cut, from the live pieces, on the job's process group (the
  pipeline and the reducer are idle then);
* in the background (``sources`` + ``write_staged``, Note [sharded background
  checkpoint]): each node stages its own pieces as the optimizer publishes each layer,
  and every node's writer thread gathers from its staging on a process group of its own,
  while training goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from roundpipe.coordinator.training.checkpoint import StreamedTensors
from roundpipe.coordinator.training.checkpointer import Checkpointer
from roundpipe.coordinator.training.job_errors import JobCancelled
from roundpipe.coordinator.training.layout import JobLayout
from roundpipe.coordinator.training.memory import release_freed_memory
from roundpipe.coordinator.training.multinode import GroupError
from roundpipe.coordinator.training.optimizer import LayerwiseOptimizer
from roundpipe.coordinator.training.sharded_optimizer import GatheredLayer, ZeroShards

__all__ = ["ShardedCheckpoints"]

log = logging.getLogger(__name__)

Pieces = dict[int, list[tuple[str, torch.Tensor, torch.Size]]]
"""Per layer, ``(key, this node's piece, the whole tensor's shape)``."""


class ShardedCheckpoints:
    """Writes a sharded job's checkpoints (module docstring); every node has one."""

    def __init__(
        self,
        shards: ZeroShards,
        layout: JobLayout,
        masters: Mapping[int, Mapping[str, torch.Tensor]],
        optimizer: LayerwiseOptimizer,
        checkpointer: Checkpointer,
        *,
        job_id: str,
        stopped: Callable[[BaseException], Exception],
    ):
        self.shards = shards
        self.layout = layout
        self.masters = masters
        """This node's pieces of the fp32 masters (``ZeroShards.shard_masters``)."""
        self.optimizer = optimizer
        self.checkpointer = checkpointer
        self.job_id = job_id
        self._stopped = stopped
        """What a stopped group means for the job (``GroupMember.stopped``)."""

    @property
    def leader(self) -> bool:
        return self.shards.rank == 0

    # -- drained ----------------------------------------------------------------------

    def save(self, step: int) -> Path | None:
        """Write the checkpoint after ``step`` from the live pieces, at a drained cut
        (Note [checkpoint cut]). A collective: every node calls it; rank 0 writes and
        returns the path, the others None. Raises JobPaused if a node is lost."""
        return self._write(step, self._live(step), self.checkpointer.context(), background=False)

    def gather_masters(self, name: str, what: str) -> dict[int, dict[str, torch.Tensor]] | None:
        """The live fp32 masters, whole at rank 0 (``{layer: {"master/NAME": t}}``; None
        elsewhere), on the job's process group (the final model, at a drained cut)."""
        masters = {
            layer: {f"master/{n}": m for n, m in per.items()} for layer, per in self.masters.items()
        }
        pieces = self._pieces(masters, ("master",))
        full = dict(self._gathered(self.shards.gather_layers(pieces, name, what)))
        return full if self.leader else None

    def _live(self, step: int) -> dict[int, dict[str, torch.Tensor]]:
        """This node's pieces now, keyed as a checkpoint keys them (the checkpointer's
        ``state_tensors``: ``master/NAME``, ``KIND/NAME``), with ``prev/NAME`` (whole,
        version ``step - 1``) at rank 0 only: the others never write it."""
        state = self.checkpointer.state_tensors(step)
        if self.leader:
            return state
        return {
            layer: {key: t for key, t in per.items() if not key.startswith("prev/")}
            for layer, per in state.items()
        }

    # -- in the background ------------------------------------------------------------

    def sources(self, step: int) -> dict[int, dict[str, torch.Tensor]]:
        """What this node stages of checkpoint ``step``, per layer (``BackgroundCheckpoints``
        copies it right after the optimizer publishes the layer): its pieces, and at rank
        0 the whole previous weights."""
        return self._live(step)

    def write_staged(
        self, step: int, staging: Mapping[int, Mapping[str, torch.Tensor]], context: Any
    ) -> Path | None:
        """In every node's writer thread: gather the staged pieces of checkpoint ``step``
        at rank 0, which writes it (Note [sharded background checkpoint]). Returns the
        path at rank 0, None elsewhere."""
        return self._write(step, staging, context, background=True)

    # -- both -------------------------------------------------------------------------

    def _write(
        self,
        step: int,
        state: Mapping[int, Mapping[str, torch.Tensor]],
        context: Any,
        *,
        background: bool,
    ) -> Path | None:
        """Gather the masters whole, then stream the optimizer states a layer at a time
        into rank 0's training-state file (Note [streamed checkpoint state])."""
        shards, kinds = self.shards, self.optimizer.kinds
        # Plain SGD keeps no state: nothing to gather beyond the masters.
        state_pieces = self._pieces(state, kinds) if kinds else {}
        masters = self._gathered(
            shards.gather_layers(
                self._pieces(state, ("master",)),
                f"checkpoint/{step}",
                f"every node's masters of step {step}",
                background=background,
            )
        )
        whole = dict(masters)
        states = (
            self._gathered(
                shards.gather_layers(
                    state_pieces,
                    f"checkpoint/{step}/states",
                    f"every node's optimizer states of step {step}",
                    background=background,
                )
            )
            if state_pieces
            else iter(())
        )
        if not self.leader:
            for _ in states:  # rank 0 writes each layer as it comes
                pass
            return None
        for layer, per in whole.items():
            per.update((key, t) for key, t in state[layer].items() if key.startswith("prev/"))
        entries = [
            (key, torch.float32, tuple(shape))
            for _, per in sorted(state_pieces.items())
            for key, _, shape in per
        ]
        streamed = StreamedTensors(entries, (per for _, per in states))
        path = self.checkpointer.write(step, whole, context, streamed)
        del whole
        release_freed_memory()
        return path

    def _pieces(self, state: Mapping[int, Mapping[str, torch.Tensor]], kinds: tuple) -> Pieces:
        """From ``state`` (live or staged pieces): the tensors of ``kinds`` (``master``
        or the optimizer's states), with each whole tensor's shape, for a gather."""
        out: Pieces = {}
        for layer, per in self.masters.items():
            entries = out[layer] = []
            for n in per:
                shape = self.layout.view(self.layout.params[layer][n][0]).shape
                entries += [(f"{kind}/{n}", state[layer][f"{kind}/{n}"], shape) for kind in kinds]
        return out

    def _gathered(self, layers: Iterator[GatheredLayer]) -> Iterator[GatheredLayer]:
        """``layers`` (a gather) with a lost node as JobPaused and a cancelled job as
        JobCancelled."""
        try:
            yield from layers
        except GroupError as exc:
            raise self._stopped(exc) from None
        except InterruptedError:
            raise JobCancelled(f"job {self.job_id} was cancelled") from None
