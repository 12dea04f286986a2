"""Runtime code shared by the coordinator and the workers (and the client, for a few).

- :mod:`roundpipe.shared.arena`: named shared-memory arenas and zero-copy tensor views.
- :mod:`roundpipe.shared.events`: the event table (sequence counters, memory barriers,
  futex waits) and the name of its arena.
- :mod:`roundpipe.shared.handoff`: activation hand-offs between workers (tickets, landed
  marks) in the events arena.
- :mod:`roundpipe.shared.model`, :mod:`roundpipe.shared.families`,
  :mod:`roundpipe.shared.plan`: a causal LM as a sequence of layers, the model families
  it supports, and stage partitions over it (the contract between the coordinator's
  memory layout and the workers' execution).
- :mod:`roundpipe.shared.keys`: CurveZMQ key files; :mod:`roundpipe.shared.units`: sizes
  and rates; :mod:`roundpipe.shared.defaults`: defaults of the client, CLI and daemons;
  :mod:`roundpipe.shared.polling`: the daemons' receive loop.

Imports go one way: shared -> protocol (never the coordinator or the worker).
"""
