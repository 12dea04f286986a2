"""A test point that holds a job before one of its iterations (tests and chaos only).

``ROUNDPIPE_TRAIN_HOLD="step=K,until=PATH"`` in the coordinator's environment makes each
job wait, before it sends any task of iteration K, until the file PATH exists (or the
job is cancelled); meanwhile the iterations before K finish and are reported as usual. A test places an event in
the middle of a running job this way (a worker that joins, a client that asks) without
depending on how fast the machine trains: nothing here waits for a time.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["HOLD_ENV", "held", "hold_env"]

HOLD_ENV = "ROUNDPIPE_TRAIN_HOLD"


def hold_env(step: int, until: str | os.PathLike[str]) -> dict[str, str]:
    """The environment that holds every job before iteration ``step`` until ``until``
    exists (for a daemon's environment: LocalCluster's ``env``)."""
    return {HOLD_ENV: f"step={step},until={os.fspath(until)}"}


def _parse(value: str) -> tuple[int, Path]:
    fields = dict(part.split("=", 1) for part in value.split(",") if "=" in part)
    try:
        return int(fields["step"]), Path(fields["until"])
    except (KeyError, ValueError):
        raise ValueError(f"{HOLD_ENV}={value!r}: expected step=K,until=PATH") from None


def held(step: int) -> bool:
    """Whether ``ROUNDPIPE_TRAIN_HOLD`` holds iteration ``step`` now (False when it is
    unset, names another step, or its file exists)."""
    value = os.environ.get(HOLD_ENV)
    if not value:
        return False
    hold_step, until = _parse(value)
    return hold_step == step and not until.exists()
