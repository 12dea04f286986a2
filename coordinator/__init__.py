"""The coordinator: owns every job's training state in shared memory and drives the workers.

- :mod:`~roundpipe.coordinator.daemon`: ``roundpipe-coordinator`` (sockets, workers,
  job queue, heartbeats); :mod:`~roundpipe.coordinator.auth`: who may connect and do
  what; :mod:`~roundpipe.coordinator.sdnotify`: systemd readiness.
- :mod:`~roundpipe.coordinator.jobspec`, :mod:`~roundpipe.coordinator.admission`,
  :mod:`~roundpipe.coordinator.memory`, :mod:`~roundpipe.coordinator.paths`: what a job
  asks for, checked before it runs.
- :mod:`~roundpipe.coordinator.trainer`: one job from start to export;
  :mod:`~roundpipe.coordinator.data`: its token rows (:mod:`~roundpipe.coordinator.records`
  file formats, :mod:`~roundpipe.coordinator.instruct` chat and prompt labels); :mod:`~roundpipe.coordinator.layout`:
  its arenas; :mod:`~roundpipe.coordinator.schedule`: its tasks per iteration;
  :mod:`~roundpipe.coordinator.optimizer`: the CPU optimizer
  (:mod:`~roundpipe.coordinator.quantized_state` its 8-bit states);
  :mod:`~roundpipe.coordinator.checkpoint`, :mod:`~roundpipe.coordinator.jobstore`: what
  survives a restart (:mod:`~roundpipe.coordinator.snapshot`: checkpoints written in the
  background); :mod:`~roundpipe.coordinator.recovery`: lost and slow workers.
- :mod:`~roundpipe.coordinator.multinode`: several coordinators (servers) training one
  job as a data-parallel group.
- :mod:`~roundpipe.coordinator.planning` (a package: hardware, costs, search, simulator,
  baselines, profile, the `roundpipe plan` command): how the
  model is cut into stages, and what that plan is predicted to do.
- :mod:`~roundpipe.coordinator.timeline`, :mod:`~roundpipe.coordinator.metrics`,
  :mod:`~roundpipe.coordinator.tensorboard`: what a job did, for people watching it.

Imports go one way: coordinator -> shared, protocol (never the worker package).
"""
