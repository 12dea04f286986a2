"""RoundPipe runtime: fine-tune LLMs on consumer GPUs with the training state in CPU memory.

The client API is importable from here::

    from roundpipe import Client

    with Client() as client:
        job = client.submit("job.yaml")
        status = job.wait()

See docs/client.md. The names below are loaded on first use, so ``import roundpipe`` (done
by every worker and coordinator module) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "Client",
    "CoordinatorUnavailable",
    "JobHandle",
    "JobRejected",
    "JobSpec",
    "JobSpecError",
    "NotAuthorized",
    "RoundPipeError",
    "UnknownJob",
    "__version__",
    "load_job_spec",
]

_LAZY = {
    "Client": "roundpipe.client",
    "CoordinatorUnavailable": "roundpipe.client",
    "JobHandle": "roundpipe.client",
    "JobRejected": "roundpipe.client",
    "NotAuthorized": "roundpipe.client",
    "RoundPipeError": "roundpipe.client",
    "UnknownJob": "roundpipe.client",
    "JobSpec": "roundpipe.coordinator.spec.jobspec",
    "JobSpecError": "roundpipe.coordinator.spec.jobspec",
    "load_job_spec": "roundpipe.coordinator.spec.jobspec",
}

if TYPE_CHECKING:
    from roundpipe.client import (
        Client,
        CoordinatorUnavailable,
        JobHandle,
        JobRejected,
        NotAuthorized,
        RoundPipeError,
        UnknownJob,
    )
    from roundpipe.coordinator.spec.errors import JobSpecError
    from roundpipe.coordinator.spec.jobspec import JobSpec, load_job_spec


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'roundpipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
