"""Runtime code shared by the coordinator and the workers.

- :mod:`roundpipe.shared.arena`: named shared-memory arenas and zero-copy tensor views.
- :mod:`roundpipe.shared.events`: the event table (sequence counters, fenced, futex waits).
- :mod:`roundpipe.worker.cuda`: in-place pinning and interprocess CUDA event rings.
- :mod:`roundpipe.shared.model`, :mod:`roundpipe.shared.plan`: a causal LM as a sequence
  of layers, and stage partitions over it (the contract between the coordinator's memory
  layout and the workers' execution).
"""
