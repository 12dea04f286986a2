"""Data parallelism across coordinators: one coordinator per server, one process group.

``roundpipe-coordinator --dist-init tcp://HOST:PORT --rank R --world-size W`` (or
torchrun's ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``) makes the coordinator a
node of a data-parallel group (docs/multi-node.md). Every node has its own workers and
pipeline; what crosses servers goes through ``torch.distributed`` with the gloo backend
(the gradients live in CPU memory), never through a transport of our own:

* ``NodeGroup`` joins the group at start-up (``init_process_group`` over a ``TCPStore``
  that rank 0 hosts at ``HOST:PORT``) and keeps a heartbeat counter per node in the
  store, so a silent node is named instead of guessed at.
* Jobs are submitted to rank 0. Rank 0 announces each job in the store
  (``NodeGroup.announce``); the other ranks wait for announcements
  (``NodeGroup.next_job``) and run the same job. ``JobGroup`` is one job's share of the
  group: its own gloo process group (``new_group``), so that a collective left behind by
  a stopped job can never pair with one of the next job.
* Each node takes its shard of every global batch (``node_microbatches``): the job's
  ``batch.num_microbatches`` counts the global batch, rank r trains microbatches
  ``r*M/W .. (r+1)*M/W - 1`` of it, with the loss normalised over the whole global batch.
  The sum of the nodes' gradients is then exactly the gradient of the global batch.
* With ``train.optimizer_sharding: sharded`` each node holds and steps only its shard of
  the masters and moments: gradients are reduce-scattered and the updated weights
  all-gathered (roundpipe.coordinator.training.sharded_optimizer).
* ``GradientReducer`` (thread ``rp-allreduce-<job>``) all-reduces each layer's gradient,
  in place in the grads arena, as soon as it is complete on this node (last layer
  first, overlapped with the rest of the backward); the optimizer steps a layer only
  after that (Note [reduced before stepped]). Every node then steps the same weights
  with the same gradients: the masters stay identical, and rank 0 alone writes
  checkpoints, which are therefore topology-free.
* At job start rank 0 broadcasts the training state (masters, moments, both weight
  parities, data cursor), so a job resumed from a checkpoint of any topology starts
  identically on every node, and the other nodes never read checkpoints.

Note [reduced before stepped]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A layer's gradient slot holds this node's share while ``wgrad[l] >= k`` and
``reduced[l] < k``, and the sum over all nodes once ``reduced[l] >= k``. The optimizer
waits for ``reduced``, not ``wgrad``. Nothing overwrites the slot in between: a backward
task of k+1 writes it only once ``version[l] >= k`` (Note [weight-update ordering]),
which the optimizer stores after stepping the reduced gradient; a task re-run after a
worker loss does not rewrite a signalled slot (Note [no rewrite after signal]). With
sharded optimizer state the reducer reduce-scatters instead: once ``reduced[l] >= k``
only this node's shard of the slot holds the sum, and only that shard is read; the
version is stored after the weights are all-gathered (Note [gathered before published]
in roundpipe.coordinator.training.sharded_optimizer), so the slot is still not
overwritten before the step read it.

Note [arrive before a collective]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A gloo collective cannot be interrupted (``abort`` does not wake a waiting allreduce): a
node that enters one waits until every node has entered it or the collective timeout
passes. So before each collective every node first *arrives* in the store (a counter per
collective name) and waits there, where the wait can be abandoned: when the job is
cancelled, when another node left the job (its ``stop/<rank>`` key says why), or when a
node's heartbeat stopped for ``timeout_s``. A node that abandons the wait takes its
arrival back; if the count was complete by then, the others have entered the
collective, so it enters too (it completes) and stops afterwards. A node thus enters a
collective only when every node has entered or will enter it, and it completes unless a
node dies inside it (the peer's closed connection ends it at once) or freezes there (the
collective timeout, the same ``timeout_s``, ends it). Either way a stopped node pauses the job within a
bounded time, and the reason names it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from roundpipe.coordinator.spec.choices import optimizer_state_sharded
from roundpipe.coordinator.training.sharded_optimizer import (
    ZeroShards,
    bucket_name,
    bucket_text,
    gradient_buckets,
)

if TYPE_CHECKING:
    from roundpipe.coordinator.training.timeline import TimelineRecorder

__all__ = [
    "DEFAULT_DIST_TIMEOUT_S",
    "GradientReducer",
    "GroupError",
    "GroupSettings",
    "JobAnnouncement",
    "JobGroup",
    "NodeGroup",
    "node_microbatches",
    "settings_from_args",
]

log = logging.getLogger(__name__)

COLLECTIVE_FAULT_ENV = "ROUNDPIPE_COLLECTIVE_FAULT"
"""Test point (docs/fault-tolerance.md): ``kill@NAME#COUNT`` in a coordinator's
environment SIGKILLs it right after every node arrived at the COUNT-th collective NAME
of a job (``grad/L``: layer L's gradient reduction, ``weights/L``: its sharded weights'
all-gather; ``grad/L-M`` and ``weights/L-M`` for a bucket of layers L to M, Note
[gradient buckets]), so the others are inside the collective when it dies."""

DEFAULT_DIST_TIMEOUT_S = 300.0
"""Default ``--dist-timeout``: how long a node may be silent (no heartbeat, or stuck in a
collective) before the others pause the job. Longer than any step and any worker
recovery inside one node (a lost worker costs its heartbeat timeout plus a re-run)."""
HEARTBEAT_INTERVAL_S = 1.0
_POLL_S = 0.0005
"""First sleep of a store poll; it doubles up to _POLL_MAX_S."""
_POLL_MAX_S = 0.02
WAIT_REPORT_AFTER_S = 5.0
"""A node that waits this long at a collective says (log, job status) which nodes it
waits for and, where they said, why (e.g. no worker connected there)."""
WAIT_REPORT_EVERY_S = 60.0
PER_STEP_COLLECTIVES = frozenset({"grad", "loss", "weights", "clip"})
"""The collectives issued once per step (by the part of their name before any ``/``):
the ``count`` of each is its step's place in the run, 1 for the run's first step."""


class GroupError(RuntimeError):
    """The data-parallel group cannot go on with the job; the message names the node and
    what it did (left the job, went silent, closed its connection)."""


def _cannot_join(settings: GroupSettings, exc: Exception) -> GroupError:
    return GroupError(
        f"cannot join the data-parallel group at {settings.host}:{settings.port} as "
        f"rank {settings.rank} of {settings.world_size} within {settings.timeout_s:.0f}s "
        f"(--dist-timeout): {exc}. Start every rank with the same --dist-init and "
        "--world-size, each with its own --rank, and open the port (and gloo's "
        "ports) between the servers (docs/multi-node.md)"
    )


@dataclass(frozen=True, kw_only=True)
class GroupSettings:
    """Where and as whom a coordinator joins the data-parallel group."""

    host: str
    """Host of rank 0's TCPStore (``--dist-init tcp://HOST:PORT`` or ``MASTER_ADDR``)."""
    port: int
    """Its port: rank 0 listens there; open it in the firewall (docs/multi-node.md)."""
    rank: int
    """This coordinator's rank, 0 .. world_size - 1; rank 0 takes the jobs."""
    world_size: int
    """Number of coordinators (servers) in the group."""
    timeout_s: float = DEFAULT_DIST_TIMEOUT_S
    """Joining, collectives and node silence: past it, the job pauses (Note [arrive
    before a collective])."""
    agent_store: bool = False
    """The store at host:port is torchrun's agent's (``TORCHELASTIC_USE_AGENT_STORE``):
    rank 0 connects to it instead of hosting it."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"--rank must be in 0..{self.world_size - 1} for --world-size "
                f"{self.world_size}, got {self.rank}"
            )
        if not 0 < self.port < 65536:
            raise ValueError(f"the group's port must be in 1..65535, got {self.port}")
        if self.timeout_s <= 0:
            raise ValueError(f"--dist-timeout must be > 0 seconds, got {self.timeout_s}")


def settings_from_args(
    dist_init: str | None,
    rank: int | None,
    world_size: int | None,
    timeout_s: float = DEFAULT_DIST_TIMEOUT_S,
    environ: Mapping[str, str] | None = None,
) -> GroupSettings | None:
    """The group settings from ``--dist-init/--rank/--world-size``, else from torchrun's
    environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), else None (a
    coordinator on its own). Raises ValueError naming the missing or bad setting."""
    env = os.environ if environ is None else environ
    if dist_init is None:
        if "WORLD_SIZE" not in env:
            if rank is not None or world_size is not None:
                raise ValueError("--rank and --world-size need --dist-init tcp://HOST:PORT")
            return None
        dist_init = f"tcp://{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
        where = "MASTER_ADDR/MASTER_PORT"
    else:
        where = "--dist-init"
    url = urlparse(dist_init)
    try:
        port = url.port
    except ValueError:
        port = None
    if url.scheme != "tcp" or not url.hostname or port is None:
        raise ValueError(f"{where} must be tcp://HOST:PORT (rank 0's address), got {dist_init!r}")

    def number(value: int | None, name: str, env_name: str) -> int:
        if value is not None:
            return value
        text = env.get(env_name)
        if text is None:
            raise ValueError(f"--{name} is required with {where} (or set {env_name})")
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{env_name} must be an integer, got {text!r}") from None

    return GroupSettings(
        host=url.hostname,
        port=port,
        rank=number(rank, "rank", "RANK"),
        world_size=number(world_size, "world-size", "WORLD_SIZE"),
        timeout_s=timeout_s,
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


def node_microbatches(num_microbatches: int, rank: int, world_size: int) -> range:
    """The global batch's microbatches that node ``rank`` trains. Raises ValueError if
    they do not split evenly (every node must run the same schedule)."""
    if num_microbatches % world_size:
        raise ValueError(
            f"batch.num_microbatches ({num_microbatches}) must be a multiple of the number "
            f"of nodes ({world_size}): each node trains an equal share of the global batch; "
            f"use {(num_microbatches // world_size + 1) * world_size}"
        )
    share = num_microbatches // world_size
    return range(rank * share, (rank + 1) * share)


@dataclass(frozen=True)
class JobAnnouncement:
    """A job rank 0 runs, as the other ranks learn it."""

    seq: int
    job_id: str
    spec: dict


class NodeGroup:
    """This coordinator's membership of the data-parallel group (see the module doc)."""

    def __init__(self, settings: GroupSettings, store: dist.Store):
        self.settings = settings
        self.rank = settings.rank
        self.world_size = settings.world_size
        self.timeout_s = settings.timeout_s
        self.store = store
        self.hostname = socket.gethostname()
        self.broken: str | None = None
        """Why the group can no longer run jobs together (a node was lost), else None."""
        self._stop = threading.Event()
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (beats, when they changed)
        self._next_seq = 1
        self._heartbeat = threading.Thread(target=self._beat, name="rp-node-heartbeat", daemon=True)
        self.store_lost: str | None = None
        """Set when this node cannot reach rank 0's store: the group is gone."""

    @classmethod
    def join(cls, settings: GroupSettings) -> NodeGroup:
        """Join the group; blocks until all ``world_size`` coordinators have joined, at
        most ``timeout_s``. Raises GroupError naming the address and the setting."""
        timeout = datetime.timedelta(seconds=settings.timeout_s)
        log.info(
            "[multinode] rank %d of %d joining the group at %s:%d (gloo)",
            settings.rank,
            settings.world_size,
            settings.host,
            settings.port,
        )
        try:
            store = dist.TCPStore(
                settings.host,
                settings.port,
                settings.world_size,
                is_master=settings.rank == 0 and not settings.agent_store,
                timeout=timeout,
                wait_for_workers=True,
            )
            # Each rank once: a second coordinator started with a rank already in the
            # group was let in, overwrote that rank's address and heartbeats, and failed
            # only at its first collective, pausing every node's job. A rank has joined
            # once its host is published (below); an earlier claim whose coordinator
            # died or failed before that (a wrong GLOO_SOCKET_IFNAME, a restart during
            # start-up) does not bar the next one.
            claims = store.add(f"rp/rank-claims/{settings.rank}", 1)
            taken = claims != 1 and store.check([f"rp/host/{settings.rank}"])
        except (RuntimeError, OSError) as exc:
            raise _cannot_join(settings, exc) from None
        if taken:
            raise GroupError(
                f"rank {settings.rank} is already in the data-parallel group at "
                f"{settings.host}:{settings.port}: another coordinator was started with "
                f"--rank {settings.rank}, or this rank joined before and the group cannot "
                "take it back (restart every coordinator of the group). Give each "
                "coordinator its own --rank (docs/multi-node.md)"
            )
        try:
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore("rp/world", store),
                rank=settings.rank,
                world_size=settings.world_size,
                timeout=timeout,
            )
        except (RuntimeError, OSError) as exc:
            raise _cannot_join(settings, exc) from None
        group = cls(settings, store)
        store.set(f"rp/host/{settings.rank}", group.hostname)
        group._heartbeat.start()
        log.info("[multinode] rank %d of %d joined", settings.rank, settings.world_size)
        return group

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def describe(self, rank: int) -> str:
        """``node 1 (hostname)``, for messages."""
        try:
            host = self.store.get(f"rp/host/{rank}").decode()
        except Exception:
            host = "?"
        return f"node {rank} ({host})"

    def close(self) -> None:
        self._stop.set()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group cannot shut down cleanly; we exit anyway
                pass

    # -- liveness ---------------------------------------------------------------------

    def _beat(self) -> None:
        """Count this node's heartbeat in rank 0's store. A failed beat is tried again
        at the next one: the store is lost only once none has gone through for
        ``timeout_s`` (a single hiccup, e.g. a connection reset, stopped the beats for
        good, and the node looked silent to the others or left the group)."""
        key = f"rp/alive/{self.rank}"
        last_ok = time.monotonic()
        failing = False
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            try:
                self.store.add(key, 1)
            except Exception as exc:  # rank 0 (the store) is gone, frozen, or hiccuped
                if time.monotonic() - last_ok > self.timeout_s:
                    self.store_lost = (
                        f"rank 0's store at {self.settings.host}:{self.settings.port} "
                        f"stopped answering: {exc}"
                    )
                    log.error("[multinode] %s", self.store_lost)
                    return
                if not failing:
                    log.warning("[multinode] a heartbeat failed (%s); trying again", exc)
                failing = True
                continue
            last_ok, failing = time.monotonic(), False

    def silent_nodes(self) -> list[int]:
        """Ranks whose heartbeat has not advanced for ``timeout_s`` (compared on this
        node's clock: the counters are free of clock skew)."""
        now = time.monotonic()
        silent = []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            beats = self.store.add(f"rp/alive/{rank}", 0)
            last = self._seen.get(rank)
            if last is None or last[0] != beats:
                self._seen[rank] = (beats, now)
            elif now - last[1] > self.timeout_s:
                silent.append(rank)
        return silent

    # -- jobs -------------------------------------------------------------------------

    def announce(self, job_id: str, spec: dict) -> JobGroup:
        """Rank 0: make the other ranks run job ``job_id`` with ``spec`` too."""
        assert self.leader
        seq = int(self.store.add("rp/jobs", 1))
        self.store.set(f"rp/job/{seq}", json.dumps({"job_id": job_id, "spec": spec}))
        log.info("[multinode] job %s announced to %d other node(s)", job_id, self.world_size - 1)
        try:
            return JobGroup(self, seq, job_id, sharded=_sharded(spec))
        except Exception as exc:
            # torch pairs process groups by the order they were created: after one that
            # failed here, every later job's would pair with the wrong ones elsewhere.
            self.broken = (
                f"job {job_id}'s process group could not be formed ({exc}); later jobs run "
                "on this node alone until the coordinators are restarted"
            )
            raise

    def next_job(self, stopping: Callable[[], bool]) -> JobAnnouncement | None:
        """Other ranks: wait for rank 0's next job (None once ``stopping()``). Raises
        GroupError if rank 0's store is gone."""
        key = f"rp/job/{self._next_seq}"
        while not stopping():
            if self.store_lost is not None:
                raise GroupError(self.store_lost)
            try:
                if self.store.check([key]):
                    body = json.loads(self.store.get(key))
                    self._next_seq += 1
                    return JobAnnouncement(self._next_seq - 1, body["job_id"], body["spec"])
            except (RuntimeError, OSError) as exc:
                raise GroupError(f"rank 0's store stopped answering: {exc}") from None
            time.sleep(0.2)
        return None

    def join_job(self, announcement: JobAnnouncement) -> JobGroup:
        return JobGroup(
            self, announcement.seq, announcement.job_id, sharded=_sharded(announcement.spec)
        )


