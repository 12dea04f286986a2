"""The job spec and its data: what a job asks for and which files it may touch.

- :mod:`~roundpipe.coordinator.spec.jobspec`: the spec's schema, defaults and checks.
- :mod:`~roundpipe.coordinator.spec.paths`: the roots a job's paths must stay below, and
  who owns an output.
- :mod:`~roundpipe.coordinator.spec.data`: token rows and batches from the data files
  (:mod:`~roundpipe.coordinator.spec.records` the file formats,
  :mod:`~roundpipe.coordinator.spec.instruct` chat and prompt/completion labels).

Imports nothing of the coordinator's other rooms.
"""
