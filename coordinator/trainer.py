"""One training job, start to finish, without sockets.

``Trainer`` owns a job's state: the model description, the arenas (via ``JobLayout``),
the fp32 masters and the layer-wise AdamW, the data loader. ``run`` drives iterations:
it writes each global batch into the io arena, builds the iteration's StageTasks
(roundpipe.coordinator.schedule) and hands them to workers round-robin through a
``dispatch`` callback, with a task counter that persists across iterations. Workers report
completions into ``inbox``. A separate optimizer thread updates layers as their gradients
complete (Note [weight-update ordering]).

The coordinator daemon runs a Trainer in a job thread and connects ``dispatch``/``inbox``
to ZeroMQ; tests connect them to in-process ``WorkerCore`` threads.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from roundpipe.coordinator.data import DataLoader, build_dataset_from_spec
from roundpipe.coordinator.jobspec import JobSpec, model_config_from_spec, validate_against_model
from roundpipe.coordinator.layout import JobLayout
from roundpipe.coordinator.optimizer import LayerwiseAdamW, clip_coefficient, global_grad_norm
from roundpipe.coordinator.schedule import ScheduleBuilder
from roundpipe.protocol import JobSetup, ProgressEvent, StageTask, TaskDone, TaskFailed
from roundpipe.shared.model import LayeredModel
from roundpipe.shared.plan import Plan
from roundpipe.worker.runtime import model_config_dict

__all__ = ["JobCancelled", "JobFailed", "Trainer", "default_plan"]

log = logging.getLogger(__name__)


class JobFailed(RuntimeError):
    """The job cannot continue; the message says why and what to do."""


class JobCancelled(RuntimeError):
    """The job was cancelled by a client."""


def default_plan(num_layers: int, num_workers: int) -> Plan:
    """Cold-start plan before any measurement.

    The tail fuses the last decoder layer with the head; forward stages are as many as
    the workers (round-robin keeps them all busy), backward stages twice as many because
    recompute + backward costs about three forward passes (asymmetric partition).
    """
    tail_layers = 2 if num_layers >= 4 else 1
    before_tail = num_layers - tail_layers
    if before_tail == 0:
        return Plan(forward=(), tail=(0, num_layers), backward=())
    num_forward = max(1, min(before_tail, num_workers))
    num_backward = max(1, min(before_tail, 2 * num_forward))
    return Plan.uniform(
        num_layers, num_forward=num_forward, num_backward=num_backward, tail_layers=tail_layers
    )


@dataclass
class _InFlight:
    task: StageTask
    worker_id: int


class Trainer:
    """Runs one job. Build, ``prepare()``, then ``run(...)``; always ``close()``."""

    def __init__(
        self,
        job_id: str,
        spec: JobSpec,
        *,
        arena_dir: str | Path,
        namespace: str,
        output_dir: Path,
        wait_timeout_s: float = 600.0,
        optimizer_impl: str = "fused",
    ):
        self.job_id = job_id
        self.spec = spec
        self.arena_dir = Path(arena_dir)
        self.namespace = namespace
        self.output_dir = output_dir
        self.wait_timeout_s = wait_timeout_s
        self.optimizer_impl = optimizer_impl
        self.inbox: queue.Queue[TaskDone | TaskFailed | str] = queue.Queue()
        self.progress: list[ProgressEvent] = []
        self.progress_lock = threading.Lock()
        self.step = 0
        self.last_loss: float | None = None
        self._cancel = threading.Event()
        self._optimizer_error: BaseException | None = None
        self._optimizer_done_step = 0
        self._optimizer_cv = threading.Condition()
        self.layout: JobLayout | None = None

    # -- preparation ------------------------------------------------------------------

    def prepare(self, num_workers: int) -> None:
        """Load the model and data, validate against each other, lay out the arenas."""
        spec = self.spec
        config = model_config_from_spec(spec.model)
        lora = None
        if spec.lora is not None:
            lora = {
                "r": spec.lora.r,
                "alpha": spec.lora.alpha,
                "dropout": spec.lora.dropout,
                "target_modules": spec.lora.target_modules,
            }
        if spec.model.path is not None:
            model = LayeredModel.from_hf_dir(spec.model.path, lora)
            weights = model.load_weights(dtype=torch.float32, seed=spec.init_seed)
        else:
            model = LayeredModel(config, lora)
            weights = model.init_weights(spec.init_seed)
        self.dataset = build_dataset_from_spec(spec)
        validate_against_model(spec, model.config, vocab_size_needed=self.dataset.vocab_size_needed)
        self.loader = DataLoader.from_spec(spec, self.dataset)
        self.model = model
        self.compute_dtype = getattr(torch, spec.train.dtype)
        plan_text = getattr(spec.train, "plan", None)
        self.plan = (
            Plan.parse(plan_text) if plan_text else default_plan(model.num_layers, num_workers)
        )
        self.plan.validate(model.num_layers)
        layout = JobLayout.plan_layout(
            model,
            self.plan,
            compute_dtype=self.compute_dtype,
            microbatch_rows=spec.batch.microbatch_size,
            seq_len=spec.data.seq_len,
            num_microbatches=spec.batch.num_microbatches,
        )
        layout.create(self.arena_dir, self.namespace)
        self.layout = layout
        # fp32 masters (coordinator memory) and W_0 in params parity 0.
        self.masters: dict[int, dict[str, torch.Tensor]] = {}
        for layer, names in layout.params.items():
            trainable = {s.name for s in model.layer_params(layer) if s.trainable}
            for name, (even, _odd) in names.items():
                w = weights[layer][name]
                layout.view(even).copy_(w)
                if name in trainable:
                    self.masters.setdefault(layer, {})[name] = w.to(torch.float32).clone()
        del weights
        self.optimizer = LayerwiseAdamW.from_spec(spec, self.masters, impl=self.optimizer_impl)
        self.schedule = ScheduleBuilder(
            layout=layout,
            job_id=self.job_id,
            staleness=spec.train.staleness,
            seed=spec.train.seed,
            wait_timeout_s=self.wait_timeout_s,
        )
        # Tied aliases: owner layer -> [(tail layer, alias name, owner name)].
        self._tied: dict[int, list[tuple[int, str, str]]] = {}
        for alias, owner in model.tied_params.items():
            if alias in layout.grads[model.layer_of(alias)]:
                self._tied.setdefault(model.layer_of(owner), []).append(
                    (model.layer_of(alias), alias, owner)
                )
        self._tied_scratch = {
            owner: torch.empty_like(self.masters[layer][owner])
            for layer, items in self._tied.items()
            for _, _, owner in items
        }
        log.info(
            "[trainer] job %s: %s, %d layers, plan %s, %d trainable tensors",
            self.job_id,
            model.architecture,
            model.num_layers,
            self.plan,
            sum(len(v) for v in self.masters.values()),
        )

    def job_setup(self) -> JobSetup:
        assert self.layout is not None
        return JobSetup(
            job_id=self.job_id,
            model_config=model_config_dict(self.model.config),
            lora=None
            if self.model.lora is None
            else {
                "r": self.model.lora.r,
                "alpha": self.model.lora.alpha,
                "dropout": self.model.lora.dropout,
                "target_modules": list(self.model.lora.target_modules)
                if not isinstance(self.model.lora.target_modules, str)
                else self.model.lora.target_modules,
            },
            compute_dtype=self.spec.train.dtype,
            arenas=self.layout.arena_infos(),
            layers=self.layout.layer_layouts(),
        )

    # -- running ----------------------------------------------------------------------

    def cancel(self) -> None:
        self._cancel.set()
        self.inbox.put("cancel")

    def run(
        self,
        dispatch: Callable[[StageTask, int], None],
        workers: Callable[[], list[int]],
        on_progress: Callable[[ProgressEvent], None] | None = None,
    ) -> None:
        """Train for ``spec.train.steps`` iterations. Raises JobFailed / JobCancelled."""
        assert self.layout is not None
        layout, spec = self.layout, self.spec
        steps = spec.train.steps
        optimizer_thread = threading.Thread(
            target=self._optimizer_loop, name=f"rp-optimizer-{self.job_id}", daemon=True
        )
        optimizer_thread.start()
        in_flight: dict[int, _InFlight] = {}
        pending_per_iteration: dict[int, int] = {}
        tail_task: dict[int, int] = {}
        round_robin = 0
        next_task_id = 0
        tokens_per_step = spec.global_batch_size * spec.data.seq_len
        started = time.perf_counter()
        last_time = started
        completed_iterations = 0
        try:
            for k in range(1, steps + 1):
                # Note [weight-update ordering], point 5: iteration k reuses k-2's slots.
                while pending_per_iteration.get(k - 2, 0) > 0:
                    self._handle(self._next_message(), in_flight, pending_per_iteration)
                batch = self.loader.batch_for_step(k)
                parity = k % 2
                for m, (ids, labels) in enumerate(batch.microbatches):
                    layout.view(layout.input_ids[(parity, m)]).copy_(ids)
                    layout.view(layout.labels[(parity, m)]).copy_(labels)
                assert layout.events is not None
                for m in range(layout.num_microbatches):
                    layout.events.signal(layout.counters.act(0, m), k)
                tasks = self.schedule.tasks(k, batch.num_label_tokens, next_task_id)
                next_task_id += len(tasks)
                pending_per_iteration[k] = len(tasks)
                for task in tasks:
                    if task.kind == "tail":
                        tail_task[k] = task.task_id
                    live = workers()
                    if not live:
                        raise JobFailed("no worker is connected; start `roundpipe-worker`")
                    worker_id = live[round_robin % len(live)]
                    round_robin += 1
                    in_flight[task.task_id] = _InFlight(task, worker_id)
                    dispatch(task, worker_id)
                # Report every iteration whose tail has finished.
                while completed_iterations < k - 1 and self._tail_done(
                    completed_iterations + 1, tail_task, in_flight
                ):
                    completed_iterations += 1
                    last_time = self._report(
                        completed_iterations, tokens_per_step, last_time, on_progress
                    )
            while any(pending_per_iteration.values()):
                self._handle(self._next_message(), in_flight, pending_per_iteration)
                while completed_iterations < steps and self._tail_done(
                    completed_iterations + 1, tail_task, in_flight
                ):
                    completed_iterations += 1
                    last_time = self._report(
                        completed_iterations, tokens_per_step, last_time, on_progress
                    )
            self._wait_optimizer(steps)
        finally:
            self._cancel.set()
            with self._optimizer_cv:
                self._optimizer_cv.notify_all()
            optimizer_thread.join(timeout=30)
        log.info(
            "[trainer] job %s finished %d steps in %.1fs",
            self.job_id,
            steps,
            time.perf_counter() - started,
        )

    def _tail_done(self, k: int, tail_task: dict[int, int], in_flight: dict) -> bool:
        return k in tail_task and tail_task[k] not in in_flight

    def _report(self, k: int, tokens: int, last_time: float, on_progress) -> float:
        assert self.layout is not None
        parity = k % 2
        loss = sum(
            float(self.layout.view(self.layout.loss[(parity, m)]))
            for m in range(self.layout.num_microbatches)
        )
        now = time.perf_counter()
        self.step = k
        self.last_loss = loss
        event = ProgressEvent(
            seq=k,
            step=k,
            loss=loss,
            tokens_per_s=tokens / max(now - last_time, 1e-9),
            lr=self.optimizer.lr_at(k),
            time=time.time(),
        )
        with self.progress_lock:
            self.progress.append(event)
        if on_progress is not None:
            on_progress(event)
        log.info("[trainer] job %s step %d loss %.4f", self.job_id, k, loss)
        return now

    def _next_message(self) -> TaskDone | TaskFailed | str:
        while True:
            if self._optimizer_error is not None:
                raise JobFailed(f"optimizer failed: {self._optimizer_error}") from (
                    self._optimizer_error
                )
            if self._cancel.is_set():
                raise JobCancelled(f"job {self.job_id} was cancelled")
            try:
                return self.inbox.get(timeout=0.5)
            except queue.Empty:
                continue

    def _handle(self, msg, in_flight: dict[int, _InFlight], pending: dict[int, int]) -> None:
        if isinstance(msg, str):
            if msg.startswith("worker-lost:"):
                lost = int(msg.split(":", 1)[1])
                stranded = [f.task.task_id for f in in_flight.values() if f.worker_id == lost]
                if stranded:
                    raise JobFailed(
                        f"worker {lost} was lost with {len(stranded)} task(s) in flight "
                        f"(first: {stranded[0]}); restart the worker and resubmit the job"
                    )
            return  # other wake-ups (cancel, optimizer error) are checked by _next_message
        entry = in_flight.get(msg.task_id)
        if entry is None:
            return  # a duplicate completion (e.g. a re-run finishing late)
        if isinstance(msg, TaskFailed):
            raise JobFailed(
                f"task {msg.task_id} ({entry.task.kind} layers "
                f"{entry.task.layer_start}:{entry.task.layer_stop}, iteration "
                f"{entry.task.iteration}) failed on worker {msg.worker_id}: "
                f"{msg.error_type}: {msg.message}"
            )
        del in_flight[msg.task_id]
        pending[entry.task.iteration] -= 1

    # -- optimizer --------------------------------------------------------------------

    def _optimizer_loop(self) -> None:
        """Apply steps 1..K layer by layer as gradients complete (Note [weight-update ordering])."""
        try:
            for k in range(1, self.spec.train.steps + 1):
                self._optimizer_step(k)
                with self._optimizer_cv:
                    self._optimizer_done_step = k
                    self._optimizer_cv.notify_all()
        except InterruptedError:
            pass  # cancelled while waiting for gradients
        except BaseException as exc:  # surfaced by the run loop as JobFailed
            log.exception("[trainer] optimizer thread failed")
            self._optimizer_error = exc
            self.inbox.put("optimizer-error")

    def _optimizer_step(self, k: int) -> None:
        assert self.layout is not None and self.layout.events is not None
        layout, events, c = self.layout, self.layout.events, self.layout.counters
        owner_layers = sorted(self.masters, reverse=True)  # the last layers finish first
        clip = self.spec.optimizer.grad_clip
        grads_of: dict[int, dict[str, torch.Tensor]] = {}
        coef = None
        if clip is not None:
            # The global norm needs every gradient of the step before any update.
            for layer in owner_layers:
                self._wait_grads(layer, k)
            grads_of = {layer: self._grads(layer) for layer in owner_layers}
            coef = clip_coefficient(global_grad_norm(grads_of), clip)
        for layer in owner_layers:
            if clip is None:
                self._wait_grads(layer, k)
            grads = grads_of.get(layer) or self._grads(layer)
            out = {
                name: layout.view(layout.params[layer][name][k % 2]) for name in self.masters[layer]
            }
            self.optimizer.step_layer(layer, grads, k, clip_coef=coef, out=out)
            events.signal(c.version(layer), k)

    def _wait_grads(self, layer: int, k: int) -> None:
        """Wait for step k's gradients of ``layer``, including tied contributions."""
        assert self.layout is not None and self.layout.events is not None
        c = self.layout.counters
        for src in {layer} | {t for t, _, _ in self._tied.get(layer, [])}:
            self.layout.events.wait_at_least(
                c.wgrad(src),
                k,
                timeout_s=self.wait_timeout_s * 4,
                should_abort=self._cancel.is_set,
            )

    def _grads(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer's gradients as fp32 views, tied contributions summed into scratch."""
        assert self.layout is not None
        layout = self.layout
        grads = {name: layout.view(layout.grads[layer][name]) for name in self.masters[layer]}
        for tail_layer, alias, owner in self._tied.get(layer, []):
            total = self._tied_scratch[owner]
            torch.add(grads[owner], layout.view(layout.grads[tail_layer][alias]), out=total)
            grads[owner] = total
        return grads

    def _wait_optimizer(self, step: int) -> None:
        with self._optimizer_cv:
            while self._optimizer_done_step < step:
                if self._optimizer_error is not None:
                    raise JobFailed(f"optimizer failed: {self._optimizer_error}")
                self._optimizer_cv.wait(timeout=0.5)

    # -- results ----------------------------------------------------------------------

    def final_weights(self) -> dict[int, dict[str, torch.Tensor]]:
        """fp32 masters for trainable weights, params-arena copies for frozen ones."""
        assert self.layout is not None
        out: dict[int, dict[str, torch.Tensor]] = {}
        for layer, names in self.layout.params.items():
            out[layer] = {}
            for name, (even, _odd) in names.items():
                if name in self.masters.get(layer, {}):
                    out[layer][name] = self.masters[layer][name].clone()
                else:
                    out[layer][name] = self.layout.view(even).to(torch.float32).clone()
        return out

    def export(self, directory: Path) -> Path:
        """Write the final model in Hugging Face layout; a PEFT adapter directory for LoRA.

        A LoRA adapter names its base model (``base_model_name_or_path``): the job's local
        model directory, or, for a randomly initialised base, a full copy written to
        ``<directory>/base_model`` so that ``AutoPeftModelForCausalLM.from_pretrained``
        works offline.
        """
        directory.mkdir(parents=True, exist_ok=True)
        model = self.model.to_hf_model(self.final_weights())
        if self.model.lora is not None:
            if self.spec.model.path is not None:
                base_dir = Path(self.spec.model.path).resolve()
            else:
                base_dir = (directory / "base_model").resolve()
            for config in model.peft_config.values():
                config.base_model_name_or_path = str(base_dir)
            model.save_pretrained(str(directory))
            if self.spec.model.path is None:
                model.unload().save_pretrained(str(base_dir))
        else:
            model.save_pretrained(str(directory))
        tokenizer_dir = self.spec.tokenizer_path
        if tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
            from roundpipe.coordinator.data import load_tokenizer

            load_tokenizer(tokenizer_dir).save_pretrained(str(directory))
        return directory

    def close(self) -> None:
        self._cancel.set()
        if self.layout is not None:
            self.layout.destroy()
            self.layout = None