def _sharded(spec: Mapping) -> bool:
    """Whether a job's spec (as announced: ``JobSpec.to_dict``, every field present)
    shards its optimizer state (``optimizer_state_sharded``)."""
    train = spec.get("train") if isinstance(spec, Mapping) else None
    optimizer = spec.get("optimizer") if isinstance(spec, Mapping) else None
    if not isinstance(train, Mapping) or not isinstance(optimizer, Mapping):
        return False
    return optimizer_state_sharded(
        str(train.get("optimizer_sharding", "auto")), str(optimizer.get("state_dtype"))
    )


class JobGroup:
    """One job's share of the group: its collectives, its arrivals, its stop keys."""

    def __init__(self, nodes: NodeGroup, seq: int, job_id: str, *, sharded: bool = False):
        self.nodes = nodes
        self.rank = nodes.rank
        self.world_size = nodes.world_size
        self.job_id = job_id
        self.store = dist.PrefixStore(f"rp/job/{seq}/", nodes.store)
        self.lost: str | None = None
        """Set when a node died or went silent during this job (not when it left)."""
        self.left_as: str | None = None
        """The state another node left the job in (``cancelled``, ``failed``, ...)."""
        self.left_by: int | None = None
        """The rank of that node."""
        self.left_why: str | None = None
        """Why it left: its job's message there."""
        self.cancelled: Callable[[], bool] = lambda: False
        """Set by the trainer: the local job stopped, give up waiting."""
        self.timeline: TimelineRecorder | None = None
        """Set by the trainer's run (observability): told of every collective completed,
        how long this node waited for the others and how long the collective took."""
        self.first_step = 1
        """The run's first step: a per-step collective's ``count`` is its step's place in
        the run (PER_STEP_COLLECTIVES)."""
        # A fresh process group per job (Note [arrive before a collective]); every rank
        # creates it at the same point: after the announcement, before anything else.
        timeout = datetime.timedelta(seconds=nodes.timeout_s)
        self.pg = dist.new_group(backend="gloo", timeout=timeout)
        self.pg_gather = dist.new_group(backend="gloo", timeout=timeout) if sharded else None
        """A sharded job's all-gathers of updated weights, issued by the optimizer thread
        while the reducer thread uses ``pg`` (Note [gathered before published])."""
        self.pg_checkpoint = dist.new_group(backend="gloo", timeout=timeout) if sharded else None
        """A sharded job's gathers of background checkpoints, issued by the checkpoint
        writer thread while training goes on (Note [sharded background checkpoint] in
        roundpipe.coordinator.training.sharded_optimizer)."""
        self._last_check = 0.0
        self._problem_lock = threading.Lock()
        self.waiting: str | None = None
        """What this node has been waiting for at a collective for more than
        WAIT_REPORT_AFTER_S (which nodes, and why where they said), else None."""
        self._note: str | None = None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def microbatches(self, num_microbatches: int) -> range:
        return node_microbatches(num_microbatches, self.rank, self.world_size)

    # -- leaving ----------------------------------------------------------------------

    def leave(self, reason: str) -> None:
        """Tell the other nodes this node left the job and why (they stop waiting)."""
        try:
            self.store.set(f"stop/{self.rank}", reason)
        except Exception:  # the store is gone: the others notice without us
            pass

    def problem(self, ranks: range | None = None) -> str | None:
        """Why the job cannot go on as a group: a node (of ``ranks``, default all; this
        one is never its own problem) left it or went silent. Asks the store at most
        once a second."""
        with self._problem_lock:  # asked by the run loop and the all-reduce thread
            return self._problem(range(self.world_size) if ranks is None else ranks)

    def _problem(self, ranks: range) -> str | None:
        now = time.monotonic()
        if now - self._last_check < 1.0:
            return None
        self._last_check = now
        nodes = self.nodes
        if nodes.store_lost is not None:
            self.lost = nodes.store_lost
            return nodes.store_lost
        try:
            for rank in ranks:
                if rank != self.rank and self.store.check([f"stop/{rank}"]):
                    why = self.store.get(f"stop/{rank}").decode()
                    self.left_as, _, self.left_why = (part.strip() for part in why.partition(":"))
                    self.left_by = rank
                    return f"{nodes.describe(rank)} left the job: {why}"
            silent = [r for r in nodes.silent_nodes() if r in ranks]
        except (RuntimeError, OSError) as exc:
            self.lost = f"rank 0's store stopped answering: {exc}"
            return self.lost
        if silent:
            names = ", ".join(nodes.describe(r) for r in silent)
            self.lost = (
                f"{names} sent no heartbeat for {nodes.timeout_s:.0f}s (--dist-timeout): "
                "dead or frozen"
            )
            return self.lost
        return None

    # -- waiting ----------------------------------------------------------------------

    def set_note(self, note: str | None) -> None:
        """Say why this node is not at the next collective yet (e.g. it has no worker),
        for the nodes waiting there; None: nothing holds it up. Only changes are written."""
        if note == self._note:
            return
        self._note = note
        try:
            self.store.set(f"note/{self.rank}", note or "")
        except Exception:  # the store is gone: problem() says so
            pass

    def _missing(self, name: str, count: int) -> str:
        """The nodes that have not arrived at collective ``name`` a ``count``-th time,
        each with its note."""
        missing = []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            key = f"arrived/{name}/{rank}"
            if self.store.check([key]) and int(self.store.get(key)) >= count:
                continue
            note = ""
            if self.store.check([f"note/{rank}"]):
                note = self.store.get(f"note/{rank}").decode()
            missing.append(self.nodes.describe(rank) + (f": {note}" if note else ""))
        return "; ".join(missing) or "the other nodes"

    def _report_wait(
        self, name: str, count: int, what: str, waited_s: float, *, log_it: bool
    ) -> None:
        try:
            missing = self._missing(name, count)
        except (RuntimeError, OSError):  # the store is gone: problem() says so
            return
        self.waiting = f"waiting {waited_s:.0f}s for {what}; not there yet: {missing}"
        if log_it:
            log.warning("[multinode] job %s (rank %d): %s", self.job_id, self.rank, self.waiting)

    # -- collectives (Note [arrive before a collective]) --------------------------------

    def arrive(self, name: str, count: int, what: str) -> None:
        """Wait until every node has arrived at collective ``name`` for the ``count``-th
        time. Raises InterruptedError if this job was stopped here, GroupError if another
        node left or went silent. A long wait is reported (``waiting``, the log)."""
        self._arrive(name, count, what)
        # Test point: this node dies where every other node has entered the collective.
        if os.environ.get(COLLECTIVE_FAULT_ENV) == f"kill@{name}#{count}":
            log.error("[multinode] %s: killed entering %s", COLLECTIVE_FAULT_ENV, what)
            os.kill(os.getpid(), signal.SIGKILL)

    def _arrive(self, name: str, count: int, what: str) -> None:
        key = f"arrive/{name}"
        target = count * self.world_size
        if int(self.store.add(key, 1)) >= target:
            return  # the last to arrive: nobody waits for it
        # Only a node that waits says that it arrived: who is missing, if a wait is long.
        self.store.set(f"arrived/{name}/{self.rank}", str(count))
        sleep = _POLL_S
        start = time.monotonic()
        report_at, log_at = start + WAIT_REPORT_AFTER_S, 0.0
        try:
            while int(self.store.add(key, 0)) < target:
                stop: Exception | None = None
                if self.cancelled():
                    stop = InterruptedError(f"stopped waiting for {what}")
                elif (problem := self.problem()) is not None:
                    stop = GroupError(f"while waiting for {what}: {problem}")
                if stop is not None:
                    if self._withdraw(key, target):
                        raise stop
                    return  # every node arrived meanwhile and entered: join them
                now = time.monotonic()
                if now >= report_at:
                    log_it = now >= log_at  # the status every few seconds, the log less often
                    self._report_wait(name, count, what, now - start, log_it=log_it)
                    report_at = now + WAIT_REPORT_AFTER_S
                    if log_it:
                        log_at = now + WAIT_REPORT_EVERY_S
                time.sleep(sleep)
                sleep = min(sleep * 2, _POLL_MAX_S)
        finally:
            if self.waiting is not None:
                log.info(
                    "[multinode] job %s (rank %d): waited %.0fs for %s; the wait is over",
                    self.job_id,
                    self.rank,
                    time.monotonic() - start,
                    what,
                )
                self.waiting = None

    def _withdraw(self, key: str, target: int) -> bool:
        """Take back this node's arrival; False if it is too late: every node had arrived
        meanwhile, so the others are inside the collective and this node must enter it
        too (else they would wait there for the collective timeout)."""
        before = int(self.store.add(key, -1)) + 1
        if before >= target:
            self.store.add(key, 1)
            return False
        return True

    @contextlib.contextmanager
    def _collective(
        self, name: str, count: int, what: str, nbytes: int, step: int | None = None
    ) -> Iterator[None]:
        """Arrive at collective ``name`` (its ``count``-th time), then run the body: the
        collective itself. Its failure is named (``_collective_failed``); its times go to
        the timeline, under ``step`` (default: a per-step collective's from ``count``)."""
        began = time.time()
        self.arrive(name, count, what)
        entered = time.time()
        try:
            yield
        except RuntimeError as exc:
            raise self._collective_failed(what, exc) from None
        timeline = self.timeline
        if timeline is not None:  # observability
            kind = name.split("/", 1)[0]
            if step is None and kind in PER_STEP_COLLECTIVES:
                step = self.first_step + count - 1
            timeline.collective(name, step, began, entered, time.time(), nbytes)

    def all_reduce(self, tensors: list[torch.Tensor], name: str, count: int, what: str) -> None:
        """Sum ``tensors`` over all nodes, in place."""
        with self._collective(name, count, what, _nbytes(tensors)):
            works = [dist.all_reduce(t, group=self.pg, async_op=True) for t in tensors]
            for work in works:
                work.wait()

    def all_reduce_optimizer(
        self, tensors: list[torch.Tensor], name: str, count: int, what: str
    ) -> None:
        """Sum ``tensors`` over all nodes, in place, on ``pg_gather``: the optimizer
        thread's collectives of a sharded job (Note [clipping a sharded gradient] in
        roundpipe.coordinator.training.sharded_optimizer), ordered with its all-gathers
        and never interleaved with the reducer thread's collectives on ``pg``."""
        assert self.pg_gather is not None
        with self._collective(name, count, what, _nbytes(tensors)):
            for t in tensors:
                dist.all_reduce(t, group=self.pg_gather)

    def broadcast(
        self, tensors: list[torch.Tensor], what: str, name: str = "broadcast", count: int = 1
    ) -> None:
        """Copy rank 0's ``tensors`` into every node's, in place."""
        with self._collective(name, count, what, _nbytes(tensors)):
            for t in tensors:
                dist.broadcast(t, src=0, group=self.pg)

    def all_gather(
        self, flat: torch.Tensor, name: str, count: int, what: str, step: int | None = None
    ) -> None:
        """Chunk r of ``flat`` (W equal chunks, rank-major) from rank r into every node's
        ``flat``, in place (on ``pg_gather``): one broadcast per rank, not gloo's
        all-gather (Note [sharded collectives over gloo] in
        roundpipe.coordinator.training.sharded_optimizer). ``step``: the step it belongs
        to, where that is not the ``count``-th of the run (steps that loss scaling
        skipped gather nothing)."""
        assert self.pg_gather is not None
        chunks = flat.chunk(self.world_size)
        with self._collective(name, count, what, _nbytes([flat]), step):
            works = [
                dist.broadcast(chunk, src=rank, group=self.pg_gather, async_op=True)
                for rank, chunk in enumerate(chunks)
            ]
            for work in works:
                work.wait()

    def gather(
        self,
        tensor: torch.Tensor,
        gathered: list[torch.Tensor] | None,
        name: str,
        count: int,
        what: str,
        *,
        background: bool = False,
    ) -> None:
        """Rank 0's ``gathered`` = every node's ``tensor``, by rank (on ``pg``, or with
        ``background`` on ``pg_checkpoint``: the checkpoint writer thread's)."""
        group = self.pg_checkpoint if background else self.pg
        assert group is not None
        with self._collective(name, count, what, _nbytes([tensor]) * self.world_size):
            dist.gather(tensor, gathered, dst=0, group=group)

    def _collective_failed(self, what: str, exc: BaseException) -> GroupError:
        """The error for a failed collective, naming the node behind it: gloo names only
        an address, so wait (at most the group timeout) until the heartbeats or a stop
        key say which node is gone."""
        reason = _gloo_reason(exc)
        deadline = time.monotonic() + self.nodes.timeout_s + 2 * HEARTBEAT_INTERVAL_S
        while time.monotonic() < deadline:
            problem = self.problem()
            if problem is not None:
                reason = f"{reason}; {problem}"
                break
            time.sleep(0.2)
        self.lost = reason
        return GroupError(f"{what} failed: {reason}")

    # -- the job's end ------------------------------------------------------------------

    def finished(self) -> None:
        """Rank 0: the job is done (its last checkpoint and the model written); the
        other nodes, waiting in ``wait_finished``, succeed too."""
        self.store.set("finished", "1")

    def wait_finished(self, what: str, *, stopped: Callable[[], bool]) -> None:
        """A node other than rank 0, its share trained: wait until rank 0 says the job is
        done (``finished``). The job's outcome is rank 0's: it may yet fail there (weights
        that are not finite at its last checkpoint, its model not written). Raises
        GroupError if rank 0 left the job (``left_as`` says how) or went silent, or its
        store is lost; another node that leaves now changes nothing (rank 0 no longer
        waits for any). InterruptedError once ``stopped()`` (this node's job was
        cancelled or its coordinator is stopping)."""
        sleep = _POLL_S
        self.waiting = f"waiting for {what}"
        try:
            while not self._says_finished(what):
                if stopped():
                    raise InterruptedError(f"stopped waiting for {what}")
                if (problem := self.problem(range(1))) is not None:  # rank 0's alone
                    raise GroupError(f"while waiting for {what}: {problem}")
                time.sleep(sleep)
                sleep = min(sleep * 2, _POLL_MAX_S)
        finally:
            self.waiting = None

    def _says_finished(self, what: str) -> bool:
        try:
            return self.store.check(["finished"])
        except (RuntimeError, OSError) as exc:
            self.lost = f"rank 0's store stopped answering: {exc}"
            raise GroupError(f"while waiting for {what}: {self.lost}") from None

    def exchange(self, name: str, value: str, what: str) -> list[str]:
        """Every node's ``value`` for ``name``, by rank (through the store)."""
        self.store.set(f"x/{name}/{self.rank}", value)
        self.arrive(f"x/{name}", 1, what)
        return [self.store.get(f"x/{name}/{r}").decode() for r in range(self.world_size)]

    def close(self) -> None:
        for pg in (self.pg, self.pg_gather, self.pg_checkpoint):
            if pg is None:
                continue
            try:
                dist.destroy_process_group(pg)
            except Exception:  # a broken group: nothing to release that exiting would not
                pass


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _gloo_reason(exc: BaseException) -> str:
    text = str(exc)
    if "Connection closed by peer" in text or "Connection reset" in text:
        return "a node closed its connection (its coordinator died)"
    if "Timed out" in text or "timed out" in text or "Timeout" in text:
        return "a node did not take part within the collective timeout (--dist-timeout)"
    return text.splitlines()[0][:500] if text else type(exc).__name__


