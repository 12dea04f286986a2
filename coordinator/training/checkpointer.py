"""Writing a job's checkpoints and restoring a job from one (the file format is
roundpipe.coordinator.training.checkpoint's; docs/checkpoints.md).

Every ``output.checkpoint_every`` steps and after the last step the trainer writes the
model in Hugging Face layout (roundpipe.coordinator.training.exporter) plus the training
state as of the cut (Note [checkpoint cut]): captured layer by layer as the optimizer
updates them and written by a background thread while training goes on
(roundpipe.coordinator.training.snapshot, Note [background checkpoint]), or, without
staging memory, with the pipeline drained. ``prepare`` resumes from the job's newest
good checkpoint, or from ``model.resume_from``.

Note [checkpoint cut]
~~~~~~~~~~~~~~~~~~~~~
A checkpoint "after step s" holds the state at a cut where every task of iterations
<= s has completed, the optimizer has applied step s to every layer, and no task of
iteration s+1 has been sent. A drained checkpoint stops dispatching until that holds
(the workers idle for the length of the write); a background one assembles the same
state per layer while training runs on (Note [background checkpoint] in
roundpipe.coordinator.training.snapshot). At the cut the state is:

* the fp32 masters W_s (stored once, as the model files' tensors) and the AdamW
  moments and step counts after step s;
* params[s % 2] = compute-dtype W_s (a cast of the masters, recomputed on load);
* params[(s-1) % 2] = compute-dtype W_{s-1}. With staleness 1 iteration s+1 computes
  its gradient on W_{s-1} (Note [weight-update ordering]), so it is saved
  (``prev/<name>``); this is the "in-flight delayed gradient" of the uninterrupted run,
  stored as the weights it is computed from. At staleness 0 the job keeps one weight
  copy (Note [weight copies] in roundpipe.coordinator.training.layout), so ``prev`` holds W_s
  (manifest ``prev_version``); resumed under staleness 1, iterations s+1 and s+2 then
  both compute on W_s, as iterations 1 and 2 of a fresh run both compute on W_0;
* the data cursor (next step s+1; ``batch_for_step`` is a pure function of the step),
  the learning-rate schedule position (step s; the schedule is a pure function of the
  step), and the RNG state (workers seed dropout from (seed, iteration, layer,
  microbatch), so the only process RNG is the coordinator's torch CPU generator, saved
  and restored although the loop draws nothing from it).

Resuming rebuilds exactly this: masters, moments, both parities, ``version[l] = s`` in
the fresh event table, the cursor; iteration s+1 then runs as it would have. Nothing in
it depends on the plan or on the workers, so a checkpoint taken with 3 workers resumes
with 1 or 2 (the plan is chosen afresh).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import torch

from roundpipe.coordinator.spec.checkpoint_format import CheckpointError, CheckpointInfo
from roundpipe.coordinator.spec.data import DataLoader
from roundpipe.coordinator.spec.errors import DataError
from roundpipe.coordinator.spec.jobspec import JobSpec, describe_base, optimizer_state_kind
from roundpipe.coordinator.spec.paths import modes
from roundpipe.coordinator.training.checkpoint import (
    PROGRESS_FILE,
    STATE_FILE,
    CheckpointDir,
    StreamedTensors,
    as_os_error,
    resolve_checkpoint,
    save_tensor_stream,
    save_tensors,
)
from roundpipe.coordinator.training.divergence import check_masters
from roundpipe.coordinator.training.exporter import ModelExporter
from roundpipe.coordinator.training.job_errors import JobCancelled, JobFailed, JobPaused
from roundpipe.coordinator.training.job_events import CheckpointWritten, JobEvent
from roundpipe.coordinator.training.job_output import JobOutput
from roundpipe.coordinator.training.layout import JobLayout
from roundpipe.coordinator.training.loss_scale import LossScaler
from roundpipe.coordinator.training.memory import weight_copies
from roundpipe.coordinator.training.optimizer import LayerwiseOptimizer
from roundpipe.coordinator.training.progress_log import COLUMNS, ProgressLog
from roundpipe.coordinator.training.quantized_state import (
    SIGNED_MAP,
    UNSIGNED_MAP,
    square_to_root_,
)
from roundpipe.coordinator.training.snapshot import BackgroundCheckpoints, LayerState
from roundpipe.shared.model import LayeredModel

__all__ = ["Checkpointer"]

log = logging.getLogger(__name__)


@dataclass(eq=False, repr=False)
class Checkpointer:
    """Writes and restores one prepared job's checkpoints (Note [checkpoint cut]).

    The state it saves and restores is the job's own, shared, not copied: the masters,
    the optimizer, the arenas of ``layout``, the data ``loader``, the ``progress`` and
    the ``plan_history`` (appended to by the trainer)."""

    job_id: str
    spec: JobSpec
    _: KW_ONLY
    model: LayeredModel
    layout: JobLayout
    masters: Mapping[int, Mapping[str, torch.Tensor]]
    optimizer: LayerwiseOptimizer
    optimizer_impl: str
    loader: DataLoader
    progress: ProgressLog
    plan_history: list[tuple[int, str, str]]
    output: JobOutput
    exporter: ModelExporter
    emit: Callable[[JobEvent], None]
    """Announces ``CheckpointWritten`` for background checkpoints (``settle_background``)."""
    loss_scaler: LossScaler | None = None
    """float16 loss scaling, whose state a checkpoint stores (Note [dynamic loss
    scaling])."""
    skipped_before: int = field(default=0, init=False)
    """Steps skipped by the loss scaler before the step this run started after: the
    optimizer's update count is the step less these (without a scaler in this run)."""
    resumed_from: CheckpointInfo | None = field(default=None, init=False)
    background: BackgroundCheckpoints | None = field(default=None, init=False)
    """The background writer while ``run`` uses one (Note [background checkpoint])."""

    def due(self, step: int) -> bool:
        """Whether a checkpoint is written after ``step``: every ``checkpoint_every``
        steps, and after the last one."""
        every = self.spec.output.checkpoint_every
        return step == self.spec.train.steps or (every > 0 and step % every == 0)

    # -- resuming (Note [checkpoint cut]) ---------------------------------------------

    def resume_source(self) -> CheckpointInfo | None:
        """This job's newest good checkpoint, else ``model.resume_from``, else None."""
        own = self.output.checkpoints.find_latest(job_id=self.job_id)
        if own is not None:
            return own
        if self.spec.model.resume_from is not None:
            try:
                return resolve_checkpoint(self.spec.model.resume_from)
            except CheckpointError as exc:
                raise JobFailed(f"model.resume_from: {exc}") from None
        return None

    def restore(
        self,
        info: CheckpointInfo,
        *,
        masters: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
        stream_moments: bool = False,
    ) -> CheckpointMoments | None:
        """Load checkpoint ``info`` into the job's state: masters, optimizer, both weight
        parities and their versions, data cursor, RNG and progress. The caller then
        starts the run after ``info.step``. ``masters``, if given, receive the whole
        tensors instead of the job's own (a sharded node's are pieces: roundpipe.
        coordinator.training.sharded_optimizer). ``stream_moments``: the optimizer's
        states are not loaded but returned as a reader of them, one tensor at a time
        (Note [sharded start-up]); the optimizer gets only the step count."""
        assert self.layout.events is not None
        masters = self.masters if masters is None else masters
        layout, s, manifest = self.layout, info.step, info.manifest
        steps = self.spec.train.steps
        if s > steps:
            raise JobFailed(
                f"checkpoint {info.path} is at step {s}, past this job's train.steps "
                f"({steps}); set train.steps above {s} to train further"
            )
        where = f"checkpoint {info.path}"
        cursor = manifest.get("data_cursor")
        if not isinstance(cursor, dict) or cursor.get("next_step") != s + 1:
            got = cursor.get("next_step") if isinstance(cursor, dict) else None
            raise JobFailed(
                f"{where} is damaged: it is at step {s}, but its data cursor continues at "
                f"step {got!r} (expected {s + 1}); resume from another checkpoint"
            )
        updates = self.restore_loss_scale(manifest.get("loss_scale"), s, where)
        from safetensors import safe_open

        try:
            state = safe_open(str(info.path / STATE_FILE), framework="pt")
        except Exception as exc:
            raise JobFailed(f"cannot read {info.path / STATE_FILE}: {exc}") from None
        with state:
            keys = set(state.keys())
            # 8-bit states written before Note [8-bit second moment] (in
            # roundpipe.coordinator.training.optimizer) hold v's codes: read under the
            # new kinds' names, converted once loaded.
            stored_names: dict[str, str] = {}
            if "exp_avg_sqrt" in self.optimizer.kinds:
                for k in [k for k in keys if k.startswith(("exp_avg_sq/", "exp_avg_sq_absmax/"))]:
                    new = "exp_avg_sqrt" + k[len("exp_avg_sq") :]
                    stored_names[new] = k
                    keys.remove(k)
                    keys.add(new)
            # Masters are in the model files (checkpoint_name keys); checkpoints written
            # before that hold them as master/<name> too.
            masters_in_state = any(k.startswith("master/") for k in keys)
            kinds = ("master",) * masters_in_state + ("prev", *self.optimizer.kinds)
            expected = {
                f"{kind}/{name}" for names in masters.values() for name in names for kind in kinds
            }
            saved = {k for k in keys if not k.startswith("rng/")}
            if saved != expected:
                missing = sorted(expected - saved)[:3]
                extra = sorted(saved - expected)[:3]
                kinds_differ = {k.split("/", 1)[0] for k in (expected ^ saved)}
                if not kinds_differ & {"master", "prev"}:  # the model fits: the optimizer not
                    old = manifest.get("spec", {}).get("optimizer", {})
                    raise JobFailed(
                        f"{where} holds "
                        + optimizer_state_kind(
                            old.get("name", "adamw"), old.get("momentum"), old.get("state_dtype")
                        )
                        + ", but this job keeps "
                        + optimizer_state_kind(
                            self.spec.optimizer.name,
                            self.spec.optimizer.momentum,
                            self.spec.optimizer.state_dtype,
                        )
                        + "; resume with the checkpoint's optimizer.name, momentum and "
                        "state_dtype"
                    )
                raise JobFailed(
                    f"{where} does not fit this job's model (missing {missing}, unexpected "
                    f"{extra}); it was written for model {manifest.get('spec', {}).get('model')}"
                    f" with lora {manifest.get('spec', {}).get('lora')}"
                )

            before = (manifest.get("model") or {}).get("base")
            if self.model.lora is not None and isinstance(before, dict):
                now = self.model.lora.base_record()
                if before != now:  # e.g. model.path's checkpoint replaced between runs
                    raise JobFailed(
                        f"{where}: its adapters were trained on {describe_base(before)}, "
                        f"but this job's base is {describe_base(now)}; resume on that base"
                    )

            def load(key: str, like: torch.Tensor) -> torch.Tensor:
                t = state.get_tensor(stored_names.get(key, key))
                if t.shape != like.shape:
                    raise JobFailed(
                        f"{where}: {key} has shape {tuple(t.shape)}, this job's model "
                        f"{tuple(like.shape)}"
                    )
                return t

            if masters_in_state:
                exported: dict[str, torch.Tensor] = {}
            else:
                names = [name for per in masters.values() for name in per]
                try:
                    exported = self.model.read_exported(info.path, names)
                except (OSError, ValueError) as exc:
                    raise JobFailed(f"cannot read the model files of {where}: {exc}") from None
                lacking = [n for n in names if n not in exported]
                if lacking:
                    raise JobFailed(
                        f"{where}: its model files lack {len(lacking)} trained weight(s) of "
                        f"this job's model, e.g. {lacking[:3]}"
                    )
            optimizer_state = self.optimizer.state_dict()  # live buffers
            streamed = None
            if stream_moments:
                assert not stored_names, "8-bit states are never sharded"
                streamed = CheckpointMoments(
                    info.path / STATE_FILE,
                    where,
                    {
                        f"{layer}.{name}.{kind}": tuple(master.shape)
                        for layer, per in masters.items()
                        for name, master in per.items()
                        for kind in self.optimizer.kinds
                    },
                )
            else:
                for key, buf in optimizer_state["tensors"].items():
                    buf.copy_(load(_state_key(key), buf))
            targets = optimizer_state["tensors"]
            if stored_names:
                log.info("[trainer] %s: 8-bit second moments converted to their roots", where)
                for key, buf in targets.items():
                    if key.endswith(".exp_avg_sqrt"):
                        square_to_root_(buf, targets[key + "_absmax"], UNSIGNED_MAP)
                        # A second moment stored as 0 beside a first that is not: the
                        # old rounding this repairs (m / eps at the next step otherwise).
                        first = targets[key.removesuffix("_sqrt")]
                        first.masked_fill_(buf == UNSIGNED_MAP.zero_code, SIGNED_MAP.zero_code)
            optimizer_state["steps"] = {layer: updates for layer in optimizer_state["steps"]}
            self.optimizer.load_state_dict(optimizer_state)  # step counts (buffers in place)
            c = layout.counters
            for layer, names in masters.items():
                for name, master in names.items():
                    saved = exported.get(name)
                    if saved is None:
                        saved = load(f"master/{name}", master)
                    elif saved.shape != master.shape or saved.dtype != torch.float32:
                        raise JobFailed(
                            f"{where}: {name} in the model files is {saved.dtype} "
                            f"{tuple(saved.shape)}, this job's model float32 {tuple(master.shape)}"
                        )
                    master.copy_(saved)
                    refs = layout.params[layer][name]
                    current, previous = refs[s % 2], refs[(s - 1) % 2]
                    assert current is not None and previous is not None
                    if s >= 1:
                        layout.view(previous).copy_(load(f"prev/{name}", master))
                    # Last: with one weight copy (Note [weight copies]) both refs name
                    # the same buffer, and W_s is the version iteration s+1 reads.
                    layout.view(current).copy_(master)
                layout.events.signal(c.version(layer), s)
            if "rng/torch_cpu" in keys:
                torch.set_rng_state(state.get_tensor("rng/torch_cpu"))
        try:
            self.loader.load_state_dict(manifest["data_cursor"])
        except (DataError, KeyError) as exc:
            raise JobFailed(f"cannot resume from {where}: {exc}") from None
        self.progress.replace(self._history(info))
        self.output.checkpoint_step = s
        self.output.checkpoint_path = info.path
        self.resumed_from = info
        log.info(
            "[trainer] job %s resumes from %s (step %d of %d%s)",
            self.job_id,
            info.path,
            s,
            steps,
            "" if info.job_id == self.job_id else f", written by job {info.job_id}",
        )
        return streamed

    def restore_loss_scale(self, saved: object, s: int, where: str) -> int:
        """Restore the loss scaler after step ``s`` from a manifest's ``loss_scale``
        (None: the checkpoint was trained without one); returns the optimizer updates
        applied by then (fewer than ``s`` after steps that were skipped)."""
        try:
            updates = s
            if saved is not None:
                if not isinstance(saved, dict):
                    raise ValueError(f"it is {type(saved).__name__}, not a mapping")
                updates = int(saved["updates"])
                if not 0 <= updates <= s:
                    raise ValueError(f"{updates} updates applied in {s} steps")
            if self.loss_scaler is not None:
                if saved is None or "scale" not in saved:  # trained without a scaler
                    self.loss_scaler.restart_after(s, updates)
                else:
                    self.loss_scaler.load_state_dict(saved, s)
        except (ValueError, KeyError, TypeError) as exc:
            raise JobFailed(f"{where} is damaged: its loss_scale state: {exc}") from None
        self.skipped_before = s - updates
        return updates

    def updates_at(self, step: int) -> int:
        """Optimizer updates applied by the end of ``step`` (a step that is decided)."""
        return int(self.loss_scale_state(step)["updates"])

    def _history(self, info: CheckpointInfo) -> torch.Tensor | list:
        """The progress history of checkpoint ``info``: its ``PROGRESS_FILE``, or the
        manifest's rows (a checkpoint written before that file existed)."""
        if "progress_file" not in info.manifest:
            return [p for p in info.manifest.get("progress", []) if p[0] <= info.step]
        from safetensors import safe_open

        path = info.path / PROGRESS_FILE
        try:
            with safe_open(str(path), framework="pt") as f:
                table = f.get_tensor("progress")
        except Exception as exc:
            raise JobFailed(f"cannot read {path}: {exc}") from None
        if table.dim() != 2 or table.shape[1] != len(COLUMNS):
            raise JobFailed(
                f"{path} is damaged: its progress is {list(table.shape)}, not [steps, "
                f"{len(COLUMNS)}]"
            )
        return table[table[:, 0] <= info.step]

    # -- writing ----------------------------------------------------------------------

    def start_background(
        self,
        on_settled: Callable[[], None],
        *,
        sources: Callable[[int], LayerState] | None = None,
        write: Callable[[int, LayerState, Any], Path | None] | None = None,
    ) -> None:
        """Write the run's checkpoints in the background (Note [background checkpoint]);
        ``on_settled`` is called in the writer thread as each one is written or fails.
        ``sources`` and ``write``: what to stage and how to write it, when not this
        node's whole state written here (a sharded group's: Note [sharded background
        checkpoint]; ``write`` returns None on the nodes that only send)."""
        self.background = BackgroundCheckpoints(
            sources or self.state_tensors,
            write or self.write,
            on_settled,
            name=f"rp-checkpoints-{self.job_id}",
        )

    def stop_background(self) -> None:
        """Stop the background writer: abandons an unfinished checkpoint and wakes a
        capture waiting for it. Later checkpoints drain, as without staging."""
        if self.background is not None:
            self.background.close()
        self.background = None

    def save(self, step: int) -> Path:
        """Write the checkpoint after ``step`` from the live state (call only at a cut:
        Note [checkpoint cut]) and prune to ``output.keep_last``. Raises JobPaused if it
        cannot be written."""
        return self.write(step, self.state_tensors(step), self.context())

    def write(
        self,
        step: int,
        state: LayerState,
        context: dict,
        streamed: StreamedTensors | None = None,
    ) -> Path:
        """Write checkpoint ``step`` of ``state`` (live at a cut, or staged: the
        background writer calls this in its thread) atomically, through the output
        directory held open for the whole write (``JobOutput.pinned``), then prune.
        ``streamed``: more training-state tensors, taken part by part as the file is
        written (Note [streamed checkpoint state] in
        roundpipe.coordinator.training.sharded_optimizer). Raises JobPaused if it cannot
        be written, JobFailed if the output directory is refused."""
        check_masters(step, state, self.spec, self.output.kept())  # Note [diverged training]
        started = time.perf_counter()
        background = self.background
        check = background.check_abort if background is not None else (lambda: None)
        what = f"cannot write checkpoint step {step}"

        def write_once() -> Path:
            return self._write_pinned(what, step, state, context, check, streamed)

        if streamed is not None:  # gathered as written: never again (Note [out of descriptors])
            path = write_once()
        else:
            wait = (
                background.wait_unless_closed
                if background is not None
                else self.output.wait_unless_cancelled
            )
            path = self.output.retry_short_of_descriptors(what, write_once, wait)
        log.info(
            "[trainer] job %s: checkpoint step %d written to %s in %.2fs%s",
            self.job_id,
            step,
            path,
            time.perf_counter() - started,
            " (in the background)" if background is not None else "",
        )
        return path

    def _write_pinned(
        self,
        what: str,
        step: int,
        state: LayerState,
        context: dict,
        check: Callable[[], None],
        streamed: StreamedTensors | None,
    ) -> Path:
        """One try of ``write``: the checkpoint, then the pruning."""
        # A background checkpoint is written after later steps ran: the history up to its
        # own step.
        history = self.progress.table(up_to=step)
        with self.output.pinned(what) as output:
            checkpoints = CheckpointDir(output / self.output.checkpoints.root.name)
            try:
                written = checkpoints.write(
                    step,
                    lambda d: self._fill(d, state, context["rng"], history, check, streamed),
                    self._manifest(step, context),
                )
            except OSError as exc:
                raise JobPaused(self.output.io_error_message(what, exc)) from exc
            path = self.output.checkpoints.root / written.name
            self.output.checkpoint_step = step
            self.output.checkpoint_path = path
            try:
                checkpoints.prune(self.spec.output.keep_last, self.job_id)
            except OSError as exc:  # the new checkpoint is safe; old ones just linger
                log.warning(
                    "[trainer] job %s: pruning old checkpoints failed: %s",
                    self.job_id,
                    self.output.shown(str(exc)),
                )
        return path

    def settle_background(self) -> None:
        """In the run loop: announce background checkpoints written since the last call
        (``CheckpointWritten``); raise JobPaused (or JobFailed) for one that could not be
        written."""
        if self.background is None:
            return
        finished, failed = self.background.take_settled()
        for step, path in finished:
            if path is not None:  # None: a node of a sharded group that only sent
                self.emit(CheckpointWritten(step, path, self.progress.loss_at(step)))
        if failed is None:
            return
        step, error = failed
        # Full disk; output directory refused; a node lost or the job cancelled while a
        # sharded checkpoint was gathered.
        if isinstance(error, (JobPaused, JobFailed, JobCancelled)):
            raise error
        os_error = as_os_error(error, self.output.checkpoints.root)
        if os_error is not None:  # any I/O error pauses, as a drained checkpoint's does
            what = f"cannot write checkpoint step {step}"
            raise JobPaused(self.output.io_error_message(what, os_error)) from error
        raise JobFailed(f"cannot write checkpoint step {step}: {error}") from error

    def note_wait(self, step: int, waited_s: float) -> None:
        """Log a background checkpoint's wait for the staging memory."""
        if waited_s > 0.01:
            log.info(
                "[trainer] job %s: checkpoint step %d waited %.2fs for the one before the "
                "previous one to be written (output.checkpoint_staging holds one)",
                self.job_id,
                step,
                waited_s,
            )

    def state_tensors(self, step: int) -> dict[int, dict[str, torch.Tensor]]:
        """The live per-layer tensors of checkpoint ``step`` (Note [checkpoint cut]): fp32
        masters, optimizer state, and the compute-dtype weights of version step - 1."""
        moments = self.optimizer.state_dict()["tensors"]
        out: dict[int, dict[str, torch.Tensor]] = {}
        for layer in sorted(self.masters):
            per = out[layer] = {}
            for name, master in self.masters[layer].items():
                per[f"master/{name}"] = master
                for kind in self.optimizer.kinds:  # AdamW's moments, SGD's momentum
                    per[f"{kind}/{name}"] = moments[f"{layer}.{name}.{kind}"]
                previous = self.layout.params[layer][name][(step - 1) % 2]
                assert previous is not None
                per[f"prev/{name}"] = self.layout.view(previous)
        return out

    def context(self) -> dict:
        """What a checkpoint takes from the run loop at its cut (the loader then stands
        at the step after it): data cursor, RNG state, plans."""
        return {
            "data_cursor": self.loader.state_dict(),
            "rng": torch.get_rng_state(),
            "plan": str(self.layout.plan),
            "plan_history": [list(entry) for entry in self.plan_history],
        }

    def _fill(
        self,
        directory: Path,
        state: LayerState,
        rng: torch.Tensor,
        history: torch.Tensor,
        check_abort: Callable[[], None],
        streamed: StreamedTensors | None = None,
    ) -> None:
        """The model files, then the progress ``history``, then the training state. The
        fp32 masters are stored once, in the model files (read back by
        ``checkpoint_name``); the training state holds the rest (docs/checkpoints.md,
        "What is on disk"), ``streamed`` after it."""
        masters = {
            layer: {key[len("master/") :]: t for key, t in per.items() if key.startswith("master/")}
            for layer, per in state.items()
        }
        self.exporter.write_hf_model(directory, self.exporter.file_weights(masters))
        check_abort()
        tensors = {
            key: t
            for per in state.values()
            for key, t in per.items()
            if not key.startswith("master/")
        }
        tensors["rng/torch_cpu"] = rng
        (directory / STATE_FILE).parent.mkdir(mode=modes().dir, parents=True, exist_ok=True)
        save_tensors(
            directory / PROGRESS_FILE,
            {"progress": history},
            {"format": "roundpipe-progress", "columns": ",".join(COLUMNS)},
        )
        metadata = {"format": "roundpipe-training-state", "masters": "model files"}
        if streamed is None:
            save_tensors(directory / STATE_FILE, tensors, metadata)
            return
        entries = [(key, t.dtype, tuple(t.shape)) for key, t in tensors.items()]
        save_tensor_stream(
            directory / STATE_FILE,
            [*entries, *streamed.entries],
            itertools.chain([tensors], streamed.parts),
            metadata,
        )

    def loss_scale_state(self, step: int) -> dict[str, Any]:
        """The manifest's ``loss_scale`` of checkpoint ``step``: the scaler's state, or,
        without a scaler in this run, the updates count alone that a resumed
        scaler's skips left behind."""
        if self.loss_scaler is not None:
            return self.loss_scaler.checkpoint_state(step)
        return {"updates": step - self.skipped_before}

    def _manifest(self, step: int, context: dict) -> dict:
        updates = self.updates_at(step)
        spec_dict = self.spec.to_dict()
        spec_json = json.dumps(spec_dict, sort_keys=True, separators=(",", ":"))
        return {
            "job_id": self.job_id,
            "total_steps": self.spec.train.steps,
            "spec": spec_dict,
            "spec_sha256": hashlib.sha256(spec_json.encode()).hexdigest(),
            "model": {
                "architecture": self.model.architecture,
                "kind": "lora" if self.model.lora is not None else "full",
                "base_model": str(self.exporter.base_model_dir()) if self.model.lora else None,
                # the base as loaded (a bitsandbytes checkpoint's own quantisation, which
                # the spec need not name): what a resume is checked against
                "base": self.model.lora.base_record() if self.model.lora else None,
                "trainable_tensors": sum(len(v) for v in self.masters.values()),
            },
            "plan": context["plan"],
            "plan_history": context["plan_history"],
            "staleness": self.spec.train.staleness,
            # The weight version saved as prev/* (Note [checkpoint cut]).
            "prev_version": step - 1 if weight_copies(self.spec) == 2 else step,
            "compute_dtype": self.spec.train.dtype,
            "data_cursor": context["data_cursor"],
            "lr_schedule": {
                "step": updates,
                "lr": self.optimizer.lr_at(updates) if updates else 0.0,
            },
            "optimizer": {
                "impl": self.optimizer_impl,
                # Every layer's step count is the checkpoint's updates (Note [checkpoint
                # cut]): its step, less the steps loss scaling skipped.
                "steps": {str(layer): updates for layer in self.masters},
            },
            **(
                {}
                if self.loss_scaler is None and not self.skipped_before
                else {"loss_scale": self.loss_scale_state(step)}
            ),
            "masters": "model files",
            "rng": {
                "torch_cpu": f"{STATE_FILE}:rng/torch_cpu",
                "seed": self.spec.train.seed,
                "init_seed": self.spec.init_seed,
                "data_seed": self.spec.data_seed,
            },
            "progress_file": PROGRESS_FILE,
            "resumed_from": None if self.resumed_from is None else str(self.resumed_from.path),
        }


