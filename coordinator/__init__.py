"""The coordinator: owns every job's training state in shared memory and drives the workers.

Four rooms, each a sub-package whose docstring lists its modules:

- :mod:`~roundpipe.coordinator.spec`: the job spec and its data (what a job asks for,
  which files it may touch, its token rows).
- :mod:`~roundpipe.coordinator.planning`: how a model is cut into stages and what that
  plan is predicted to do (hardware, cost model, search, simulator, baselines).
- :mod:`~roundpipe.coordinator.training`: one job from plan to exported model, socket-free
  (arenas, schedule, CPU optimizer, checkpoints, recovery, multi-node).
- :mod:`~roundpipe.coordinator.service`: the daemon (sockets, auth, the job book and
  store, admission, metrics).

Imports go one way: service -> training -> planning, spec; planning and spec import no
other room. The coordinator imports shared and protocol, never the worker package
(tests/test_package_layout.py checks all of it).
"""