class GradientReducer:
    """The thread that all-reduces each layer's gradient of every step (Note [reduced
    before stepped]), a bucket of layers at a time (Note [gradient buckets]), and, after
    the last layer, the step's loss.

    ``layers`` is the order, the same on every node (descending: the tail's gradient is
    complete first). ``wait_grads(layer, k)`` blocks until this node's share is in the
    arena; ``grads(layer, k)`` are the tensors holding it, reduced in place (the same
    shapes on every node, whatever its plan). ``bucket_bytes``: ``train.grad_bucket_mb``
    in bytes.
    """

    def __init__(
        self,
        group: JobGroup,
        *,
        layers: list[int],
        first_step: int,
        last_step: int,
        wait_grads: Callable[[int, int], None],
        grads: Callable[[int, int], list[torch.Tensor]],
        stopped: Callable[[], bool],
        wake: Callable[[str], None],
        shards: ZeroShards | None = None,
        transport: torch.dtype = torch.float32,
        bucket_bytes: float = 0,
    ):
        self.group = group
        self.layers = layers
        self.shards = shards
        """Sharded optimizer state: reduce-scatter, each node keeps the sum of its shard
        only (roundpipe.coordinator.training.sharded_optimizer); None: all-reduce."""
        self.transport = transport
        """The dtype gradients cross the network in (``train.grad_transport``)."""
        self._packer = (
            shards
            if shards is not None
            else ZeroShards(
                group, group.rank, group.world_size, str(transport).removeprefix("torch.")
            )
        )
        """What packs and reduces: the shards, or, replicated, a packer in the sharded
        mode's buffer layout (Note [one layout for both reductions])."""
        self.first_step, self.last_step = first_step, last_step
        self._wait_grads = wait_grads
        self._grads = grads
        self._stopped = stopped
        self._wake = wake
        self._cv = threading.Condition()
        self._reduced: dict[int, int] = {layer: first_step - 1 for layer in layers}
        self._local_loss: dict[int, float] = {}
        self._global_loss: dict[int, float] = {}
        self.error: BaseException | None = None
        self.reduce_s: dict[int, float] = {}
        """Seconds spent inside all-reduces per step (waiting for other nodes included)."""
        layer_bytes = [
            (layer, sum(t.numel() * transport.itemsize for t in grads(layer, first_step)))
            for layer in layers
        ]
        self.bytes_per_step = sum(n for _, n in layer_bytes)
        """Bytes of gradients reduced per step (in the transport dtype)."""
        self.buckets = gradient_buckets(layer_bytes, bucket_bytes)
        """The layers reduced together, in order (Note [gradient buckets]); a sharded
        job's optimizer all-gathers its weights in the same buckets."""
        self.thread = threading.Thread(
            target=self._run, name=f"rp-allreduce-{group.job_id}", daemon=True
        )

    def start(self) -> None:
        log.info(
            "[multinode] job %s: %d layers' gradients reduced in %d collective(s) per step: %s",
            self.group.job_id,
            len(self.layers),
            len(self.buckets),
            ", ".join(bucket_name("grad", b) for b in self.buckets),
        )
        self.thread.start()

    def _run(self) -> None:
        try:
            for k in range(self.first_step, self.last_step + 1):
                spent = 0.0
                for bucket in self.buckets:
                    for layer in bucket:
                        self._wait_grads(layer, k)
                    started = time.perf_counter()
                    self._reduce(
                        [t for layer in bucket for t in self._grads(layer, k)],
                        bucket_name("grad", bucket),
                        k - self.first_step + 1,
                        f"{bucket_text(bucket)}'s gradient of step {k} from every node",
                    )
                    spent += time.perf_counter() - started
                    with self._cv:
                        for layer in bucket:
                            self._reduced[layer] = k
                        self._cv.notify_all()
                with self._cv:
                    while k not in self._local_loss:
                        if self._stopped():
                            raise InterruptedError
                        self._cv.wait(timeout=0.5)
                    loss = torch.tensor([self._local_loss.pop(k)], dtype=torch.float64)
                self.group.all_reduce(
                    [loss], "loss", k - self.first_step + 1, f"the loss of step {k}"
                )
                with self._cv:
                    self._global_loss[k] = float(loss)
                    self.reduce_s[k] = spent
                    self._cv.notify_all()
                self._wake("loss-reduced")
            if self.reduce_s:
                log.info(
                    "[multinode] job %s %s: %d bytes of gradients per step, %.4fs per step "
                    "on average (waiting for the slowest node included)",
                    self.group.job_id,
                    "all-reduce" if self.shards is None else "reduce-scatter",
                    self.bytes_per_step,
                    sum(self.reduce_s.values()) / len(self.reduce_s),
                )
        except InterruptedError:
            pass  # the job stopped
        except BaseException as exc:
            if not self._stopped():
                log.error("[multinode] gradient all-reduce stopped: %s", exc)
                self.error = exc
                self._wake("group-error")

    def _reduce(self, tensors: list[torch.Tensor], name: str, count: int, what: str) -> None:
        """Sum ``tensors`` over the nodes in place: all of them, or with sharded state
        this node's shard of them; in the transport dtype."""
        if self.shards is not None:
            self._packer.reduce_scatter(tensors, name, count, what)
        else:
            self._packer.all_reduce(tensors, name, count, what)

    # -- for the optimizer and the run loop -----------------------------------------------

    def reduced(self, layer: int, k: int) -> bool:
        with self._cv:
            return self._reduced[layer] >= k

    def wait_reduced(self, layer: int, k: int) -> None:
        with self._cv:
            while self._reduced[layer] < k:
                # Stopped either way: the run loop reports the group's error.
                if self.error is not None or self._stopped():
                    raise InterruptedError(f"stopped waiting for layer {layer}'s gradient")
                self._cv.wait(timeout=0.5)

    def set_local_loss(self, k: int, loss: float) -> None:
        with self._cv:
            self._local_loss[k] = loss
            self._cv.notify_all()

    def global_loss(self, k: int) -> float | None:
        """The step's loss summed over the nodes, once reduced (else None)."""
        with self._cv:
            return self._global_loss.get(k)

    def forget_loss(self, k: int) -> None:
        with self._cv:
            self._global_loss.pop(k, None)

    def join(self, timeout_s: float) -> bool:
        """Wait for the thread to end; False if it is still inside a collective."""
        self.thread.join(timeout=timeout_s)
        return not self.thread.is_alive()
