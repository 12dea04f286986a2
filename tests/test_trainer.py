"""The coordinator's trainer with in-process workers equals the single-process oracle.

These tests exercise the whole schedule (layout, tasks, event-table ordering, optimizer
thread, staleness) on threads in one process; tests/test_end_to_end.py runs the same
jobs through real daemons and sockets.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from runtime_helpers import (
    InProcessWorkers,
    assert_params_match,
    oracle_train,
    tiny_spec,
)

from roundpipe.coordinator.trainer import Trainer


def train_in_process(spec, arena_dir, num_workers: int) -> dict[str, torch.Tensor]:
    trainer = Trainer(
        "job-test",
        spec,
        arena_dir=arena_dir,
        namespace="trainertest",
        output_dir=Path(spec.output.dir),
        wait_timeout_s=60,
    )
    pool = None
    try:
        trainer.prepare(num_workers)
        pool = InProcessWorkers(trainer, num_workers)
        trainer.run(pool.dispatch, pool.workers)
        assert [e.step for e in trainer.progress] == list(range(1, spec.train.steps + 1))
        return {n: t for layer in trainer.final_weights().values() for n, t in layer.items()}
    finally:
        if pool is not None:
            pool.close()
        trainer.close()


@functools.cache
def cached_oracle(staleness: int) -> dict[str, torch.Tensor]:
    # The oracle does not depend on the worker count (nor on the output directory).
    return oracle_train(tiny_spec(Path("unused"), staleness=staleness))


@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_full_finetune_matches_oracle(tmp_path, arena_dir, staleness, num_workers) -> None:
    spec = tiny_spec(tmp_path, staleness=staleness)
    assert_params_match(train_in_process(spec, arena_dir, num_workers), cached_oracle(staleness))


def test_grad_clipping_and_uneven_plan_match_oracle(tmp_path, arena_dir) -> None:
    spec = tiny_spec(tmp_path, staleness=1, grad_clip=0.5, plan="F[0:1,1:4] T[4:6] B[3:4,2:3,0:2]")
    assert_params_match(train_in_process(spec, arena_dir, 2), oracle_train(spec), rtol=1e-5)


def test_lora_matches_peft_oracle(tmp_path, arena_dir) -> None:
    spec = tiny_spec(
        tmp_path, staleness=0, lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    )
    runtime = train_in_process(spec, arena_dir, 2)
    oracle = oracle_train(spec)
    assert any(".lora_A." in n for n in runtime)
    assert_params_match(runtime, oracle)
