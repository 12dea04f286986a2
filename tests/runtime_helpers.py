"""Test helpers for end-to-end training: tiny job specs and the single-process oracle.

The oracle is a plain PyTorch training loop over the *transformers* model (not the
layered one): same initial weights, same batches and microbatching, loss normalised over
the global batch, ``torch.optim.AdamW`` (or ``SGD``) with the same kernel, the same parameter groups
(``optimizer.no_decay``) and the same learning-rate schedule. ``staleness`` reproduces
the design's weight-update ordering: iteration k takes its gradient on
W_{max(k-1-staleness, 0)} and applies it to W_{k-1}.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from roundpipe.cluster import cpu_cluster
from roundpipe.coordinator.spec.data import DataLoader, build_dataset_from_spec
from roundpipe.coordinator.spec.jobspec import JobSpec, model_config_from_spec
from roundpipe.coordinator.training.optimizer import LRSchedule, decays
from roundpipe.protocol import Hello, StageTask, TaskFailed
from roundpipe.shared.model import LayeredModel, count_label_tokens
from roundpipe.worker.runtime import WorkerCore

DEMO_DATA = Path(__file__).resolve().parent.parent / "roundpipe" / "demo_data"

TINY_QWEN3 = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}


def tiny_spec(
    output_dir: Path,
    *,
    steps: int = 6,
    staleness: int = 0,
    lora: dict[str, Any] | None = None,
    architecture: str = "qwen3",
    config: dict[str, Any] | None = None,
    microbatch_size: int = 2,
    num_microbatches: int = 3,
    seq_len: int = 32,
    grad_clip: float | None = None,
    plan: str | None = None,
    dtype: str = "float32",
    lr: float = 3e-4,
    optimizer: dict[str, Any] | None = None,
    packing: str | None = None,
    train: dict[str, Any] | None = None,
) -> JobSpec:
    """A tiny Qwen3 job on the shipped demo corpus.

    The default lr is a typical fine-tuning rate. At much larger rates (3e-3) the runtime
    still matches the oracle's gradients, but Adam's first steps divide by sqrt(v) + eps
    with eps = 1e-8, so gradient elements near 1e-8 turn float-reordering noise (chunked
    loss, per-stage sums) into visible update differences: 2e-5 relative on one tensor
    after 2 steps, 2e-6 with eps = 1e-6. That is Adam's sensitivity, not a schedule error.
    """
    spec: dict[str, Any] = {
        "model": {
            "architecture": architecture,
            "config": dict(config or TINY_QWEN3),
            "init_seed": 1234,
            "tokenizer": str(DEMO_DATA / "tokenizer"),
        },
        "data": {"path": str(DEMO_DATA / "demo_corpus.jsonl"), "seq_len": seq_len, "seed": 7},
        "batch": {"microbatch_size": microbatch_size, "num_microbatches": num_microbatches},
        "train": {"steps": steps, "staleness": staleness, "dtype": dtype, "seed": 3},
        "optimizer": {
            "lr": lr,
            "weight_decay": 0.01,
            "schedule": "cosine",
            "warmup_steps": 2,
            "grad_clip": grad_clip,
        },
        "output": {"dir": str(output_dir)},
    }
    spec["optimizer"].update(optimizer or {})
    spec["train"].update(train or {})
    if plan is not None:
        spec["train"]["plan"] = plan
    if packing is not None:
        spec["data"]["packing"] = packing
    if lora is not None:
        spec["lora"] = lora
    return JobSpec.from_dict(spec)


def _real_token_aux(model, out, lengths: list[int], seq: int) -> torch.Tensor:
    """transformers' load-balancing loss of ``out``'s router logits over the real tokens
    of rows ``lengths`` long (padding after them), as its model forms it given the
    attention mask of a padded batch. (Not by passing that mask to the model: with one,
    transformers no longer finds packed documents in the position ids.)"""
    import importlib

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    module = importlib.import_module(type(base).__module__)
    mask = (torch.arange(seq).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    return module.load_balancing_loss_func(
        out.router_logits, base.num_experts, base.num_experts_per_tok, mask
    )


def oracle_train(
    spec: JobSpec,
    grad_norms: list[float] | None = None,
    *,
    dequantized_base: bool = False,
    losses: list[float] | None = None,
) -> dict[str, torch.Tensor]:
    """Final parameters (by name) of the plain single-process loop; ``grad_norms``, if
    given, receives each step's global gradient norm (before clipping), ``losses`` each
    step's loss (normalised over the global batch, as the runtime reports it).
    ``dequantized_base``: the frozen base of a ``lora.base_quantization`` job quantised
    and dequantised once (fp32), so the loop trains on the weights the workers compute
    with (a bitsandbytes checkpoint's base: its codes dequantised)."""
    lora = spec.lora.model_settings() if spec.lora is not None else None
    if spec.model.path is not None:  # the checkpoint's weights, fresh adapters as load does
        layered = LayeredModel.from_hf_dir(
            spec.model.path, lora, dequantize_mxfp4=spec.model.dequantize
        )
    else:
        layered = LayeredModel(model_config_from_spec(spec.model), lora)

    def initial():
        if spec.model.path is not None:
            weights = layered.load_weights(seed=spec.init_seed)
        else:
            weights = layered.init_weights(spec.init_seed)
        if dequantized_base:
            assert layered.quantized_base is not None
            layered.quantized_base.quantize_weights(weights)
            layered.quantized_base.dequantize_weights(weights, torch.float32)
        return weights

    model = layered.to_hf_model(initial())
    grad_model = layered.to_hf_model(initial())
    params = dict(model.named_parameters())
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    # Two parameter groups, as the Hugging Face Trainer builds them: optimizer.no_decay
    # exempts biases and norm weights from weight decay.
    groups = [
        {"params": [p for n, p in trainable.items() if decays(n, spec.optimizer.no_decay)]},
        {
            "params": [p for n, p in trainable.items() if not decays(n, spec.optimizer.no_decay)],
            "weight_decay": 0.0,
        },
    ]
    o = spec.optimizer
    groups = [g for g in groups if g["params"]]
    if o.name == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            groups,
            lr=o.lr,
            momentum=o.momentum,
            nesterov=o.nesterov,
            weight_decay=o.weight_decay,
            fused=True,
        )
    else:
        opt = torch.optim.AdamW(
            groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, fused=True
        )
    schedule = LRSchedule.from_spec(spec.optimizer, spec.train.steps)
    loader = DataLoader.from_spec(spec, build_dataset_from_spec(spec))
    history = [{n: p.detach().clone() for n, p in trainable.items()}]  # W_0
    for k in range(1, spec.train.steps + 1):
        version = max(k - 1 - spec.train.staleness, 0)
        with torch.no_grad():
            for n, p in grad_model.named_parameters():
                if n in trainable:
                    p.copy_(history[version][n])
        grad_model.zero_grad(set_to_none=True)
        batch = loader.batch_for_step(k)
        total = batch.num_label_tokens
        batch_tokens = batch.num_real_tokens
        step_loss = 0.0
        for (ids, labels), pos, lengths in zip(
            batch.microbatches, batch.microbatch_position_ids, batch.microbatch_row_lengths
        ):
            # Position ids restart per packed document: transformers then masks
            # attention block-diagonally, as the runtime does.
            out = grad_model(input_ids=ids, labels=labels, position_ids=pos, use_cache=False)
            loss = out.loss * (count_label_tokens(labels) / total)
            if getattr(out, "aux_loss", None) is not None:
                # transformers' loss holds coef * aux; a microbatch's aux counts with its
                # share of the batch's real tokens (Note [router auxiliary loss]).
                coef = grad_model.config.router_aux_loss_coef
                aux = _real_token_aux(grad_model, out, lengths, ids.shape[1])
                loss = (out.loss - coef * out.aux_loss) * (count_label_tokens(labels) / total)
                loss = loss + coef * aux * (sum(lengths) / batch_tokens)
            loss.backward()
            step_loss += float(loss.detach())
        if losses is not None:
            losses.append(step_loss)
        grad_params = dict(grad_model.named_parameters())
        for n, p in trainable.items():
            g = grad_params[n].grad
            p.grad = torch.zeros_like(p) if g is None else g.detach().clone()
        if grad_norms is not None:
            grad_norms.append(
                float(torch.nn.utils.get_total_norm(p.grad for p in trainable.values()))
            )
        if spec.optimizer.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(list(trainable.values()), spec.optimizer.grad_clip)
        for group in opt.param_groups:
            group["lr"] = schedule.lr_at(k)
        opt.step()
        history.append({n: p.detach().clone() for n, p in trainable.items()})
    return {n: p.detach().clone() for n, p in params.items()}


