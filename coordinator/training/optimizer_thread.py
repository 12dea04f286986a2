"""A job's optimizer thread: it updates the layers of step k as their gradients land,
while the workers already run step k+1 (Note [weight-update ordering] in
roundpipe.coordinator.training.schedule).

Per step it waits for each layer's gradient in the grads arena (both parts of it when a
split stage wrote it: Note [microbatch-split stages] in roundpipe.shared.plan; tied
contributions added in; with a data-parallel group, summed over the nodes first by the
``GradientReducer``), steps the ``LayerwiseOptimizer`` on every layer that has landed,
writes the compute-dtype weights of version k, and publishes ``version[l] = k`` at once,
so the next forward may start on that layer. The run loop waits for it (``wait_for``)
before a drained checkpoint and at the end of the run."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping

import torch

from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.training.job_errors import JobCancelled, JobFailed
from roundpipe.coordinator.training.layout import JobLayout
from roundpipe.coordinator.training.loss_scale import LossScaler
from roundpipe.coordinator.training.multinode import GradientReducer, GroupError
from roundpipe.coordinator.training.optimizer import (
    LayerwiseOptimizer,
    clip_coefficient,
    global_grad_norm,
)
from roundpipe.coordinator.training.sharded_optimizer import (
    ZeroShards,
    bucket_name,
    bucket_text,
)
from roundpipe.coordinator.training.snapshot import BackgroundCheckpoints
from roundpipe.coordinator.training.timeline import TimelineRecorder
from roundpipe.shared.model import LayeredModel

__all__ = ["OptimizerThread"]

log = logging.getLogger(__name__)


class OptimizerThread:
    """Applies one job's optimizer steps in a thread of its own (module docstring)."""

    def __init__(
        self,
        job_id: str,
        spec: JobSpec,
        *,
        model: LayeredModel,
        layout: JobLayout,
        masters: Mapping[int, Mapping[str, torch.Tensor]],
        optimizer: LayerwiseOptimizer,
        cancelled: threading.Event,
        wake: Callable[[str], None],
        shards: ZeroShards | None = None,
        loss_scaler: LossScaler | None = None,
        checkpoint_due: Callable[[int], bool] = lambda step: False,
    ):
        self.job_id = job_id
        self.loss_scaler = loss_scaler
        """float16 loss scaling (Note [dynamic loss scaling]); None: none."""
        self.checkpoint_due = checkpoint_due
        """Whether a checkpoint is taken after a step (its loss scale state is kept)."""
        self.shards = shards
        """Sharded optimizer state: ``masters`` and the optimizer hold this node's pieces
        only; each layer's weights are all-gathered before its version is published
        (Note [gathered before published]). None: replicated or one node."""
        self.spec = spec
        self.layout = layout
        self.masters = masters
        self.optimizer = optimizer
        self.cancelled = cancelled
        """Set when the job stops: the thread gives up waiting for gradients."""
        self.wake = wake
        """Wakes the run loop (with the reason) when the thread failed."""
        self.error: BaseException | None = None
        """What stopped the thread, surfaced by the run loop: JobPaused for a GroupError
        (a node lost inside a collective), else JobFailed."""
        self._done_step = 0
        self._first_step = 1
        self._first_update = 1
        """The optimizer update the run's first step applies (unless it is skipped)."""
        self._cv = threading.Condition()
        self._last_busy_s = 0.0
        """Busy seconds (updating, not waiting for gradients) of step ``_done_step``."""
        self._thread: threading.Thread | None = None
        self._timeline: TimelineRecorder | None = None
        self._reducer: GradientReducer | None = None
        self._background: BackgroundCheckpoints | None = None
        # Tied aliases: owner layer -> [(tail layer, alias name, owner name)].
        self._tied: dict[int, list[tuple[int, str, str]]] = {}
        for alias, owner in layout.tied_gradients():
            self._tied.setdefault(model.layer_of(owner), []).append(
                (model.layer_of(alias), alias, owner)
            )
        # Whole-tensor scratch, shaped as the gradient slots (a sharded node's masters
        # are pieces).
        self._tied_scratch = {
            owner: torch.empty_like(layout.view(layout.grads[layer][owner]))
            for layer, items in self._tied.items()
            for _, _, owner in items
        }
        # Note [microbatch-split stages] (roundpipe.shared.plan): the two parts of a
        # split layer's gradient are added out of place, so summing twice (clipping
        # reads the gradients before the update does) gives the same bits.
        self._split_scratch = {
            layer: {
                name: torch.empty_like(layout.view(layout.grads[layer][name])) for name in names
            }
            for layer, names in layout.grads_part.items()
            if layer in masters
        }
        self._split_layers_of_step: dict[int, frozenset[int]] = {}
        """Step -> the layers whose gradient comes in two parts that step (the plan of
        the step's tasks; the optimizer may still step k after a re-plan for k+1)."""

    # -- the run loop's side ----------------------------------------------------------

    def start(
        self,
        first_step: int,
        *,
        timeline: TimelineRecorder,
        reducer: GradientReducer | None,
        background: BackgroundCheckpoints | None,
    ) -> None:
        """Apply steps ``first_step`` .. ``train.steps`` in a new thread, recording on
        ``timeline``, with gradients summed by ``reducer`` (a group's) and each layer's
        update captured by ``background`` (Note [background checkpoint])."""
        self._done_step = first_step - 1
        self._first_step = first_step
        self._first_update = self._next_update
        self._timeline, self._reducer, self._background = timeline, reducer, background
        self._thread = threading.Thread(
            target=self._loop,
            args=(first_step,),
            name=f"rp-optimizer-{self.job_id}",
            daemon=True,
        )
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the thread after the job's ``cancelled`` event
        was set (it gives up waiting for gradients)."""
        with self._cv:
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def split_layers(self, k: int, layers: frozenset[int]) -> None:
        """Step k's gradient of each of ``layers`` comes in two parts (set as step k's
        tasks are built)."""
        self._split_layers_of_step[k] = layers
        self._split_layers_of_step.pop(k - 4, None)

    def wait_for(self, step: int, check: Callable[[], None]) -> None:
        """Wait until step ``step`` has been applied to every layer, calling ``check``
        (raises if the group stopped or this thread failed) twice a second. Raises
        JobFailed if the thread failed, JobCancelled if the job was cancelled."""
        with self._cv:
            while self._done_step < step:
                check()  # the optimizer waits for the group's gradients
                if self.error is not None:
                    raise JobFailed(f"optimizer failed: {self.error}")
                if self.cancelled.is_set():
                    raise JobCancelled(f"job {self.job_id} was cancelled")
                self._cv.wait(timeout=0.5)

    def latest_busy_s(self) -> float:
        """Busy seconds of the newest finished step (0.0 before any)."""
        with self._cv:
            return self._last_busy_s

    # -- the thread -------------------------------------------------------------------

    def _loop(self, first_step: int) -> None:
        """Apply steps first..K layer by layer as gradients complete (Note [weight-update
        ordering])."""
        try:
            for k in range(first_step, self.spec.train.steps + 1):
                busy_s = self._step(k)
                with self._cv:
                    self._done_step = k
                    self._last_busy_s = busy_s
                    self._cv.notify_all()
        except InterruptedError:
            pass  # cancelled while waiting for gradients
        except GroupError as exc:  # a node left mid-collective: the job pauses
            log.warning("[trainer] optimizer thread stopped: %s", exc)
            self.error = exc
            self.wake("optimizer error")
        except BaseException as exc:  # surfaced by the run loop as JobFailed
            log.exception("[trainer] optimizer thread failed")
            self.error = exc
            self.wake("optimizer error")

    def _step(self, k: int) -> float:
        """Step k for every layer: each time the highest layer not yet updated has its
        gradients, update it together with every other layer whose gradients have
        landed, in one multi-threaded pass (Note [chunked fused AdamW]), lowest layer
        first, publishing each layer's version as soon as it is written. With staleness 0
        the next forward needs layer 0 first, and its gradients land last. Returns the
        seconds spent updating (not waiting)."""
        layout, timeline = self.layout, self._timeline
        assert timeline is not None
        remaining = sorted(self.masters, reverse=True)  # the last layers finish first
        clip = self.spec.optimizer.grad_clip
        shards, scaler = self.shards, self.loss_scaler
        coef, scale = None, 1.0
        if clip is not None or scaler is not None:
            # The global norm needs every gradient of the step before any update.
            for layer in remaining:
                self._wait_grads(layer, k)
            step_grads = {layer: self._grads(layer, k) for layer in remaining}
            if shards is None:
                norm = global_grad_norm(step_grads)
            else:  # Note [clipping a sharded gradient]
                norm = shards.grad_norm(
                    step_grads,
                    "clip",
                    k - self._first_step + 1,
                    f"the gradient norm of step {k} from every node",
                )
            if scaler is not None:  # Note [dynamic loss scaling]
                scale = scaler.scale_of(k)  # before decide() forgets it
                coef = self._unscale(k, scale, norm, clip)
                if coef is None:
                    return self._skip(k)
            else:
                assert clip is not None
                coef = clip_coefficient(norm, clip)
        update = self._next_update
        # The all-gathers' round: steps that loss scaling skipped gather nothing, on
        # every node alike (the norm that decides is the group's).
        gather_round = update - self._first_update + 1
        busy_s = 0.0
        publish = self._publisher(k)
        # Sharded: the buckets whose weights are still to be gathered, in the reducer's
        # order, and the stepped layers' pieces waiting for theirs (Note [gathered
        # before published]).
        to_gather: list[tuple[int, ...]] = []
        if shards is not None:
            assert self._reducer is not None, "sharded optimizer state needs a group"
            to_gather = list(self._reducer.buckets)
        stepped: dict[int, list[torch.Tensor]] = {}
        while remaining:
            self._wait_grads(remaining[0], k)
            ready = [layer for layer in remaining if self._grads_landed(layer, k)]
            grads = {layer: self._grads(layer, k) for layer in ready}
            outs = {
                layer: {
                    name: layout.view(layout.params[layer][name][k % 2])
                    for name in self.masters[layer]
                }
                for layer in ready
            }
            if shards is not None:  # this node's pieces only (sharded_optimizer)
                grads = {
                    layer: {name: shards.own(g) for name, g in per.items()}
                    for layer, per in grads.items()
                }
                pieces = {
                    layer: {name: shards.own(o) for name, o in per.items()}
                    for layer, per in outs.items()
                }
            for layer in ready:  # observability: grad norm (TensorBoard; a shard's)
                timeline.layer_grads(k, grads[layer], scale=scale)
            started = time.perf_counter()
            self.optimizer.step_layers(
                grads,
                update,
                clip_coef=coef,
                outs=outs if shards is None else pieces,
                on_layer_done=publish if shards is None else None,
            )
            if shards is not None:
                # Note [gathered before published]: bucket by bucket, as on every node.
                stepped.update((layer, list(outs[layer].values())) for layer in ready)
                while to_gather and all(layer in stepped for layer in to_gather[0]):
                    bucket = to_gather.pop(0)
                    shards.all_gather(
                        [t for layer in bucket for t in stepped.pop(layer)],
                        bucket_name("weights", bucket),
                        gather_round,
                        f"{bucket_text(bucket)}'s weights of step {k} from every node",
                        step=k,
                    )
                    for layer in bucket:
                        publish(layer)
            busy_s += time.perf_counter() - started
            remaining = [layer for layer in remaining if layer not in ready]
        # Every bucket's layers are stepped by now; one left over would never publish.
        assert not to_gather, f"buckets {to_gather} hold layers the optimizer does not step"
        return busy_s

    @property
    def _next_update(self) -> int:
        """The optimizer update this step applies: one more than the last (the step
        itself, unless loss scaling skipped steps: Note [dynamic loss scaling])."""
        return self.optimizer.last_step(next(iter(self.masters))) + 1

    def _unscale(
        self, k: int, scale: float, norm: torch.Tensor, clip: float | None
    ) -> torch.Tensor | None:
        """Decide step k, seeded with ``scale``, on the global ``norm`` of its scaled
        gradients: None
        when it overflowed (skipped), else the coefficient that unscales (and clips)
        them. The next step's scale is published at once (Note [dynamic loss
        scaling])."""
        scaler = self.loss_scaler
        assert scaler is not None and self.layout.events is not None
        applied = scaler.decide(k, bool(torch.isfinite(norm)))
        scaler.publish(self.layout.events, self.layout.counters)
        if self.checkpoint_due(k):
            scaler.snapshot(k)
        if not applied:
            log.info(
                "[trainer] job %s: step %d's gradients overflowed at loss scale %g: "
                "step skipped; step %d on uses loss scale %g",
                self.job_id,
                k,
                scale,
                k + 1 + scaler.staleness,  # the next step to be given one
                2.0**scaler.exponent,
            )
            return None
        # GradScaler's unscale: a float32 reciprocal (exact: a power of two).
        inverse = torch.tensor(1.0 / scale, dtype=torch.float32)
        if clip is None:
            return inverse
        return inverse * clip_coefficient(norm * inverse, clip)

    def _skip(self, k: int) -> float:
        """Step k overflowed: every layer keeps its weights, published as version k (the
        second weight copy, when there is one, gets version k-1's: Note [weight
        copies] in roundpipe.coordinator.training.layout). Returns the busy seconds."""
        started = time.perf_counter()
        layout, publish = self.layout, self._publisher(k)
        for layer in sorted(self.masters):
            for name in self.masters[layer]:
                current, previous = (
                    layout.params[layer][name][k % 2],
                    layout.params[layer][name][(k - 1) % 2],
                )
                assert current is not None and previous is not None
                if current != previous:
                    layout.view(current).copy_(layout.view(previous))
            publish(layer)
        return time.perf_counter() - started

    def _publisher(self, k: int) -> Callable[[int], None]:
        """Called as each layer's step-k update is written: publish its version at once
        (the next forward may start on it), capture it for a background checkpoint of
        step k, and time it for the timeline's optimizer lane."""
        assert self.layout.events is not None and self._timeline is not None
        events, c, timeline = self.layout.events, self.layout.counters, self._timeline
        since = time.time()

        background = self._background

        def publish(layer: int) -> None:
            nonlocal since
            events.signal(c.version(layer), k)
            if background is not None:  # Note [background checkpoint]
                background.capture(k, layer)
            now = time.time()
            timeline.optimizer_layer(k, layer, since, now)  # observability
            since = now

        return publish

    def _grads_landed(self, layer: int, k: int) -> bool:
        """Whether step k's gradients of ``layer`` (tied contributions included) are in
        (with a group: summed over the nodes, Note [reduced before stepped])."""
        assert self.layout.events is not None
        c, events = self.layout.counters, self.layout.events
        sources = {layer} | {t for t, _, _ in self._tied.get(layer, [])}
        if self._reducer is not None:
            return all(self._reducer.reduced(src, k) for src in sources)
        return all(
            events.read(c.wgrad(src)) >= k
            and (not self._split_at(src, k) or events.read(c.wgrad_part(src)) >= k)
            for src in sources
        )

    def _split_at(self, layer: int, k: int) -> bool:
        """Whether step k's gradient of ``layer`` comes in two parts (Note
        [microbatch-split stages] in roundpipe.shared.plan). Asked only once ``wgrad[l]
        >= k``, so after step k's tasks were built."""
        return layer in self._split_layers_of_step.get(k, ())

    def _wait_grads(self, layer: int, k: int) -> None:
        """Wait for step k's gradients of ``layer``, including tied contributions."""
        sources = {layer} | {t for t, _, _ in self._tied.get(layer, [])}
        if self._reducer is not None:
            for src in sources:
                self._reducer.wait_reduced(src, k)
            return
        for src in sources:
            self.wait_local_grads(src, k)

    def wait_local_grads(self, layer: int, k: int) -> None:
        """Wait until this node's step-k gradient of ``layer`` is in the grads arena
        (both parts of it when a split stage wrote it). The group reducer waits with
        this too."""
        assert self.layout.events is not None
        events, counters = self.layout.events, self.layout.counters

        def wait(counter: int) -> None:
            # No deadline: a step may wait any time for its gradients (its tasks parked
            # while no worker is connected, a slow step on CPU workers). A task that does
            # not progress is the task tracker's to find (its progress deadline), a
            # silent node the group's; this wait ends when the job stops.
            events.wait_at_least(counter, k, timeout_s=math.inf, should_abort=self.cancelled.is_set)

        wait(counters.wgrad(layer))
        if self._split_at(layer, k):  # known once wgrad[l] >= k
            wait(counters.wgrad_part(layer))

    def _split_sum(self, layer: int) -> dict[str, torch.Tensor]:
        """A split layer's gradient, first part + second (Note [microbatch-split stages]
        in roundpipe.shared.plan), added out of place into its scratch: summing again
        gives the same bits."""
        layout = self.layout
        first, second = layout.grads[layer], layout.grads_part[layer]
        scratch = self._split_scratch[layer]
        for name, out in scratch.items():
            torch.add(layout.view(first[name]), layout.view(second[name]), out=out)
        return scratch

    def node_grads(self, layer: int, k: int) -> list[torch.Tensor]:
        """What the group reducer all-reduces in place for step k: this node's gradient
        of ``layer``, its two parts added first when split, so that every node reduces
        one tensor per weight whatever its plan (nodes plan for their own workers)."""
        if self._split_at(layer, k):
            return list(self._split_sum(layer).values())
        return [self.layout.view(ref) for ref in self.layout.grads[layer].values()]

    def _grads(self, layer: int, k: int) -> dict[str, torch.Tensor]:
        """Layer's step-k gradients as fp32 views; a split stage's two parts (Note
        [microbatch-split stages] in roundpipe.shared.plan; with a group the reducer
        added them before reducing) and tied contributions summed into scratch."""
        layout = self.layout
        grads = {name: layout.view(layout.grads[layer][name]) for name in self.masters[layer]}
        if self._split_at(layer, k):
            summed = self._split_scratch[layer] if self._reducer else self._split_sum(layer)
            grads.update(summed)
        for tail_layer, alias, owner in self._tied.get(layer, []):
            total = self._tied_scratch[owner]
            torch.add(grads[owner], layout.view(layout.grads[tail_layer][alias]), out=total)
            grads[owner] = total
        return grads
