"""A stateless worker: uploads a stage's weights, computes, writes results back, forgets.

Read top to bottom; imports go only down this list:

- :mod:`~roundpipe.worker.daemon`: ``roundpipe-worker`` (its socket, task queue, heartbeats);
- :mod:`~roundpipe.worker.runtime`: ``WorkerCore``, one task at a time, socket-free: the
  waits, the microbatch stream, the downloads and the signals;
- :mod:`~roundpipe.worker.prefetch`: the next queued task's weights uploaded while the
  current one computes;
- :mod:`~roundpipe.worker.job_state`: what the worker keeps per job (arenas, model
  skeleton, slot views), and the copies of a task in flight;
- :mod:`~roundpipe.worker.executor`: a stage's forward, backward and fused tail on a device;
- :mod:`~roundpipe.worker.transfer`: every copy between shared memory and the device
  (cpu, emulated and CUDA engines);
- :mod:`~roundpipe.worker.cuda`: in-place pinning and interprocess CUDA event rings, for
  the CUDA engine;
- :mod:`~roundpipe.worker.faults`: fault injection for tests and the chaos harness.

So: daemon -> runtime -> prefetch -> job_state -> executor -> transfer -> cuda. The
worker imports shared and protocol, never the coordinator package.
"""
