"""A stateless worker: uploads a stage's weights, computes, writes results back, forgets.

- :mod:`~roundpipe.worker.daemon`: ``roundpipe-worker`` (its socket, task queue, heartbeats);
- :mod:`~roundpipe.worker.runtime`: ``WorkerCore``, one task at a time, socket-free;
- :mod:`~roundpipe.worker.executor`: a stage's forward, backward and fused tail on a device;
- :mod:`~roundpipe.worker.transfer`: every copy between shared memory and the device
  (cpu, emulated and CUDA engines);
- :mod:`~roundpipe.worker.faults`: fault injection for tests and the chaos harness.

Imports go one way: worker -> shared, protocol (never the coordinator package).
"""
