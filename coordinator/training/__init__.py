"""Training: one job from its plan to its exported model, socket-free.

- :mod:`~roundpipe.coordinator.training.trainer`: the job's life (prepare, run, export),
  composed of :mod:`~roundpipe.coordinator.training.job_planner` (its plan and layout),
  :mod:`~roundpipe.coordinator.training.optimizer_thread` (its weight updates),
  :mod:`~roundpipe.coordinator.training.checkpointer` (its checkpoints, written and
  restored), :mod:`~roundpipe.coordinator.training.exporter` (its model in Hugging Face
  layout), :mod:`~roundpipe.coordinator.training.job_output` (its output directory),
  :mod:`~roundpipe.coordinator.training.group_member` (its node of a data-parallel group)
  and :mod:`~roundpipe.coordinator.training.progress_log` (its progress events); it
  stops with :mod:`~roundpipe.coordinator.training.job_errors`.
- :mod:`~roundpipe.coordinator.training.layout`: its arenas and counters;
  :mod:`~roundpipe.coordinator.training.schedule`: its tasks per iteration;
  :mod:`~roundpipe.coordinator.training.memory`: the host memory it needs.
- :mod:`~roundpipe.coordinator.training.optimizer`: the layer-wise CPU optimizer
  (:mod:`~roundpipe.coordinator.training.quantized_state` its 8-bit states).
- :mod:`~roundpipe.coordinator.training.checkpoint`: atomic checkpoints
  (:mod:`~roundpipe.coordinator.training.snapshot` written in the background).
- :mod:`~roundpipe.coordinator.training.recovery`: lost and slow workers' tasks.
- :mod:`~roundpipe.coordinator.training.multinode`: a data-parallel group of coordinators.
- :mod:`~roundpipe.coordinator.training.job_events`: the seam to the service (typed events
  in and out, the WorkerPort).
- :mod:`~roundpipe.coordinator.training.timeline`,
  :mod:`~roundpipe.coordinator.training.tensorboard`: what the job did.

Imports the spec and planning rooms, never the service.
"""
