"""Sample protocol messages for tests: valid, with every kind of field filled in, and
easy to vary (keyword overrides)."""

from __future__ import annotations

from typing import Any

from roundpipe.protocol import (
    EventSignal,
    EventWait,
    LayerTensorRef,
    MicrobatchIO,
    StageTask,
    TaskFailed,
    TensorRef,
)


def sample_ref(**overrides: Any) -> TensorRef:
    """A tensor in arena ``acts``: a [2, 3] bfloat16 matrix at offset 0."""
    kw: dict[str, Any] = dict(arena="acts", offset=0, dtype="bfloat16", shape=(2, 3), stride=(3, 1))
    kw.update(overrides)
    return TensorRef(**kw)


def sample_microbatch(index: int = 0, **overrides: Any) -> MicrobatchIO:
    """A microbatch of the forward task below (layers [1, 5))."""
    kw: dict[str, Any] = dict(
        index=index,
        input=sample_ref(offset=100 * index),
        output=sample_ref(offset=100 * index + 24),
        grad_output=None,
        labels=None,
        loss=None,
        saved=[LayerTensorRef(layer=3, ref=sample_ref(offset=100 * index + 48))],
        waits=[EventWait(counter=3, at_least=2)],
        signals=[EventSignal(counter=9, value=3)],
    )
    kw.update(overrides)
    return MicrobatchIO(**kw)


def sample_stage_task(**overrides: Any) -> StageTask:
    """Forward task 7 of job j1 over layers [1, 5), two microbatches."""
    kw: dict[str, Any] = dict(
        job_id="j1",
        task_id=7,
        attempt=0,
        iteration=3,
        kind="forward",
        layer_start=1,
        layer_stop=5,
        weight_version=2,
        weight_waits=[EventWait(counter=1, at_least=2)],
        microbatches=[sample_microbatch(0), sample_microbatch(1)],
        grad_waits=[],
        grad_signals=[],
        loss_denominator=0,
        seed=42,
        wait_timeout_s=30.0,
        options={"note": [1, "x"]},
    )
    kw.update(overrides)
    return StageTask(**kw)


def task_failed(
    job_id: str, task_id: int, attempt: int, worker_id: int, error: str, message: str
) -> TaskFailed:
    """A worker's report that a task failed with ``error: message`` (not retryable)."""
    return TaskFailed(
        job_id=job_id,
        task_id=task_id,
        attempt=attempt,
        worker_id=worker_id,
        error_type=error,
        message=message,
        traceback="",
        retryable=False,
    )