class InProcessWorkers:
    """N WorkerCores on threads, wired to a Trainer's dispatch/inbox (no sockets).

    ``engine`` makes each worker's transfer engine (default: the CPU one). Tasks are
    started as the daemon starts them: TaskDone arrives when the last copy landed, the
    next queued task is visible to the weight prefetch."""

    def __init__(self, trainer, num_workers: int, engine=None):
        self.trainer = trainer
        self.cores = [
            WorkerCore(i, transfer=engine() if engine is not None else None)
            for i in range(num_workers)
        ]
        self.queues: list[queue.Queue[StageTask | None]] = [queue.Queue() for _ in self.cores]
        setup = trainer.job_setup()
        for core, q in zip(self.cores, self.queues):
            core.setup_job(setup)
            core.peek_next = functools.partial(self._peek, q)
        self.threads = [
            threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(num_workers)
        ]
        for t in self.threads:
            t.start()

    @staticmethod
    def _peek(q: queue.Queue) -> StageTask | None:
        with q.mutex:
            return q.queue[0] if q.queue else None

    # The trainer's WorkerPort (roundpipe.coordinator.training.job_events).
    def send_task(self, task: StageTask, worker_id: int) -> None:
        self.queues[worker_id].put(task)

    def live_workers(self) -> list[int]:
        return list(range(len(self.cores)))

    def fence(self, worker_id: int, reason: str) -> None:
        raise AssertionError(f"in-process worker {worker_id} fenced: {reason}")

    def stalled_s(self) -> float:
        return 0.0

    def _failed(self, task: StageTask, i: int, exc: BaseException) -> TaskFailed:
        return TaskFailed(
            job_id=task.job_id,
            task_id=task.task_id,
            attempt=task.attempt,
            worker_id=i,
            error_type=type(exc).__name__,
            message=str(exc),
            traceback="".join(traceback.format_exception(exc)),
            retryable=False,
        )

    def _loop(self, i: int) -> None:
        core = self.cores[i]
        while (task := self.queues[i].get()) is not None:

            def deliver(result, task=task) -> None:
                if isinstance(result, BaseException):
                    result = self._failed(task, i, result)
                self.trainer.inbox.put(result)

            try:
                core.start_task(task, deliver)
            except Exception as exc:
                self.trainer.inbox.put(self._failed(task, i, exc))

    def close(self) -> None:
        # A job stopped mid-iteration (cancelled after a background checkpoint) leaves
        # tasks waiting for counters that will not move: stop them, as a JobTeardown
        # does, before the trainer unmaps the arenas they use.
        for core in self.cores:
            core.interrupt_job(self.trainer.job_id)
        for q in self.queues:
            q.put(None)
        for t in self.threads:
            t.join(timeout=30)
        for core in self.cores:
            core.close()


