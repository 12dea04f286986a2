"""LoRA on a bf16 base against an NF4 and an int8 base (``lora.base_quantization``).

The same LoRA job (a Qwen3-shaped model, bf16 compute, staleness 1) runs three times
through a ``Trainer`` and two ``WorkerCore``s (the logic inside ``roundpipe-worker``,
in-process): with the base in bf16, in NF4 (double quantisation) and in int8. On the CPU
the workers move data through the emulated bus (``EmulatedEngine``, the ``--emulate-pcie``
worker path), on a GPU through the CUDA engine; both count the bytes they upload. Per
run it prints

* host bytes per quantised frozen parameter (the params arena's parts over their
  parameters) and the params arena in all;
* weight bytes uploaded per step (the engines' counters over the steps), and the ratio
  to the bf16 base's;
* ``roundpipe plan``'s prediction of both (its cost model's stored parameter bytes);
* mean step time after the first step, and the last step's loss.

``loss_diff`` is the NF4 job's first-step loss against a plain transformers / peft
forward over the same base quantised and dequantised once (the weights the workers
compute with), on the same batch.

Usage::

    python benchmarks/qlora.py                  # ~110M parameters, CPU workers, 4 steps
    python benchmarks/qlora.py --smoke          # ~9M parameters, what the tests run
    python benchmarks/qlora.py --device cuda    # on a GPU (CUDA engines)

Last line: ``RESULT host_bytes_per_frozen_param=<nf4> upload_ratio=<nf4 / bf16>
loss_diff=<vs the dequantised reference>``.
"""

from __future__ import annotations

import argparse
import math
import queue
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from roundpipe.coordinator.spec.data import DataLoader, build_dataset_from_spec
from roundpipe.coordinator.spec.jobspec import JobSpec, model_config_from_spec
from roundpipe.coordinator.spec.paths import DEMO_DATA_DIR
from roundpipe.coordinator.training.trainer import Trainer
from roundpipe.plan_command import plan_main
from roundpipe.shared.model import LayeredModel, count_label_tokens
from roundpipe.shared.quantized_base import PART_SEP
from roundpipe.worker.runtime import WorkerCore
from roundpipe.worker.transfer import CudaEngine, EmulatedEngine, Priority

SIZES = {
    # Decoder layers several times wider than the embedding, as in real models (the
    # embedding and LM head stay in bf16, as QLoRA keeps them).
    "smoke": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=8, head_dim=64),
    "default": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, head_dim=64),
}


def make_spec(out: Path, size: str, quant: str, steps: int) -> JobSpec:
    config = dict(
        SIZES[size],
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
    )
    return JobSpec.from_dict(
        {
            "model": {
                "architecture": "qwen3",
                "config": config,
                "init_seed": 0,
                "tokenizer": str(DEMO_DATA_DIR / "tokenizer"),
            },
            "data": {"path": str(DEMO_DATA_DIR / "demo_corpus.jsonl"), "seq_len": 32, "seed": 1},
            "batch": {"microbatch_size": 2, "num_microbatches": 3},
            "train": {"steps": steps, "staleness": 1, "dtype": "bfloat16", "seed": 0},
            "optimizer": {"lr": 1e-4, "schedule": "constant"},
            "lora": {
                "r": 8,
                "alpha": 16,
                "target_modules": ["q_proj", "v_proj"],
                "base_quantization": quant,
            },
            "output": {"dir": str(out), "checkpoint_every": 0},
        }
    )


class _Pool:
    """Two WorkerCores on threads as the trainer's WorkerPort (what the daemons do)."""

    def __init__(self, trainer: Trainer, engines) -> None:
        self.trainer = trainer
        self.cores = [WorkerCore(i, transfer=e) for i, e in enumerate(engines)]
        self.queues: list[queue.Queue] = [queue.Queue() for _ in self.cores]
        setup = trainer.job_setup()
        for core, q in zip(self.cores, self.queues):
            core.setup_job(setup)
            core.peek_next = lambda q=q: q.queue[0] if q.queue else None
        self.threads = [
            threading.Thread(target=self._loop, args=(i,), daemon=True)
            for i in range(len(self.cores))
        ]
        for t in self.threads:
            t.start()

    def send_task(self, task, worker_id: int) -> None:
        self.queues[worker_id].put(task)

    def live_workers(self) -> list[int]:
        return list(range(len(self.cores)))

    def fence(self, worker_id: int, reason: str) -> None:
        raise RuntimeError(f"worker {worker_id} fenced: {reason}")

    def stalled_s(self) -> float:
        return 0.0

    def _loop(self, i: int) -> None:
        while (task := self.queues[i].get()) is not None:
            self.cores[i].start_task(task, self.trainer.inbox.put)

    def close(self) -> None:
        for core in self.cores:
            core.interrupt_job(self.trainer.job_id)
        for q in self.queues:
            q.put(None)
        for t in self.threads:
            t.join(timeout=60)
        for core in self.cores:
            core.close()


