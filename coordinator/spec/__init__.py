"""The job spec and its data: what a job asks for and which files it may touch.

The spec:

- :mod:`~roundpipe.coordinator.spec.errors`: JobSpecError (every problem, with its field)
  and DataError.
- :mod:`~roundpipe.coordinator.spec.choices`: the values fields may take (formats,
  packing, dtypes, schedules, ...).
- :mod:`~roundpipe.coordinator.spec.sections`: the sections' fields, types and defaults;
  which fields are paths.
- :mod:`~roundpipe.coordinator.spec.section_checks`: the rules of each section.
- :mod:`~roundpipe.coordinator.spec.unknown_keys`: misspelt keys, with did-you-mean hints.
- :mod:`~roundpipe.coordinator.spec.spec_yaml`: parsing a spec's YAML text safely.
- :mod:`~roundpipe.coordinator.spec.jobspec`: JobSpec, the whole spec: built from YAML, a
  dict or objects, checked as a whole (across sections, against the data, the model's
  config and a checkpoint to resume from).

Files:

- :mod:`~roundpipe.coordinator.spec.paths`: the roots a job's paths must stay below, and
  who owns an output.
- :mod:`~roundpipe.coordinator.spec.checkpoint_format`: a checkpoint's names on disk and
  its manifest (read when ``model.resume_from`` is checked).
- :mod:`~roundpipe.coordinator.spec.tokenizers`: tokenizer directories.

Data (file -> rows of a source -> documents -> packed token rows -> batches):

- :mod:`~roundpipe.coordinator.spec.sources`: rows of JSONL, Parquet and ``datasets``
  sources.
- :mod:`~roundpipe.coordinator.spec.instruct`: chat and prompt/completion labels.
- :mod:`~roundpipe.coordinator.spec.formats`: which format a file holds (its first row).
- :mod:`~roundpipe.coordinator.spec.documents`: a file's documents, as token ids and labels.
- :mod:`~roundpipe.coordinator.spec.data`: packing into rows, and the batches of each step.

Imports nothing of the coordinator's other rooms.
"""