@contextlib.contextmanager
def trained_in_process(
    spec: JobSpec,
    arena_dir: Path,
    num_workers: int = 2,
    *,
    job_id: str = "job-ip",
    namespace: str | None = None,
    engine=None,
    wait_timeout_s: float = 60,
):
    """Run a job through a Trainer on ``num_workers`` in-process workers (``engine``: a
    transfer-engine factory for them) and yield the trainer after its last step; it is
    closed on exit (its output directory holds the rest)."""
    from roundpipe.coordinator.training.trainer import Trainer

    trainer = Trainer(
        job_id,
        spec,
        arena_dir=arena_dir,
        namespace=namespace or job_id,
        output_dir=Path(spec.output.dir),
        wait_timeout_s=wait_timeout_s,
    )
    pool = None
    try:
        trainer.prepare(num_workers)
        pool = InProcessWorkers(trainer, num_workers, engine=engine)
        trainer.run(pool)
        yield trainer
    finally:
        if pool is not None:
            pool.close()
        trainer.close()


def final_weights_in_process(
    spec: JobSpec, arena_dir: Path, namespace: str, engine, job_id: str = "job-ip"
) -> dict[str, torch.Tensor]:
    """Train ``spec`` on two in-process workers (``engine``: their transfer-engine
    factory, None for the CPU one); a copy of the final weights by parameter name."""
    with trained_in_process(
        spec, arena_dir, 2, job_id=job_id, namespace=namespace, engine=engine, wait_timeout_s=120
    ) as trainer:
        return {
            n: t.clone() for layer in trainer.final_weights().values() for n, t in layer.items()
        }


