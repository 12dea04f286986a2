"""Fault injection for tests and the chaos harness: a worker that fails on purpose.

Set ``ROUNDPIPE_FAULT`` in a worker's environment to make it fail at a chosen point::

    ROUNDPIPE_FAULT="kill@iteration=3,kind=backward,mb=1"
    ROUNDPIPE_FAULT="stop@iteration=2,kind=forward,mb=0"    # SIGSTOP itself (a hang)
    ROUNDPIPE_FAULT="raise@iteration=4,kind=tail"            # an exception in the task
    ROUNDPIPE_FAULT="kill@task=7,when=end"                   # after the outputs, before TaskDone
    ROUNDPIPE_FAULT="kill@kind=forward,mb=1,when=issued"     # act counter out, bytes not landed
    ROUNDPIPE_FAULT="hold@iteration=1"                       # a task that runs until cancelled

Actions: ``kill`` (SIGKILL itself: a crash), ``stop`` (SIGSTOP itself: frozen, as a stuck
kernel or a paused VM looks from outside), ``raise`` (a Python exception: the task fails
and is reported), ``hold`` (the task waits at the point, logging "held by ROUNDPIPE_FAULT",
until its job is torn down, then goes on, so its own interruption checks stop it: a task
longer than any test, cancelled at a moment the test chooses; not with ``when=issued``).
Conditions (all optional, all must match): ``iteration``, ``kind``
(forward / tail / backward), ``task`` (task id), ``layer`` (the stage starts at it),
``mb`` (microbatch index; the fault fires when that microbatch starts), ``when``
(``start`` of the task, ``mb`` start (default when ``mb`` is given), ``end``: after
every output and signal, before TaskDone is sent, or ``issued``: on the transfer link,
right after microbatch ``mb``'s act/dact counter was stored at issue and before its copy
landed, roundpipe.shared.handoff), ``attempt`` (default 0: a re-run of
the task elsewhere does not fail again; ``any``: every attempt). The fault fires once per
process, or on every matching task with ``repeat=always`` (a deterministic failure, like
a stage that does not fit in memory).

The worker is otherwise unchanged: the same code runs with and without faults, which is
the point (the jupyter "problem kernel" pattern).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

__all__ = ["FAULT_ENV", "Fault", "FaultInjected", "parse_fault"]

FAULT_ENV = "ROUNDPIPE_FAULT"
_ACTIONS = ("kill", "stop", "raise", "hold")
_KEYS = ("iteration", "kind", "task", "layer", "mb", "when", "attempt", "repeat")


class FaultInjected(RuntimeError):
    """Raised by a ``raise@...`` fault."""


@dataclass
class Fault:
    action: str
    conditions: dict[str, str]
    fired: bool = False

    def point(self, where: str, *, task, mb: int | None = None) -> bool:
        """Fire if this point (``start``, ``mb``, ``issued`` or ``end``) of ``task`` matches;
        True if the caller must hold the task there (``hold``)."""
        if self.fired:
            return False
        c = self.conditions
        when = c.get("when", "mb" if "mb" in c else "start")
        if when != where:
            return False
        checks = {
            "iteration": task.iteration,
            "kind": task.kind,
            "task": task.task_id,
            "layer": task.layer_start,
            "attempt": task.attempt,
        }
        if "attempt" not in c and task.attempt != 0:
            return False
        for key, value in checks.items():
            if key in c and c[key] != str(value) and not (key == "attempt" and c[key] == "any"):
                return False
        if "mb" in c and (mb is None or c["mb"] != str(mb)):
            return False
        self.fired = c.get("repeat") != "always"
        if self.action == "hold":
            return True
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            raise FaultInjected(f"injected fault {self.action}@{c} fired")
        return False


def parse_fault(text: str | None) -> Fault | None:
    """Parse ``ACTION@key=value,...``; raise ValueError with what is wrong."""
    if not text:
        return None
    action, _, rest = text.partition("@")
    if action not in _ACTIONS:
        raise ValueError(f"{FAULT_ENV}: action {action!r} must be one of {', '.join(_ACTIONS)}")
    conditions: dict[str, str] = {}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq or key not in _KEYS:
            raise ValueError(
                f"{FAULT_ENV}: condition {part!r} must be key=value with key in {', '.join(_KEYS)}"
            )
        conditions[key] = value
    if conditions.get("when", "start") not in ("start", "mb", "issued", "end"):
        raise ValueError(f"{FAULT_ENV}: when= must be start, mb, issued or end")
    if conditions.get("repeat", "always") != "always":
        raise ValueError(f"{FAULT_ENV}: repeat= only takes 'always'")
    return Fault(action, conditions)
