"""One node's side of a job trained by a data-parallel group of coordinators
(roundpipe.coordinator.training.multinode, docs/multi-node.md).

A ``GroupMember`` starts the node from rank 0's state (``sync``: only rank 0 reads
checkpoints), trains the node's share of every global batch (``share``), runs the
``GradientReducer`` that sums each layer's gradient over the nodes while the job runs,
and turns a stopped group into JobPaused (another node left, went silent or failed a
collective), JobCancelled or JobFailed (rank 0's job was cancelled or failed).

Note [a group's job ends as rank 0's]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Rank 0 owns the job: it was submitted there, it alone writes checkpoints and the model,
and it alone checks the whole weights before each checkpoint (Note [diverged training]).
So a job can fail at rank 0 where the other nodes see nothing wrong: weights that are
not finite under finite losses (with sharded state each node holds a piece; replicated,
the others never look), its model not written. The other nodes end as rank 0 does: a
node that trained all its steps waits for rank 0 to say the job is done (``end``) and
only then succeeds (another node that leaves meanwhile changes nothing: rank 0 waits for
none), and a node that sees rank 0 leave failed or cancelled fails or is cancelled with
rank 0's reason (``stopped``). Before, such a node succeeded, or paused
and told the user to resume a job that would fail the same way."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field

import torch

from roundpipe.coordinator.spec.data import DataLoader, GlobalBatch, PackedDataset
from roundpipe.coordinator.spec.errors import DataError
from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.training.checkpointer import Checkpointer
from roundpipe.coordinator.training.job_errors import JobCancelled, JobFailed, JobPaused
from roundpipe.coordinator.training.job_output import JobOutput
from roundpipe.coordinator.training.layout import JobLayout
from roundpipe.coordinator.training.multinode import GradientReducer, GroupError, JobGroup
from roundpipe.coordinator.training.optimizer import LayerwiseOptimizer
from roundpipe.coordinator.training.progress_log import ProgressLog
from roundpipe.coordinator.training.sharded_optimizer import ZeroShards, bucket_cap_mb

__all__ = ["GroupMember"]

log = logging.getLogger(__name__)


@dataclass(eq=False, repr=False)
class GroupMember:
    """This node in ``group``, for one job (module docstring)."""

    job_id: str
    spec: JobSpec
    group: JobGroup
    _: KW_ONLY
    output: JobOutput
    """Says which checkpoint a paused job resumes from."""
    cancelled: threading.Event
    wake: Callable[[str], None]
    """Wakes the run loop (with the reason) when the reducer stopped."""
    reducer: GradientReducer | None = field(default=None, init=False)
    """Sums gradients and losses over the nodes while ``run`` runs."""

    def share(self, batch: GlobalBatch) -> GlobalBatch:
        """The microbatches of ``batch`` this node trains."""
        return batch.shard(self.group.microbatches(self.spec.batch.num_microbatches))

    @property
    def waiting(self) -> str | None:
        """Which nodes this one has long been waiting for at a collective, and why where
        they said (coordinator.multinode), else None."""
        return self.group.waiting

    def stopped(self, exc: BaseException) -> JobPaused | JobFailed | JobCancelled:
        """What the group's stop (``exc`` says why) means for this node's job: cancelled
        or failed as rank 0's was (Note [a group's job ends as rank 0's]), else paused."""
        group = self.group
        group.problem()  # who left, and how (it may not have been asked yet)
        if group.left_by == 0 and group.left_as == "cancelled":  # so is ours
            return JobCancelled(f"job {self.job_id} was cancelled at rank 0")
        if group.left_by == 0 and group.left_as == "failed":
            return JobFailed(f"{group.nodes.describe(0)} failed the job: {group.left_why}")
        kept = (
            f"checkpoint step {self.output.checkpoint_step} is kept"
            if self.output.checkpoint_step
            else "no checkpoint has been written yet"
        )
        return JobPaused(
            f"the data-parallel group stopped: {exc}. The job is paused; {kept}. Run "
            f"`roundpipe resume {self.job_id}` to continue from it on the nodes that remain "
            "(docs/multi-node.md)"
        )

    def check(self, tasks_parked: bool) -> None:
        """``check_stopped``, and tell the others when this node's tasks are parked for
        want of a worker (they wait for it)."""
        self.group.set_note(
            "no worker connected to its coordinator (tasks parked)" if tasks_parked else None
        )
        self.check_stopped()

    def check_stopped(self) -> None:
        """Raise JobPaused if another node left the job, went silent or failed a
        collective (Note [arrive before a collective]); JobCancelled if rank 0 cancelled
        it."""
        reducer = self.reducer
        problem = self.group.problem()
        if reducer is not None and reducer.error is not None:
            raise self.stopped(reducer.error)
        if problem is not None:
            raise self.stopped(GroupError(problem))

    def end(self) -> None:
        """The end of a run that trained all its steps. Rank 0, its model written, says
        the job is done; another node waits for that, as the job may yet fail at rank 0
        (it alone checks the whole weights at the last checkpoint), and ends as rank 0
        does: succeeded, or failed, cancelled or paused by ``check_stopped``'s rules."""
        if self.group.leader:
            self.group.finished()
            return
        try:
            self.group.wait_finished(
                "rank 0 to finish the job (its last checkpoint and model)",
                stopped=self.output.cancelled.is_set,
            )
        except InterruptedError:
            raise JobCancelled(f"job {self.job_id} was stopped") from None
        except GroupError as exc:
            raise self.stopped(exc) from None

    def start_reducer(
        self,
        layout: JobLayout,
        first_step: int,
        *,
        wait_grads: Callable[[int, int], None],
        grads: Callable[[int, int], list[torch.Tensor]],
        shards: ZeroShards | None = None,
    ) -> None:
        """Sum each layer's gradient of steps ``first_step`` .. ``train.steps`` over the
        nodes as soon as this node has it (``wait_grads``, ``grads``: the optimizer
        thread's), in a thread of its own."""
        self.group.cancelled = self.cancelled.is_set
        self.group.first_step = first_step
        # Note [gradient buckets]: a bucket of layers that share gradient slots would wait
        # for itself. Each node plans for its own workers, so the nodes agree first: one
        # layer per collective on every node if any node shares slots.
        shared = self.group.exchange(
            "grad-slots",
            "1" if layout.shares_grad_slots else "0",
            "whether any node shares gradient slots",
        )
        bucket_mb = bucket_cap_mb(self.spec.train.grad_bucket_mb, "1" in shared)
        self.reducer = GradientReducer(
            self.group,
            layers=sorted(layout.trainable_layers(), reverse=True),
            first_step=first_step,
            last_step=self.spec.train.steps,
            wait_grads=wait_grads,
            grads=grads,
            stopped=self.cancelled.is_set,
            wake=self.wake,
            shards=shards,
            transport=getattr(torch, self.spec.train.grad_transport),
            bucket_bytes=bucket_mb * 2**20,
        )
        self.reducer.start()

    def stop_reducer(self) -> None:
        """After the run: the reducer ends at once unless it is inside a collective,
        which ends within the collective timeout (the arenas must outlive it)."""
        reducer = self.reducer
        if reducer is None:
            return
        if not reducer.join(self.group.nodes.timeout_s + 10):
            log.error("[trainer] job %s: the all-reduce thread did not stop", self.job_id)

    def sync(
        self,
        *,
        layout: JobLayout,
        masters: Mapping[int, Mapping[str, torch.Tensor]],
        optimizer: LayerwiseOptimizer,
        dataset: PackedDataset,
        loader: DataLoader,
        progress: ProgressLog,
        start_step: int,
        shards: ZeroShards | None = None,
        full_masters: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
        full_moments: Mapping[str, torch.Tensor] | None = None,
        checkpointer: Checkpointer,
    ) -> int | None:
        """Make every node start from rank 0's state (Note [checkpoint cut]): the nodes
        check that they prepared the same job, then rank 0 broadcasts its step, data
        cursor and progress, and its masters, moments and both weight parities. Only rank
        0 reads checkpoints, so a checkpoint of any topology resumes on any other.
        Returns the step the other nodes now start after (None at rank 0).

        Sharded (``shards``): ``masters`` and the optimizer hold this node's pieces, and
        ``full_masters`` the whole masters this node loaded (rank 0: restored, with the
        moments in ``full_moments`` if it resumed). Rank 0's are broadcast one layer at a
        time, and every node keeps its pieces of them."""
        group = self.group
        assert layout.events is not None
        group.cancelled = self.cancelled.is_set
        whole = masters if shards is None else full_masters
        assert whole is not None
        trainable = sorted(
            (layer, name, tuple(t.shape)) for layer, d in whole.items() for name, t in d.items()
        )
        moments = optimizer.state_dict()["tensors"]
        fingerprint = json.dumps(
            {
                "data": dataset.fingerprint,
                "rows": dataset.num_rows,
                "tensors": hashlib.sha256(repr(trainable).encode()).hexdigest(),
                "moments": sorted(moments),
            },
            sort_keys=True,
        )
        state = ""
        if group.leader:
            state = json.dumps(
                {
                    "step": start_step,
                    "cursor": loader.state_dict(),
                    "progress": progress.rows(),
                    # Note [dynamic loss scaling]: the scale, and the updates applied
                    "loss_scale": checkpointer.loss_scale_state(start_step),
                }
            )
        try:
            found = group.exchange("prepared", fingerprint, "every node to prepare the job")
            for rank, theirs in enumerate(found):
                if theirs != found[0]:
                    raise JobFailed(
                        f"{group.nodes.describe(rank)} prepared different data or a different "
                        "model than rank 0 (dataset fingerprint or trainable tensors differ): "
                        "every node needs the same model, tokenizer and data files at the "
                        "same paths"
                    )
            leader_state = json.loads(group.exchange("state", state, "rank 0's state")[0])
            if shards is None:
                tensors = [masters[layer][name] for layer, name, _ in trainable]
                tensors += [moments[key] for key in sorted(moments)]
                for layer, name, _ in trainable:
                    tensors += [layout.view(ref) for ref in layout.params[layer][name] if ref]
                group.broadcast(tensors, "rank 0's training state")
            else:
                assert full_masters is not None
                resumed = int(leader_state["step"]) > 0
                self._sync_shards(
                    layout, masters, optimizer, shards, full_masters, full_moments, resumed
                )
        except GroupError as exc:
            raise self.stopped(exc) from None
        except InterruptedError:
            raise JobCancelled(f"job {self.job_id} was cancelled") from None
        if group.leader:
            return None
        s = int(leader_state["step"])
        try:
            loader.load_state_dict(leader_state["cursor"])
        except DataError as exc:
            raise JobFailed(f"this node's data differs from rank 0's: {exc}") from None
        updates = checkpointer.restore_loss_scale(leader_state["loss_scale"], s, "rank 0's state")
        optimizer_state = optimizer.state_dict()
        optimizer_state["steps"] = {layer: updates for layer in optimizer_state["steps"]}
        optimizer.load_state_dict(optimizer_state)
        for layer in masters:
            layout.events.signal(layout.counters.version(layer), s)
        progress.replace(leader_state["progress"])
        return s

    def _sync_shards(
        self,
        layout: JobLayout,
        masters: Mapping[int, Mapping[str, torch.Tensor]],
        optimizer: LayerwiseOptimizer,
        shards: ZeroShards,
        full_masters: Mapping[int, Mapping[str, torch.Tensor]],
        full_moments: Mapping[str, torch.Tensor] | None,
        resumed: bool,
    ) -> None:
        """``sync``'s broadcast with sharded state, layer by layer: rank 0's whole
        masters, moments (only when it resumed: else they are zero everywhere) and weight
        parities; each node keeps its pieces of the masters and moments."""
        live = optimizer.state_dict()["tensors"]
        for i, layer in enumerate(sorted(full_masters)):
            names = list(full_masters[layer])
            # rank 0's whole masters; elsewhere their shapes, received into this layer's
            # buffers (Note [sharded start-up] in roundpipe.coordinator.training.initial_weights)
            whole = {name: _buffer(full_masters[layer][name]) for name in names}
            tensors = list(whole.values())
            moments: list[tuple[str, torch.Tensor]] = []
            if resumed:
                for name in names:
                    for kind in optimizer.kinds:
                        key = f"{layer}.{name}.{kind}"
                        t = (
                            full_moments[key]  # read from the checkpoint now
                            if self.group.leader and full_moments is not None
                            else torch.empty(whole[name].shape, dtype=torch.float32)
                        )
                        moments.append((key, t))
            tensors += [t for _, t in moments]
            for name in names:
                tensors += [layout.view(ref) for ref in layout.params[layer][name] if ref]
            self.group.broadcast(tensors, "rank 0's training state", "state", i + 1)
            for name in names:
                masters[layer][name].copy_(shards.own(whole[name]))
            for key, t in moments:
                live[key].copy_(shards.own(t))
            del whole, tensors, moments


def _buffer(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a new tensor of its shape and dtype if ``t`` is a shape alone (meta)."""
    return torch.empty(t.shape, dtype=t.dtype) if t.is_meta else t
