"""The service: ``roundpipe-coordinator``, the daemon that clients and workers talk to.

- :mod:`~roundpipe.coordinator.service.daemon`: sockets, the worker table, the job thread.
- :mod:`~roundpipe.coordinator.service.auth`: who may connect and do what.
- :mod:`~roundpipe.coordinator.service.jobs`: every job's record and state machine;
  :mod:`~roundpipe.coordinator.service.jobstore`: the SQLite store behind it.
- :mod:`~roundpipe.coordinator.service.admission`: a spec checked in a child process.
- :mod:`~roundpipe.coordinator.service.metrics`: Prometheus;
  :mod:`~roundpipe.coordinator.service.sdnotify`: systemd readiness and watchdog.

The top room: it may import every other room of the coordinator; none imports it.
"""