def _state_key(key: str) -> str:
    """The training-state file's key of optimizer state ``key`` (``layer.name.kind``,
    as the optimizer's ``state_dict`` names it): ``kind/name``."""
    layer_and_name, kind = key.rsplit(".", 1)
    return f"{kind}/{layer_and_name.split('.', 1)[1]}"


class CheckpointMoments(Mapping[str, torch.Tensor]):
    """A checkpoint's optimizer states, each read from its training-state file when it
    is asked for (keyed as the optimizer's ``state_dict``) and checked against the
    model's shape: a sharded job's rank 0 sends them a layer at a time as the nodes get
    in sync, never holding them whole (Note [sharded start-up]). ``close`` when done."""

    def __init__(self, path: Path, where: str, shapes: Mapping[str, tuple[int, ...]]) -> None:
        from safetensors import safe_open

        self._where, self._shapes = where, dict(shapes)
        try:
            self._file = safe_open(str(path), framework="pt")
        except Exception as exc:
            raise JobFailed(f"cannot read {path}: {exc}") from None

    def __getitem__(self, key: str) -> torch.Tensor:
        shape = self._shapes[key]
        t = self._file.get_tensor(_state_key(key))
        if tuple(t.shape) != shape or t.dtype != torch.float32:
            raise JobFailed(
                f"{self._where}: {_state_key(key)} is {t.dtype} {tuple(t.shape)}, this job's "
                f"model float32 {shape}"
            )
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def close(self) -> None:
        self._file = None
