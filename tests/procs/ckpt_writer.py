"""Child for the SIGKILL trials (tests/test_resume.py): write checkpoints in a loop.

    ckpt_writer.py ROOT

Resumes from the newest good checkpoint of job "trial" under ROOT (after checking that
its tensors hold its step number), prints ``start <step>``, then writes checkpoints
step+1, step+2, ... forever, printing ``saved <step>`` after each (the pointer has moved
and old ones are pruned by then). Each holds ~3 MB in three files written three ways:
save_tensors (the training state), safetensors' own writer (as save_pretrained uses it),
and a JSON config, so a kill lands inside a write most of the time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from roundpipe.coordinator.training.checkpoint import (
    STATE_FILE,
    CheckpointDir,
    load_tensors,
    save_tensors,
)

JOB = "trial"


def fill(directory: Path, step: int) -> None:
    (directory / "config.json").write_text(json.dumps({"step": step, "pad": "x" * 4096}))
    save_file({"w": torch.full((256, 1024), float(step))}, str(directory / "model.safetensors"))
    (directory / STATE_FILE).parent.mkdir(parents=True)
    big = torch.full((4, 128, 1024), float(step))
    save_tensors(
        directory / STATE_FILE,
        {
            "master/a": big[0],
            "exp_avg/a": big[1],  # views of one storage, like arena views
            "exp_avg_sq/a": big[2:],
            "prev/a": torch.full((64, 64), float(step), dtype=torch.bfloat16),
        },
    )


def check(info) -> None:
    for name, t in load_tensors(info.path / STATE_FILE):
        # The step as the tensor's dtype holds it: bfloat16 rounds 263 to 264.
        if not bool((t == torch.full_like(t, float(info.step))).all()):
            print(f"bad {name} in {info.path}", flush=True)
            sys.exit(3)


def main() -> None:
    ckpts = CheckpointDir(sys.argv[1])
    ckpts.remove_stale()
    latest = ckpts.find_latest(job_id=JOB)
    step = 0
    if latest is not None:
        check(latest)
        step = latest.step
    print(f"start {step}", flush=True)
    while True:
        step += 1
        ckpts.write(step, lambda d, s=step: fill(d, s), {"job_id": JOB})
        ckpts.prune(2, JOB)
        print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main()
