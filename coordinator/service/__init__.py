"""The service: ``roundpipe-coordinator``, the daemon that clients and workers talk to.

- :mod:`~roundpipe.coordinator.service.main`: the command line and start-up.
- :mod:`~roundpipe.coordinator.service.daemon`: the I/O loop: the ROUTER socket and
  where each message goes.
- :mod:`~roundpipe.coordinator.service.connections`: the connection budget and
  handshake timeouts.
- :mod:`~roundpipe.coordinator.service.auth`: who may connect and do what.
- :mod:`~roundpipe.coordinator.service.workers`: the worker table, liveness and fencing.
- :mod:`~roundpipe.coordinator.service.requests`: the client requests and the admission
  thread; :mod:`~roundpipe.coordinator.service.admission`: a spec checked in a child
  process.
- :mod:`~roundpipe.coordinator.service.job_runner`: the job thread, a Trainer per job.
- :mod:`~roundpipe.coordinator.service.jobs`: every job's record and state machine;
  :mod:`~roundpipe.coordinator.service.jobstore`: the SQLite store behind it.
- :mod:`~roundpipe.coordinator.service.figures`: a running job's figures, read off its
  trainer; :mod:`~roundpipe.coordinator.service.metrics`: Prometheus;
  :mod:`~roundpipe.coordinator.service.sdnotify`: systemd readiness and watchdog.

The top room: it may import every other room of the coordinator; none imports it.
"""