def run_in_process(spec: JobSpec, arena_dir: Path, num_workers: int = 2, job_id: str = "job-ip"):
    """A job's progress events, run as in :func:`trained_in_process`."""
    with trained_in_process(spec, arena_dir, num_workers, job_id=job_id) as trainer:
        return list(trainer.progress)


def assert_params_match(
    runtime: dict[str, torch.Tensor], oracle: dict[str, torch.Tensor], rtol: float = 1e-5
) -> None:
    assert runtime.keys() <= oracle.keys(), sorted(runtime.keys() - oracle.keys())[:5]
    worst = (0.0, "")
    for name, value in runtime.items():
        ref = oracle[name].to(value.dtype)
        err = (value - ref).norm().item() / max(ref.norm().item(), 1e-12)
        worst = max(worst, (err, name))
    assert worst[0] <= rtol, f"largest relative error {worst[0]:.3g} at {worst[1]}"


def assert_import_fails(module: str, env: dict[str, str], message: str) -> None:
    """Importing `module` with extra environment `env` exits with `message` on stderr
    (settings read at import must fail loudly, not fall back)."""
    result = subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def first_iteration(
    tmp_path: Path, arena_dir: Path, job_id: str, namespace: str, wait_timeout_s: float = 30
):
    """A prepared one-worker trainer of a small fixed plan whose iteration 1 can run
    without the coordinator: its batch written, its inputs signalled. Returns (trainer,
    iteration 1's tasks); the caller closes the trainer."""
    from roundpipe.coordinator.training.trainer import Trainer

    spec = tiny_spec(tmp_path, steps=2, plan="F[0:2,2:4] T[4:6] B[2:4,0:2]")
    trainer = Trainer(
        job_id,
        spec,
        arena_dir=arena_dir,
        namespace=namespace,
        output_dir=tmp_path,
        wait_timeout_s=wait_timeout_s,
    )
    trainer.prepare(1)
    layout = trainer.layout
    batch = trainer.loader.batch_for_step(1)
    layout.write_batch(1, batch)
    for m in range(layout.num_microbatches):
        layout.events.signal(layout.counters.act(0, m), 1)
    return trainer, trainer.schedule.tasks(1, batch.num_label_tokens, 0)


def coordinator_only(root: Path, name: str, coordinator_args: Sequence[str] = ()):
    """A LocalCluster with no workers (see ``cpu_cluster``)."""
    return cpu_cluster(root, name, coordinator_args)


def fake_hello(**overrides: Any) -> Hello:
    """A worker's Hello for hand-made peers: a 24 GiB GPU worker on another host (so no
    process of this machine is named by its pid); any field can be overridden."""
    fields: dict[str, Any] = dict(
        worker_name="fake",
        hostname="not-this-host",
        pid=1,
        process_create_time=0.0,
        device="cuda",
        device_index=0,
        device_name="NVIDIA GeForce RTX 4090",
        memory_bytes=24 * 2**30,
        compute_capability="8.9",
    )
    fields.update(overrides)
    return Hello(**fields)


def load_output(output_dir: Path, lora: bool = False) -> dict[str, torch.Tensor]:
    """The parameters of a job's exported model; with ``lora``, the trained adapter's
    only (the export is a PEFT adapter)."""
    from transformers import AutoModelForCausalLM

    if lora:
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(str(output_dir))
        return {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    else:
        model = AutoModelForCausalLM.from_pretrained(str(output_dir))
    return {n: p.detach() for n, p in model.named_parameters()}


@contextlib.contextmanager
def out_of_descriptors():
    """Inside, this process has no file descriptor left to open (RLIMIT_NOFILE lowered to
    what is open plus a few, those few taken): every open fails with EMFILE, as in a
    coordinator under a flood of connections. Restored on the way out."""
    import errno
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    try:
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError as exc:
            assert exc.errno == errno.EMFILE, exc
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