def run_job(spec: JobSpec, arena_dir: Path, device: str, job_id: str) -> dict:
    if device == "cuda":
        engines = [CudaEngine(torch.device("cuda", 0)) for _ in range(2)]
    else:
        engines = [EmulatedEngine(16e9, latency_s=10e-6) for _ in range(2)]
    trainer = Trainer(
        job_id,
        spec,
        arena_dir=arena_dir,
        namespace=job_id,
        output_dir=Path(spec.output.dir),
        wait_timeout_s=600,
    )
    pool = None
    started = time.monotonic()
    try:
        trainer.prepare(2)
        pool = _Pool(trainer, engines)
        trainer.run(pool)
        layout = trainer.layout
        qb = layout.model.quantized_base
        parts = sum(
            layout.view(ref).nbytes
            for per_layer in layout.params.values()
            for name, (ref, _) in per_layer.items()
            if PART_SEP in name
        )
        frozen = sum(math.prod(s) for s in qb.shapes.values()) if qb is not None else 0
        times = [e.time for e in trainer.progress]
        steps = len(times)
        return {
            "host_per_frozen": parts / frozen if frozen else 2.0,
            "params_arena": layout.sizes["params"],
            "plan": str(layout.plan),
            "upload_per_step": sum(e.uploaded_bytes[Priority.WEIGHT] for e in engines) / steps,
            "step_s": (times[-1] - times[0]) / max(1, steps - 1),
            "wall_s": time.monotonic() - started,
            "loss": trainer.progress[-1].loss,
            "first_loss": trainer.progress[0].loss,
        }
    finally:
        if pool is not None:
            pool.close()
        trainer.close()


def predicted(spec: JobSpec, plan: str, quant: str) -> dict:
    """``roundpipe plan``'s figures for this job under the plan it ran."""
    import contextlib
    import io
    import json

    cfg = spec.model.config
    args = ["--architecture", "qwen3", "--workers", "2", "--seq-len", str(spec.data.seq_len)]
    for key, value in cfg.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    args += ["--lora-rank", str(spec.lora.r), "--lora-targets", "q_proj,v_proj"]
    args += ["--base-quantization", quant, "--plan", plan, "--json"]
    args += ["--microbatch-size", "2", "--microbatches", "3", "--staleness", "1"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = plan_main(args)
    if code != 0:
        raise RuntimeError(f"roundpipe plan {' '.join(args)} failed")
    return json.loads(out.getvalue())["base"]


def reference_first_loss(spec: JobSpec) -> float:
    """The first step's loss of a plain peft model over the dequantised base (fp32
    forward of the bf16-cast weights, as the workers see them)."""
    lora = spec.lora.model_settings()
    model = LayeredModel(model_config_from_spec(spec.model), lora)
    weights = model.init_weights(spec.init_seed)
    assert model.quantized_base is not None
    model.quantized_base.quantize_weights(weights)
    model.quantized_base.dequantize_weights(weights, torch.float32)
    bf16 = {layer: {n: t.to(torch.bfloat16) for n, t in w.items()} for layer, w in weights.items()}
    hf = model.to_hf_model(bf16)
    batch = DataLoader.from_spec(spec, build_dataset_from_spec(spec)).batch_for_step(1)
    total = batch.num_label_tokens
    loss = 0.0
    with torch.no_grad():
        for (ids, labels), pos in zip(batch.microbatches, batch.microbatch_position_ids):
            out = hf(input_ids=ids, labels=labels, position_ids=pos, use_cache=False)
            loss += float(out.loss) * count_label_tokens(labels) / total
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the small size the tests run")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    size = "smoke" if args.smoke else "default"
    steps = args.steps or (3 if args.smoke else 4)
    root = Path(tempfile.mkdtemp(prefix="rp-qlora-"))
    arena_dir = Path(tempfile.mkdtemp(prefix="rp-qlora-", dir="/dev/shm"))
    rows = {}
    try:
        for quant in ("none", "nf4", "int8"):
            spec = make_spec(root / quant, size, quant, steps)
            rows[quant] = run_job(spec, arena_dir, args.device, f"qlora-{quant}")
            rows[quant]["predicted"] = predicted(spec, rows[quant]["plan"], quant)
        ref = reference_first_loss(make_spec(root / "ref", size, "nf4", steps))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(arena_dir, ignore_errors=True)
    base = rows["none"]["upload_per_step"]
    print(f"{size} size, bf16 compute, {steps} steps, device {args.device}")
    print(
        f"{'base':<6} {'host B/frozen':>13} {'params arena':>13} {'upload/step':>12} "
        f"{'ratio':>6} {'pred upload':>12} {'step s':>7} {'loss':>8}"
    )
    for quant, r in rows.items():
        pred = r["predicted"]["weight_upload_bytes_per_iteration"]
        print(
            f"{quant:<6} {r['host_per_frozen']:>13.4f} {r['params_arena'] / 2**20:>11.2f}Mi "
            f"{r['upload_per_step'] / 2**20:>10.2f}Mi {r['upload_per_step'] / base:>6.3f} "
            f"{pred / 2**20:>10.2f}Mi {r['step_s']:>7.3f} {r['loss']:>8.4f}"
        )
    nf4 = rows["nf4"]
    upload_err = nf4["predicted"]["weight_upload_bytes_per_iteration"] / nf4["upload_per_step"] - 1
    host_err = nf4["predicted"]["host_bytes_per_frozen_param"] / nf4["host_per_frozen"] - 1
    print(
        f"plan's prediction for nf4: upload {100 * upload_err:+.1f}%, host {100 * host_err:+.1f}%"
    )
    print(
        f"RESULT host_bytes_per_frozen_param={nf4['host_per_frozen']:.4f} "
        f"upload_ratio={nf4['upload_per_step'] / base:.4f} "
        f"loss_diff={abs(nf4['first_loss'] - ref):.2e}"
    )


if __name__ == "__main__":
    main()
