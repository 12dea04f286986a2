"""The job spec: everything a fine-tuning job needs, validated before any work starts.

A spec is built three ways, all ending in the same validation:

* from a YAML file: :func:`load_job_spec` (relative paths are relative to the file);
* from a plain dict: :meth:`JobSpec.from_dict` (this is also how it arrives at the
  coordinator: the client sends :meth:`JobSpec.to_dict`, a msgpack-able dict);
* as Python objects: ``JobSpec(model=ModelSpec(...), data=DataSpec(...), ...)``.

The section classes (:class:`ModelSpec`, :class:`DataSpec`, ...) are plain frozen
records; they only normalise (paths made absolute, lists made tuples). All checking
happens in one place, when a :class:`JobSpec` is constructed, so that a single
:class:`JobSpecError` can list *every* problem in the spec at once, across sections,
each with its field path, the value given and what is expected.

Checks that need the model's config (sequence length against
``max_position_embeddings``, the data's token ids against ``vocab_size``) live in
:func:`validate_against_model`, which the coordinator calls once it has built the config;
construction already runs the cheap form of that check (``config.json`` of a path model,
or the transformers config class of an architecture model). Checks that need the data
(the dataset is not empty, lines parse) happen in :mod:`roundpipe.coordinator.spec.data`.

See docs/job-spec.md for every field with its default and an example.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from roundpipe.shared.families import FAMILIES

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "ARCHITECTURES",
    "DATA_FORMATS",
    "DTYPES",
    "HF_NO_DECAY",
    "OPTIMIZERS",
    "SCHEDULES",
    "SCHEDULE_CONVENTIONS",
    "TOKENIZER_FILES",
    "BatchSpec",
    "DataSpec",
    "FieldError",
    "JobSpec",
    "JobSpecError",
    "LoraSpec",
    "ModelSpec",
    "OptimizerSpec",
    "OutputSpec",
    "PATH_ACCESS",
    "PATH_FIELDS",
    "PathField",
    "TrainSpec",
    "has_tokenizer_files",
    "load_job_spec",
    "model_config_from_spec",
    "read_path",
    "staging_limit_bytes",
    "validate_against_model",
    "write_path",
]

ARCHITECTURES = tuple(FAMILIES)
"""``model.architecture`` choices: the model_type of every declared family
(roundpipe.shared.families)."""
DATA_FORMATS = ("auto", "jsonl_text", "jsonl_tokens", "text", "chat", "prompt_completion")
DATA_PACKING = ("documents", "concat", "none")
DATA_LOSS_ON = ("assistant", "all")
DATA_OVERLONG = ("truncate", "refuse")
_PACKING_ALIASES: dict[Any, str] = {True: "documents", False: "none"}
DATA_COLUMNS = ("text", "messages", "prompt", "completion", "input_ids", "labels")
DTYPES = ("float32", "bfloat16", "float16")
SCHEDULES = ("constant", "linear", "cosine")
OPTIMIZERS = ("adamw", "sgd")
STATE_DTYPES = ("float32", "int8")
"""``optimizer.state_dtype``: how AdamW's moments are stored (docs/memory.md)."""
SCHEDULE_CONVENTIONS = ("hf", "one_based")
"""Which schedule position optimizer step s uses: ``hf``: s - 1, as the Hugging Face
Trainer (step 1 of a warmup has lr 0); ``one_based``: s (warmup peaks at step W)."""

HF_NO_DECAY = ("bias", "layernorm", "rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
"""The Hugging Face Trainer's rule (``Trainer.get_decay_parameter_names``): no weight
decay for biases and normalisation weights (``input_layernorm``, ``model.norm``,
``q_norm``, ...). The default of ``optimizer.no_decay``."""

# Keys a transformers config accepts without their being dataclass fields: older names
# that transformers 5 still folds into the new ones (rope_theta -> rope_parameters).
_LEGACY_CONFIG_KEYS = frozenset({"rope_theta", "rope_scaling", "torch_dtype"})


# --------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class FieldError:
    """One problem in a spec: where, what was given, what was expected."""

    path: str
    """Dotted field path, e.g. ``optimizer.lr`` (``""`` for the spec as a whole)."""
    message: str
    """Complete human-readable sentence(s), including the given value."""

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


MAX_SPEC_BYTES = 1024 * 1024
"""Largest job spec: a YAML file, or a SubmitJob message. A spec names files and holds
settings; a megabyte of it is a mistake or an attack, not a job."""

MAX_LISTED_PROBLEMS = 50
"""Problems a JobSpecError's message lists; the rest are counted (``errors`` has all)."""


class JobSpecError(ValueError):
    """A job spec is invalid. ``errors`` lists every problem found, not just the first;
    the message lists the first MAX_LISTED_PROBLEMS and counts the rest."""

    def __init__(self, errors: list[FieldError], source: str | None = None) -> None:
        self.errors = list(errors)
        self.source = source
        where = f" in {source}" if source else ""
        n = len(self.errors)
        lines = [f"invalid job spec{where} ({n} problem{'s' if n != 1 else ''}):"]
        lines += [f"  - {_clip(str(e))}" for e in self.errors[:MAX_LISTED_PROBLEMS]]
        if n > MAX_LISTED_PROBLEMS:
            lines.append(f"  ... and {n - MAX_LISTED_PROBLEMS} more problems not shown")
        super().__init__("\n".join(lines))


def _clip(text: str, limit: int = 500) -> str:
    # One problem's line: a key of a megabyte must not make a megabyte message.
    return (
        text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"
    )


class _Errors:
    """Collects problems during one validation pass."""

    def __init__(self) -> None:
        self.items: list[FieldError] = []

    def add(self, path: str, message: str) -> None:
        self.items.append(FieldError(path, message))

    def bad(self, path: str, given: Any, expected: str) -> None:
        self.add(path, f"got {_show(given)}; expected {expected}")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 8, 8, 80, 80


def _show(value: Any) -> str:
    # Tuples only exist after normalisation; the user wrote a list. reprlib, not repr: a
    # value of shared sublists (YAML aliases) can be exponentially long when written out.
    text = _REPR.repr(list(value)) if isinstance(value, tuple) else _REPR.repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    kind = "list" if isinstance(value, tuple) else type(value).__name__
    return f"{text} ({kind})"


# --------------------------------------------------------------------------- sections


def _abs_path(value: Any) -> Any:
    # Normalisation only: make a path absolute so the spec means the same thing in the
    # coordinator, whose working directory is not the client's. Anything that is not a
    # path is left for validation to report.
    if isinstance(value, os.PathLike | str) and str(value) != "":
        return os.path.abspath(os.path.expanduser(os.fspath(value)))
    return value


# Note [paths are a type]
# A field that names a file or directory is declared with read_path() or write_path(),
# never as a plain string. Everything that must treat paths specially walks the schema
# for those fields instead of keeping its own list: normalisation (_normalise_paths),
# relative paths in a YAML file (JobSpec.from_dict), and above all the coordinator's
# confinement to its --allow-read / --allow-write roots (coordinator.paths), so a new
# path field cannot be forgotten by any of them. tests/test_paths.py refuses a string
# field that is neither a path nor on its list of known non-path strings.

PATH_ACCESS = "roundpipe.path_access"
"""Field metadata key of a path field: ``"read"`` or ``"write"``."""


def read_path() -> Any:
    """A spec field naming something the coordinator reads (default ``None``)."""
    return field(default=None, metadata={PATH_ACCESS: "read"})


def write_path() -> Any:
    """A spec field naming a directory the coordinator writes into (default ``None``)."""
    return field(default=None, metadata={PATH_ACCESS: "write"})


@dataclass(frozen=True)
class PathField:
    """One path-typed field of the job spec."""

    section: str
    key: str
    access: str
    """``"read"`` or ``"write"``."""

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.key}"


def _path_fields_of(section_cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(section_cls) if PATH_ACCESS in f.metadata]


def _normalise_paths(section: Any) -> None:
    """Make every path field of a section object absolute (Note [paths are a type])."""
    for f in _path_fields_of(type(section)):
        object.__setattr__(section, f.name, _abs_path(getattr(section, f.name)))


def _freeze_seq(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Which model to train. Exactly one of ``path`` and ``architecture``."""

    path: str | None = read_path()
    """Local Hugging Face model directory (holds ``config.json`` and safetensors
    weights). Nothing is downloaded."""
    architecture: str | None = None
    """Random initialisation of a known architecture: one of ``ARCHITECTURES``."""
    config: dict[str, Any] = field(default_factory=dict)
    """With ``architecture`` only: overrides of the transformers config defaults, e.g.
    ``{"hidden_size": 128, "num_hidden_layers": 4}``. Unknown keys are errors."""
    init_seed: int | None = None
    """With ``architecture`` only: seed of the random initialisation; ``None`` uses
    ``train.seed``."""
    tokenizer: str | None = read_path()
    """Local tokenizer directory; ``None`` uses ``path`` (a path model's own tokenizer)."""
    dequantize: bool = False
    """With ``path`` only: dequantise MXFP4-packed expert weights (GPT-OSS checkpoints
    from the hub) while loading; the job trains and exports the unquantised model."""
    resume_from: str | None = read_path()
    """A RoundPipe checkpoint to continue from: a ``step-*`` checkpoint directory, a
    ``checkpoints`` directory or a job's output directory (its newest good checkpoint).
    Weights, optimizer state, step count and data cursor come from it, so the model,
    data and batch settings must be those it was written with; ``train.steps`` counts
    from 0 as before and must exceed the checkpoint's step to train further. See
    docs/checkpoints.md."""

    def __post_init__(self) -> None:
        _normalise_paths(self)
        if isinstance(self.config, Mapping) and _json_like(dict(self.config)):
            # A private deep copy (tuples become lists, as after a msgpack/YAML trip): the
            # spec must not change under the caller's feet, and must round-trip.
            object.__setattr__(self, "config", _plain(dict(self.config)))


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """LoRA adapters; when present, the base weights are frozen and only adapters train."""

    r: int = 8
    """Adapter rank (>= 1)."""
    alpha: float = 16.0
    """Scaling numerator: adapters are scaled by ``alpha / r`` (> 0)."""
    dropout: float = 0.0
    """Dropout on the adapter input, in [0, 1)."""
    target_modules: tuple[str, ...] | str = "all-linear"
    """Module names to adapt (e.g. ``["q_proj", "v_proj"]``), or ``"all-linear"`` for
    every linear layer except the LM head (PEFT's meaning)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", _freeze_seq(self.target_modules))

    def model_settings(self) -> dict[str, Any]:
        """The settings ``roundpipe.shared.model.LayeredModel`` takes for LoRA."""
        return {
            "r": self.r,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "target_modules": self.target_modules,
        }


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Training data and how it becomes fixed-length rows."""

    path: str | None = read_path()
    """Local data (required): a ``.jsonl`` or ``.parquet`` file of records, a ``.txt``
    file, or a folder saved by ``datasets`` (``save_to_disk``) or of Parquet / Arrow
    shards."""
    format: str = "auto"
    """One of ``DATA_FORMATS``. ``auto``: ``.txt``/``.text``/``.md`` is plain text; for
    records the first one decides: ``messages`` -> ``chat``, ``prompt`` + ``completion``
    -> ``prompt_completion``, ``input_ids`` -> ``jsonl_tokens``, else ``jsonl_text``."""
    text_field: str = "text"
    """Field holding the document text in ``jsonl_text`` records."""
    columns: dict[str, str] | None = None
    """Other record field names, e.g. ``{messages: conversation}``; keys from
    ``DATA_COLUMNS``, defaults the key itself."""
    split: str = "train"
    """The split of a saved ``DatasetDict`` to train on."""
    loss_on: str = "assistant"
    """``chat``: ``assistant`` trains on assistant turns only; ``prompt_completion``: on
    the completion only; ``all``: every token. Other formats train on every token (or
    on their ``labels``)."""
    chat_template: str | None = read_path()
    """A Jinja chat template file, for a tokenizer without one (or to replace its own)."""
    overlong: str = "truncate"
    """A labelled record longer than ``seq_len``: ``truncate`` it (dropped if nothing
    trained remains) or ``refuse`` the data."""
    tokenizer: str | None = read_path()
    """Local tokenizer directory; ``None`` uses the model's (``model.tokenizer``, else
    ``model.path``)."""
    seq_len: int = 1024
    """Tokens per row (>= 2); must not exceed the model's ``max_position_embeddings``."""
    shuffle: bool = True
    """Shuffle rows, with a fresh seeded order every epoch."""
    seed: int | None = None
    """Seed of the shuffle; ``None`` uses ``train.seed``."""
    packing: bool | str = True
    """``documents`` (or ``true``): documents share rows but each attends only to itself,
    with positions restarting per document; ``concat``: one stream, attention across
    documents; ``none`` (or ``false``): each document starts a new row, padded."""

    def __post_init__(self) -> None:
        _normalise_paths(self)


@dataclass(frozen=True, kw_only=True)
class BatchSpec:
    """Batch shape of one optimizer step: ``microbatch_size * num_microbatches`` rows."""

    microbatch_size: int = 1
    """Rows per microbatch (>= 1)."""
    num_microbatches: int = 8
    """Microbatches per step (>= 1). RoundPipe keeps N workers busy when this is >= N+1."""

    @property
    def global_batch_size(self) -> int:
        return self.microbatch_size * self.num_microbatches


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """The training loop."""

    steps: int = 100
    """Number of optimizer steps (>= 1)."""
    staleness: int = 1
    """0: exact (step k's gradient is taken on W_{k-1}); 1: the gradient of step k is
    taken on W_{k-2}, so the CPU optimizer overlaps the next iteration (faster)."""
    dtype: str = "bfloat16"
    """Compute dtype of the weight copies and activations: one of ``DTYPES``. Master
    weights and optimizer state are always float32."""
    seed: int = 0
    """Seed for everything not given its own seed."""
    plan: str | None = None
    """Stage partition override in the plan's string form, e.g.
    ``"F[0:3,3:5] T[5:8] B[4:5,2:4,0:2]"`` (forward stages, fused tail, backward stages;
    see docs/planning.md). ``None``: the coordinator plans."""
    replan: bool = True
    """Re-plan from the workers' measured layer times once they settle (switching when
    the new plan is predicted at least 5% faster). Ignored when ``plan`` is set."""
    grad_buffer_stages: int = 2
    """Host gradient buffer, in units of the plan's largest gradient-writing stage:
    layers of the same shape share this many stages' worth of fp32 gradient slots, and a
    backward task waits for a free slot (docs/memory.md). 0: one slot per trainable
    layer. Ignored (one slot per layer) with ``optimizer.grad_clip``."""


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """The optimizer (AdamW with decoupled weight decay, or SGD) and its learning-rate
    schedule."""

    name: str = "adamw"
    """One of ``OPTIMIZERS``: ``adamw`` (torch.optim.AdamW) or ``sgd`` (torch.optim.SGD,
    with ``momentum`` and ``nesterov``; ``weight_decay`` is then SGD's, added to the
    gradient; ``betas`` and ``eps`` are unused)."""

    lr: float = 2e-5
    """Peak learning rate (> 0)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam coefficients, each in [0, 1)."""
    eps: float = 1e-8
    """Adam epsilon (> 0)."""
    weight_decay: float = 0.01
    """Decoupled weight decay (>= 0), applied to every trainable parameter that
    ``no_decay`` does not exempt."""
    no_decay: tuple[str, ...] = HF_NO_DECAY
    """Regular expressions; a trainable tensor whose lower-cased name one of them matches
    (``re.search``) gets no weight decay. Default: the Hugging Face Trainer's rule (biases
    and norm weights); ``[]`` decays every tensor (plain ``torch.optim.AdamW``)."""
    grad_clip: float | None = None
    """Clip gradients to this global L2 norm (> 0); ``None``: no clipping. Clipping
    makes the optimizer wait for all of a step's gradients before updating any layer."""
    schedule: str = "cosine"
    """One of ``SCHEDULES``; see :class:`roundpipe.coordinator.training.optimizer.LRSchedule`."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to ``lr`` (>= 0, at most ``train.steps``)."""
    min_lr_ratio: float = 0.0
    """``linear``/``cosine`` decay to ``min_lr_ratio * lr``, in [0, 1]."""
    schedule_convention: str = "hf"
    """One of ``SCHEDULE_CONVENTIONS``: ``hf`` gives the Hugging Face Trainer's learning
    rate at every step (``get_*_schedule_with_warmup``, stepped after each optimizer
    step); ``one_based`` shifts it one step earlier (warmup reaches ``lr`` at step
    ``warmup_steps``, linear/cosine reach the minimum at the last step)."""
    momentum: float = 0.0
    """SGD momentum in [0, 1) (``name: sgd`` only; 0: plain SGD, no momentum buffer)."""
    nesterov: bool = False
    """Nesterov momentum (``name: sgd`` with ``momentum`` > 0 only)."""
    state_dtype: str = "float32"
    """One of ``STATE_DTYPES``: ``float32``, or ``int8`` for AdamW's moments block-wise
    quantized to 8 bits (~2 bytes per parameter instead of 8; docs/memory.md)."""
    threads: int = 0
    """Threads the coordinator steps the optimizer with (>= 0); 0: the coordinator's
    ``--threads`` (default: half the cores it may run on, at most 16, leaving the rest to
    the workers' host-side work). Results do not depend on it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", _freeze_seq(self.betas))
        object.__setattr__(self, "no_decay", _freeze_seq(self.no_decay))


@dataclass(frozen=True, kw_only=True)
class OutputSpec:
    """Where results go and how often."""

    dir: str | None = write_path()
    """Output directory (created if missing); ``None``: the coordinator chooses one
    under its state directory, named by job id."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many steps (>= 0); 0: only at the end. A final
    checkpoint is always written."""
    keep_last: int = 2
    """Keep this many most recent checkpoints (>= 0); 0 keeps all."""
    checkpoint_staging: str | int = "auto"
    """Host memory for writing checkpoints in the background (docs/checkpoints.md):
    ``"auto"`` (one checkpoint's state, if the machine has it to spare), a size
    (``"8GiB"`` or bytes: the most it may take), or 0 (write every checkpoint with the
    pipeline stopped)."""
    timeline: bool = True
    """Record the pipeline timeline as Chrome-trace JSON in ``<dir>/timeline/``
    (``roundpipe timeline`` draws it; docs/observability.md)."""
    tensorboard: bool = False
    """Write loss, learning rate, tokens/s, gradient norm and bubble fraction as
    TensorBoard scalars to ``<dir>/tensorboard/``."""

    def __post_init__(self) -> None:
        _normalise_paths(self)


_SECTIONS: dict[str, type] = {
    "model": ModelSpec,
    "lora": LoraSpec,
    "data": DataSpec,
    "batch": BatchSpec,
    "train": TrainSpec,
    "optimizer": OptimizerSpec,
    "output": OutputSpec,
}


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """A complete, validated job. Constructing one validates it (raises JobSpecError)."""

    model: ModelSpec
    """The model to train."""
    data: DataSpec
    """The training data."""
    lora: LoraSpec | None = None
    """LoRA adapters; ``None``: full fine-tuning of every weight."""
    batch: BatchSpec = field(default_factory=BatchSpec)
    """Microbatch size and count."""
    train: TrainSpec = field(default_factory=TrainSpec)
    """Steps, staleness, dtype, seed."""
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    """AdamW settings and learning-rate schedule."""
    output: OutputSpec = field(default_factory=OutputSpec)
    """Output directory and checkpoint policy."""

    def __post_init__(self) -> None:
        errors = _validate(self)
        if errors:
            raise JobSpecError(errors)

    # -- derived values: one definition of each default that refers to another field --

    @property
    def global_batch_size(self) -> int:
        """Rows per optimizer step."""
        return self.batch.global_batch_size

    @property
    def init_seed(self) -> int:
        """Seed of the random initialisation (``model.init_seed`` or ``train.seed``)."""
        return self.train.seed if self.model.init_seed is None else self.model.init_seed

    @property
    def data_seed(self) -> int:
        """Seed of the data shuffle (``data.seed`` or ``train.seed``)."""
        return self.train.seed if self.data.seed is None else self.data.seed

    @property
    def tokenizer_path(self) -> str | None:
        """Tokenizer directory the data pipeline uses, or ``None`` if there is none:
        ``data.tokenizer``, else ``model.tokenizer``, else the model directory if it
        holds tokenizer files. (transformers 5 "loads" a tokenizer from a directory
        without any, an empty one whose EOS id is 0; using it would put token 0
        between the documents of token data.)"""
        explicit = self.data.tokenizer or self.model.tokenizer
        if explicit is not None:
            return explicit
        path = self.model.path
        if isinstance(path, str) and has_tokenizer_files(path):
            return path
        return None

    # -- conversions --

    def to_dict(self) -> dict[str, Any]:
        """Plain, msgpack/JSON/YAML-able dict; ``JobSpec.from_dict`` turns it back."""
        return _plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any],
        *,
        base_dir: str | os.PathLike[str] | None = None,
        source: str | None = None,
    ) -> JobSpec:
        """Build and validate a spec from a dict (e.g. parsed YAML or ``to_dict()``).

        Relative paths are taken relative to ``base_dir`` (default: the current
        directory). ``source`` names the origin in error messages. Unknown or misspelt
        keys are errors, reported together with every other problem.
        """
        errors = _Errors()
        if not isinstance(data, Mapping):
            errors.bad("", data, "a mapping with sections " + ", ".join(_SECTIONS))
            raise JobSpecError(errors.items, source)
        _check_keys(errors, "", data, list(_SECTIONS))
        malformed: set[str] = set()  # sections reported as not-a-mapping
        sections: dict[str, Any] = {}
        for name, section_cls in _SECTIONS.items():
            raw = data.get(name)
            if raw is None:
                if name in ("model", "data"):
                    # Build an empty section so the missing required fields get their
                    # own messages alongside everything else.
                    sections[name] = section_cls()
                continue
            if not isinstance(raw, Mapping):
                errors.bad(name, raw, "a mapping")
                malformed.add(name)
                sections[name] = section_cls() if name in ("model", "data") else None
                continue
            names = [f.name for f in dataclasses.fields(section_cls)]
            _check_keys(errors, name, raw, names)
            kwargs = {k: v for k, v in raw.items() if k in names}
            if base_dir is not None:
                for f in _path_fields_of(section_cls):
                    value = kwargs.get(f.name)
                    if (
                        isinstance(value, str)
                        and value
                        and not os.path.isabs(os.path.expanduser(value))
                    ):
                        kwargs[f.name] = os.path.join(os.fspath(base_dir), value)
            sections[name] = section_cls(**kwargs)
        sections = {k: v for k, v in sections.items() if v is not None}
        try:
            spec = cls(**sections)
        except JobSpecError as exc:
            # A malformed section was replaced by an empty one; its "missing field"
            # complaints would only repeat the structural error already recorded.
            rest = [
                err
                for err in exc.errors
                if not any(err.path == m or err.path.startswith(m + ".") for m in malformed)
            ]
            raise JobSpecError(errors.items + rest, source) from None
        if errors.items:
            raise JobSpecError(errors.items, source)
        return spec

    def to_yaml(self) -> str:
        """The spec as YAML text that ``load_job_spec`` reads back."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


PATH_FIELDS: tuple[PathField, ...] = tuple(
    PathField(section, f.name, f.metadata[PATH_ACCESS])
    for section, section_cls in _SECTIONS.items()
    for f in _path_fields_of(section_cls)
)
"""Every path-typed field of the spec, read from the schema (Note [paths are a type])."""


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _check_keys(errors: _Errors, path: str, raw: Mapping[str, Any], allowed: list[str]) -> None:
    for key in raw:
        if key in allowed:
            continue
        where = f"{path}.{key}" if path else str(key)
        hint = ""
        known = _ALIASES.get(str(key).lower())
        if known is not None:
            target, note = known
            section, _, name = target.partition(".")
            # Within the right section the field name says it; elsewhere the full path.
            shown = name if section == path and name else target
            hint = f" (did you mean {shown!r}?{' ' + note if note else ''})"
        else:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            if close:
                hint = f" (did you mean {close[0]!r}?)"
        errors.add(where, f"unknown field{hint}; expected one of: {', '.join(allowed)}")


# Names that users of the Hugging Face Trainer (TrainingArguments), peft (LoraConfig),
# TRL and LLaMA-Factory reach for, mapped to the job-spec field that means the same
# (section.field) and a note where the value is not taken as is. Spelling similarity
# alone does not find lr for learning_rate, nor another section. docs/coming-from-hf.md
# has the full mapping.
_ALIASES: dict[str, tuple[str, str]] = {
    # TrainingArguments
    "learning_rate": ("optimizer.lr", ""),
    "weight_decay": ("optimizer.weight_decay", ""),
    "adam_beta1": ("optimizer.betas", "as betas: [beta1, beta2]"),
    "adam_beta2": ("optimizer.betas", "as betas: [beta1, beta2]"),
    "adam_epsilon": ("optimizer.eps", ""),
    "max_grad_norm": ("optimizer.grad_clip", ""),
    "clip_grad_norm": ("optimizer.grad_clip", ""),
    "lr_scheduler_type": ("optimizer.schedule", ""),
    "scheduler": ("optimizer.schedule", ""),
    "warmup": ("optimizer.warmup_steps", ""),
    "warmup_ratio": ("optimizer.warmup_steps", "a step count: warmup_ratio * train.steps"),
    "optim": ("optimizer.name", "adamw or sgd"),
    "per_device_train_batch_size": ("batch.microbatch_size", ""),
    "train_batch_size": ("batch.microbatch_size", ""),
    "batch_size": ("batch.microbatch_size", ""),
    "gradient_accumulation_steps": ("batch.num_microbatches", ""),
    "max_steps": ("train.steps", ""),
    "num_steps": ("train.steps", ""),
    "num_train_epochs": (
        "train.steps",
        "optimizer steps, not epochs: epochs * rows / (microbatch_size * num_microbatches)",
    ),
    "seed": ("train.seed", ""),
    "data_seed": ("data.seed", ""),
    "bf16": ("train.dtype", "dtype: bfloat16"),
    "fp16": ("train.dtype", "dtype: float16"),
    "torch_dtype": ("train.dtype", ""),
    "output_dir": ("output.dir", ""),
    "save_steps": ("output.checkpoint_every", ""),
    "save_total_limit": ("output.keep_last", ""),
    "resume_from_checkpoint": ("model.resume_from", ""),
    "model_name_or_path": ("model.path", "a local directory; nothing is downloaded"),
    "tokenizer_name": ("data.tokenizer", "a local directory"),
    # data (TRL, LLaMA-Factory)
    "max_seq_len": ("data.seq_len", ""),
    "max_seq_length": ("data.seq_len", ""),
    "max_length": ("data.seq_len", ""),
    "seq_length": ("data.seq_len", ""),
    "cutoff_len": ("data.seq_len", ""),
    "dataset_text_field": ("data.text_field", ""),
    "assistant_only_loss": ("data.loss_on", "assistant (true) or all (false)"),
    "completion_only_loss": ("data.loss_on", "assistant (true: completion only) or all"),
    "chat_template_path": ("data.chat_template", "a Jinja template file"),
    "padding_free": ("data.packing", "documents: packed rows, no cross-document attention"),
    "packing_strategy": ("data.packing", "documents (TRL's bfd) or concat (wrapped)"),
    "train_file": ("data.path", ""),
    "dataset": ("data.path", "a local file"),
    # LoRA (peft LoraConfig, LLaMA-Factory)
    "lora_r": ("lora.r", ""),
    "lora_rank": ("lora.r", ""),
    "rank": ("lora.r", ""),
    "lora_alpha": ("lora.alpha", ""),
    "lora_dropout": ("lora.dropout", ""),
    "lora_target": ("lora.target_modules", ""),
    "target_modules": ("lora.target_modules", ""),
}


# --------------------------------------------------------------------------- YAML


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``3e-4`` as a float.

    YAML 1.1 (PyYAML) only reads exponent floats that contain a dot (``3.0e-4``), so
    ``lr: 3e-4`` would otherwise arrive as the string ``"3e-4"``. The resolver table is
    copied, so the global SafeLoader is untouched.
    """


_YamlLoader.yaml_implicit_resolvers = {
    k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


MAX_SPEC_NODES = 100_000
"""Most values (scalars, lists, maps) a YAML spec may expand to, aliases expanded. A real
spec has a few hundred; ten nested aliases of ten make 10**10 (the "billion laughs"),
which PyYAML builds as shared objects but everything after it copies out, to gigabytes."""


class _SpecYamlError(Exception):
    """A problem of the YAML text itself, with its line; becomes a JobSpecError."""


def _where(mark: yaml.Mark | None) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "?"


def _construct_mapping_once(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
    # YAML says keys are unique, but PyYAML keeps the last of duplicates silently: an
    # `lr:` written twice would train with whichever came last.
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<:` merges: PyYAML's own rules apply
        key = loader.construct_object(key_node, deep=False)
        try:
            first = seen.get(key)
        except TypeError:
            continue  # an unhashable key: PyYAML reports it below
        if first is not None:
            raise _SpecYamlError(
                f"duplicate key {key!r} at {_where(key_node.start_mark)} (first at "
                f"{_where(first.start_mark)}); each key may appear once in a mapping: "
                "remove one of them"
            )
        seen[key] = key_node
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_YamlLoader.add_constructor("tag:yaml.org,2002:map", _construct_mapping_once)
_YamlLoader.construct_mapping = _construct_mapping_once  # type: ignore[assignment,method-assign]


def _expanded_size(root: yaml.Node) -> int:
    """How many nodes ``root`` stands for once every alias is expanded, stopping as soon
    as that passes MAX_SPEC_NODES (each distinct node is sized once, so this is cheap)."""
    sizes: dict[int, int] = {}
    # Iterative post-order walk: a deeply nested document must not hit the recursion limit.
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            sizes[id(node)] = 1
            continue
        if not children_done:
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
            continue
        total = 1 + sum(sizes.get(id(c), 1) for c in children)
        if total > MAX_SPEC_NODES:
            raise _SpecYamlError(
                f"the value at {_where(node.start_mark)} expands to more than "
                f"{MAX_SPEC_NODES} values (aliases of aliases); a job spec needs a few "
                "hundred: write the values out, or use fewer aliases"
            )
        sizes[id(node)] = total
    return sizes.get(id(root), 0)


def _parse_yaml(text: str) -> Any:
    loader = _YamlLoader(text)  # a SafeLoader subclass: no code runs
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_job_spec(path: str | os.PathLike[str]) -> JobSpec:
    """Read and validate a YAML job spec; relative paths in it are relative to the file.

    Refused with a JobSpecError, before any validation: a file over MAX_SPEC_BYTES, text
    that is not UTF-8, invalid YAML, a key repeated in a mapping, aliases that expand to
    more than MAX_SPEC_NODES values."""
    spec_path = Path(path).expanduser().resolve()
    source = str(spec_path)
    try:
        with open(spec_path, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise JobSpecError(
            [FieldError("", f"cannot read job spec file {source!r}: {exc.strerror}")]
        ) from None
    if len(raw) > MAX_SPEC_BYTES:
        raise JobSpecError(
            [
                FieldError(
                    "",
                    f"the file is larger than {MAX_SPEC_BYTES} bytes; a job spec names "
                    "files and holds settings, not data (is this the data file?)",
                )
            ],
            source,
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise JobSpecError(
            [
                FieldError(
                    "",
                    f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at line {line} (offset "
                    f"{exc.start}) cannot be decoded ({exc.reason}); save the file as UTF-8",
                )
            ],
            source,
        ) from None
    try:
        data = _parse_yaml(text)
    except _SpecYamlError as exc:
        raise JobSpecError([FieldError("", str(exc))], source) from None
    except yaml.YAMLError as exc:
        raise JobSpecError([FieldError("", f"not valid YAML: {exc}")], source) from None
    except RecursionError:
        raise JobSpecError([FieldError("", "not valid YAML: nested too deeply")], source) from None
    if data is None:
        data = {}
    return JobSpec.from_dict(data, base_dir=spec_path.parent, source=source)


# --------------------------------------------------------------------------- validation


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _json_like(v: Any) -> bool:
    if v is None or isinstance(v, bool | int | str):
        return True
    if isinstance(v, float):
        return True
    if isinstance(v, list | tuple):
        return all(_json_like(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _json_like(x) for k, x in v.items())
    return False


def _check_int(e: _Errors, path: str, v: Any, lo: int | None = None, hi: int | None = None) -> bool:
    ok = _is_int(v) and (lo is None or v >= lo) and (hi is None or v <= hi)
    if not ok:
        rng = (
            f"an integer >= {lo}"
            if hi is None and lo is not None
            else f"an integer in [{lo}, {hi}]"
            if lo is not None
            else "an integer"
        )
        e.bad(path, v, rng)
    return ok


def _check_choice(e: _Errors, path: str, v: Any, choices: tuple[str, ...]) -> bool:
    if v in choices and isinstance(v, str):
        return True
    e.bad(path, v, "one of " + ", ".join(repr(c) for c in choices))
    return False


def _check_bool(e: _Errors, path: str, v: Any) -> None:
    if not isinstance(v, bool):
        e.bad(path, v, "true or false")


def _check_dir(e: _Errors, path: str, v: Any, what: str) -> bool:
    if not isinstance(v, str) or not v:
        e.bad(path, v, f"a path to {what}")
        return False
    if not os.path.exists(v):
        e.add(path, f"{what} {v!r} does not exist")
        return False
    if not os.path.isdir(v):
        e.add(path, f"{v!r} is not a directory; expected {what}")
        return False
    return True


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Files of which a tokenizer directory holds at least one."""


def has_tokenizer_files(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a tokenizer (one of ``TOKENIZER_FILES``)."""
    return any(os.path.isfile(os.path.join(directory, f)) for f in TOKENIZER_FILES)


def _validate(spec: JobSpec) -> list[FieldError]:
    """The single validation pass: every rule on every field, all problems collected."""
    e = _Errors()
    sections = {
        "model": (spec.model, ModelSpec),
        "data": (spec.data, DataSpec),
        "batch": (spec.batch, BatchSpec),
        "train": (spec.train, TrainSpec),
        "optimizer": (spec.optimizer, OptimizerSpec),
        "output": (spec.output, OutputSpec),
    }
    if spec.lora is not None:
        sections["lora"] = (spec.lora, LoraSpec)
    bad_section = False
    for name, (value, cls) in sections.items():
        if not isinstance(value, cls):
            e.bad(name, value, f"a {cls.__name__}")
            bad_section = True
    if bad_section:
        # Field checks below assume the right types; report the structural problem only.
        return e.items

    train_ok = _check_train(e, spec.train)
    model_config = _check_model(e, spec.model)
    if spec.lora is not None:
        _check_lora(e, spec.lora)
    _check_data(e, spec)
    _check_int(e, "batch.microbatch_size", spec.batch.microbatch_size, lo=1)
    if _check_int(e, "batch.num_microbatches", spec.batch.num_microbatches, lo=1):
        _check_plan_splits(e, spec.train.plan, spec.batch.num_microbatches)
    _check_optimizer(e, spec.optimizer, spec.train.steps if train_ok else None)
    _check_output(e, spec.output)
    if model_config is not None and _is_int(spec.data.seq_len):
        e.items.extend(_model_errors(spec, model_config, None))
    if spec.model.resume_from is not None and not e.items:
        # Only on an otherwise valid spec: the comparisons below assume valid values.
        _check_resume(e, spec)
    return e.items


def _check_plan_splits(e: _Errors, plan: Any, num_microbatches: int) -> None:
    """A microbatch split in ``train.plan`` must leave both tasks of its stage at least
    one microbatch (Note [microbatch-split stages] in roundpipe.shared.plan); a data-
    parallel group checks its nodes' shares again when the job starts."""
    from roundpipe.shared.plan import Plan

    if not isinstance(plan, str):
        return
    try:
        parsed = Plan.parse(plan)
    except ValueError:
        return  # _check_train reports it
    try:
        parsed.validate_microbatches(num_microbatches)
    except ValueError as exc:
        e.bad("train.plan", plan, f"splits that fit batch.num_microbatches ({exc})")


def _check_train(e: _Errors, t: TrainSpec) -> bool:
    steps_ok = _check_int(e, "train.steps", t.steps, lo=1)
    if not (_is_int(t.staleness) and t.staleness in (0, 1)):
        e.bad("train.staleness", t.staleness, "0 (exact) or 1 (one step stale)")
    _check_choice(e, "train.dtype", t.dtype, DTYPES)
    _check_int(e, "train.seed", t.seed, lo=0)
    _check_bool(e, "train.replan", t.replan)
    _check_int(e, "train.grad_buffer_stages", t.grad_buffer_stages, lo=0)
    if t.plan is not None:
        from roundpipe.shared.plan import Plan

        if not isinstance(t.plan, str):
            e.bad("train.plan", t.plan, "a plan string such as 'F[0:3] T[3:6] B[2:3,0:2]'")
        else:
            try:
                Plan.parse(t.plan)
            except ValueError as exc:
                e.bad("train.plan", t.plan, f"a valid plan string ({exc})")
    return steps_ok


def _check_model(e: _Errors, m: ModelSpec) -> Mapping[str, Any] | Any | None:
    """Check the model section; return its config (dict or transformers config) if known."""
    if m.init_seed is not None:
        _check_int(e, "model.init_seed", m.init_seed, lo=0)
    if not isinstance(m.config, dict) or not _json_like(m.config):
        e.bad("model.config", m.config, "a mapping of transformers config fields")
        return None
    if m.tokenizer is not None and _check_dir(
        e, "model.tokenizer", m.tokenizer, "a tokenizer directory"
    ):
        if not has_tokenizer_files(m.tokenizer):
            e.add(
                "model.tokenizer",
                f"{m.tokenizer!r} holds no tokenizer files (none of "
                + ", ".join(TOKENIZER_FILES)
                + ")",
            )
    if m.resume_from is not None and _check_dir(
        e, "model.resume_from", m.resume_from, "a checkpoint directory"
    ):
        from roundpipe.coordinator.training.checkpoint import MANIFEST

        if not any(
            os.path.isfile(os.path.join(m.resume_from, *parts))
            for parts in ((MANIFEST,), ("latest",), ("checkpoints", "latest"))
        ):
            e.add(
                "model.resume_from",
                f"{m.resume_from!r} is not a RoundPipe checkpoint: expected a step-* "
                f"directory holding {MANIFEST}, a checkpoints directory holding 'latest', or "
                "a job output directory with checkpoints/latest",
            )
    if (m.path is None) == (m.architecture is None):
        given = "both" if m.path is not None else "neither"
        e.add(
            "model",
            f"got {given} of path and architecture; expected exactly one: path (a local "
            "Hugging Face model directory) or architecture (one of "
            + ", ".join(ARCHITECTURES)
            + ") with config",
        )
        return None
    if m.path is None and m.dequantize:
        e.add("model.dequantize", "applies to a path model only (a checkpoint to load)")
    if m.path is not None:
        if m.config:
            e.add(
                "model.config",
                "config overrides apply to an architecture model only; for a path model, "
                "edit its config.json",
            )
        if m.init_seed is not None:
            e.add("model.init_seed", "applies to an architecture model only (random init)")
        _check_bool(e, "model.dequantize", m.dequantize)
        if not _check_dir(e, "model.path", m.path, "a model directory"):
            return None
        cfg_file = os.path.join(m.path, "config.json")
        if not os.path.isfile(cfg_file):
            e.add(
                "model.path",
                f"{m.path!r} has no config.json; expected a Hugging Face model directory",
            )
            return None
        try:
            from roundpipe.coordinator.spec.paths import open_for_read

            with open_for_read(cfg_file) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as exc:
            e.add("model.path", f"cannot read {cfg_file!r}: {exc}")
            return None
        if not isinstance(cfg, dict):
            e.add("model.path", f"{cfg_file!r} does not hold a JSON object")
            return None
        return cfg
    if not _check_choice(e, "model.architecture", m.architecture, ARCHITECTURES):
        return None
    config_cls = _config_class(m.architecture)
    known = (
        {f.name for f in dataclasses.fields(config_cls)}
        | set(getattr(config_cls, "attribute_map", {}))
        | _LEGACY_CONFIG_KEYS
    )
    unknown = [k for k in m.config if k not in known]
    for key in unknown:
        hint = difflib.get_close_matches(key, sorted(known), n=1)
        guess = f" (did you mean {hint[0]!r}?)" if hint else ""
        e.add(f"model.config.{key}", f"unknown {config_cls.__name__} field{guess}")
    if unknown:
        return None
    try:
        return config_cls(**m.config)
    except Exception as exc:  # transformers raises several types for bad values
        detail = " ".join(str(exc).split())
        e.add("model.config", f"transformers rejected the config: {detail}")
        return None


def _resume_manifest(e: _Errors, path: str) -> tuple[str, int, dict[str, Any]] | None:
    """(checkpoint directory, step, manifest) of the checkpoint ``model.resume_from``
    names, read without checksums (the coordinator verifies the files when it loads
    them). None if it cannot be told here: a damaged ``latest`` may still leave an older
    good checkpoint, which the coordinator finds."""
    from roundpipe.coordinator.training.checkpoint import (
        MANIFEST,
        CheckpointDir,
        CheckpointError,
        read_manifest,
    )

    p = Path(path)
    if (p / MANIFEST).is_file():
        try:
            info = read_manifest(p)
        except CheckpointError as exc:
            e.add("model.resume_from", str(exc))
            return None
    else:
        root = p if (p / "latest").is_file() else p / "checkpoints"
        name = CheckpointDir(root).pointer()
        if name is None:
            return None
        try:
            info = read_manifest(root / name)
        except CheckpointError:
            return None
    spec = info.manifest.get("spec")
    return (str(info.path), info.step, spec) if isinstance(spec, dict) else None


def _check_resume(e: _Errors, spec: JobSpec) -> None:
    """Refuse, before submit, a resume the trainer could not continue: a checkpoint past
    ``train.steps``, another global batch size, other rows or row order, another kind of
    model. The trainer checks the same when it loads the checkpoint; this only moves
    the error to validation."""
    assert spec.model.resume_from is not None
    found = _resume_manifest(e, spec.model.resume_from)
    if found is None:
        return
    where, step, old = found
    ckpt = f"checkpoint {where!r} (step {step})"

    def old_value(section: str, key: str) -> Any:
        value = old.get(section)
        return value.get(key) if isinstance(value, dict) else None

    if spec.train.steps < step:
        e.add(
            "train.steps",
            f"got {spec.train.steps}, but model.resume_from is {ckpt}; expected at least "
            f"{step}: train.steps counts the checkpoint's steps too, so set it above {step} "
            "to train further",
        )
    mb, nm = old_value("batch", "microbatch_size"), old_value("batch", "num_microbatches")
    if _is_int(mb) and _is_int(nm) and mb * nm != spec.global_batch_size:
        e.add(
            "batch",
            f"got microbatch_size {spec.batch.microbatch_size} x num_microbatches "
            f"{spec.batch.num_microbatches} = {spec.global_batch_size} rows per step, but "
            f"{ckpt} was trained with {mb} x {nm} = {mb * nm}; the data cursor continues "
            f"only with {mb * nm} rows per step (any split of them, e.g. {mb} x {nm})",
        )
    for key in ("seq_len", "packing", "shuffle"):
        before, now = old_value("data", key), getattr(spec.data, key)
        if key == "packing":  # true and documents (false and none) are one setting
            before, now = _PACKING_ALIASES.get(before, before), _PACKING_ALIASES.get(now, now)
        if before is not None and before != now:
            e.add(
                f"data.{key}",
                f"got {now!r}, but {ckpt} was trained with {before!r}; resuming needs the "
                "same rows in the same order",
            )
    old_train_seed = old_value("train", "seed")
    old_data_seed = old_value("data", "seed")
    before_seed = old_train_seed if old_data_seed is None else old_data_seed
    if spec.data.shuffle and _is_int(before_seed) and before_seed != spec.data_seed:
        e.add(
            "data.seed",
            f"the shuffle seed is {spec.data_seed} (data.seed, else train.seed), but {ckpt} "
            f"shuffled with {before_seed}; set data.seed: {before_seed} to resume its order",
        )
    old_lora = old.get("lora")
    if (old_lora is None) != (spec.lora is None):
        has = "LoRA adapters" if old_lora is not None else "a fully fine-tuned model"
        want = "LoRA (a lora section)" if spec.lora is not None else "full fine-tuning"
        e.add("model.resume_from", f"{ckpt} holds {has}, but this spec asks for {want}")
    elif isinstance(old_lora, dict) and spec.lora is not None:
        for key in ("r", "target_modules"):
            before = old_lora.get(key)
            now = _plain(getattr(spec.lora, key))
            if before is not None and before != now:
                e.add(
                    f"lora.{key}",
                    f"got {now!r}, but the adapters of {ckpt} have {before!r}",
                )


def _check_lora(e: _Errors, lora: LoraSpec) -> None:
    _check_int(e, "lora.r", lora.r, lo=1)
    if not (_is_num(lora.alpha) and lora.alpha > 0):
        e.bad("lora.alpha", lora.alpha, "a number > 0")
    if not (_is_num(lora.dropout) and 0 <= lora.dropout < 1):
        e.bad("lora.dropout", lora.dropout, "a number in [0, 1)")
    tm = lora.target_modules
    if tm == "all-linear":
        return
    if not (isinstance(tm, tuple) and tm and all(isinstance(x, str) and x for x in tm)):
        e.bad("lora.target_modules", tm, "a non-empty list of module names or 'all-linear'")


def _check_data(e: _Errors, spec: JobSpec) -> None:
    d = spec.data
    if d.seed is not None:
        _check_int(e, "data.seed", d.seed, lo=0)
    _check_int(e, "data.seq_len", d.seq_len, lo=2)
    _check_bool(e, "data.shuffle", d.shuffle)
    if not isinstance(d.packing, bool) and d.packing not in DATA_PACKING:
        e.bad("data.packing", d.packing, "true or false, or one of " + ", ".join(DATA_PACKING))
    _check_choice(e, "data.loss_on", d.loss_on, DATA_LOSS_ON)
    _check_choice(e, "data.overlong", d.overlong, DATA_OVERLONG)
    if not isinstance(d.split, str) or not d.split:
        e.bad("data.split", d.split, "a split name, e.g. train")
    columns_ok = d.columns is None or (
        isinstance(d.columns, dict)
        and all(k in DATA_COLUMNS and isinstance(v, str) and v for k, v in d.columns.items())
    )
    if not columns_ok:
        e.bad(
            "data.columns",
            d.columns,
            "a mapping from " + ", ".join(DATA_COLUMNS) + " to record field names",
        )
    if d.chat_template is not None and not (
        isinstance(d.chat_template, str) and os.path.isfile(d.chat_template)
    ):
        e.add("data.chat_template", f"{d.chat_template!r} is not a file; expected a Jinja template")
    text_field_ok = isinstance(d.text_field, str) and d.text_field != ""
    if not text_field_ok:
        e.bad("data.text_field", d.text_field, "a non-empty field name")
    if d.tokenizer is not None and _check_dir(
        e, "data.tokenizer", d.tokenizer, "a tokenizer directory"
    ):
        if not has_tokenizer_files(d.tokenizer):
            e.add(
                "data.tokenizer",
                f"{d.tokenizer!r} holds no tokenizer files (none of "
                + ", ".join(TOKENIZER_FILES)
                + ")",
            )
    format_ok = _check_choice(e, "data.format", d.format, DATA_FORMATS)
    if d.path is None:
        e.add("data.path", "missing; expected a path to a local .jsonl, .parquet or .txt file")
        return
    if not isinstance(d.path, str) or not d.path:
        e.bad("data.path", d.path, "a path to a local .jsonl, .parquet or .txt file")
        return
    if not os.path.exists(d.path):
        e.add("data.path", f"data file {d.path!r} does not exist")
        return
    if not (os.path.isfile(d.path) or os.path.isdir(d.path)):
        e.add("data.path", f"{d.path!r} is not a regular file; expected a .jsonl or .txt file")
        return
    if not (format_ok and text_field_ok and columns_ok):
        return  # format detection would only repeat those errors
    from roundpipe.coordinator.spec.data import DataError, columns_of, resolve_format

    try:
        fmt = resolve_format(
            d.path, d.format, d.text_field, columns=columns_of(spec), split=d.split
        )
    except DataError as exc:
        e.add("data.format" if d.format == "auto" else "data.path", str(exc))
        return
    if fmt == "jsonl_tokens":
        return  # token ids need no tokenizer (one is used for EOS/pad ids if present)
    if spec.tokenizer_path is not None:
        return
    model_dir = spec.model.path
    if isinstance(model_dir, str):
        if os.path.isdir(model_dir):  # else model.path has its own error already
            e.add(
                "data.tokenizer",
                f"data {d.path!r} is text ({fmt}) and needs a tokenizer, but model directory "
                f"{model_dir!r} holds no tokenizer files; set data.tokenizer",
            )
    else:
        e.add(
            "data.tokenizer",
            f"data {d.path!r} is text ({fmt}) and needs a tokenizer; set data.tokenizer "
            "or model.tokenizer (an architecture model has no directory to take one from)",
        )


def _check_optimizer(e: _Errors, o: OptimizerSpec, steps: int | None) -> None:
    if not (_is_num(o.lr) and o.lr > 0):
        e.bad("optimizer.lr", o.lr, "a number > 0")
    b = o.betas
    if not (isinstance(b, tuple) and len(b) == 2 and all(_is_num(x) and 0 <= x < 1 for x in b)):
        e.bad("optimizer.betas", b, "two numbers in [0, 1), e.g. [0.9, 0.999]")
    if not (_is_num(o.eps) and o.eps > 0):
        e.bad("optimizer.eps", o.eps, "a number > 0")
    if not (_is_num(o.weight_decay) and o.weight_decay >= 0):
        e.bad("optimizer.weight_decay", o.weight_decay, "a number >= 0")
    if o.grad_clip is not None and not (_is_num(o.grad_clip) and o.grad_clip > 0):
        e.bad("optimizer.grad_clip", o.grad_clip, "null (no clipping) or a number > 0")
    _check_choice(e, "optimizer.schedule", o.schedule, SCHEDULES)
    _check_choice(e, "optimizer.state_dtype", o.state_dtype, STATE_DTYPES)
    if o.state_dtype == "int8" and o.name != "adamw":
        e.bad("optimizer.state_dtype", o.state_dtype, "float32 with optimizer.name sgd")
    _check_choice(e, "optimizer.schedule_convention", o.schedule_convention, SCHEDULE_CONVENTIONS)
    nd = o.no_decay
    if not (isinstance(nd, tuple) and all(isinstance(x, str) and x for x in nd)):
        e.bad(
            "optimizer.no_decay",
            nd,
            "a list of name patterns (regular expressions), e.g. [bias, norm]; [] for none",
        )
    else:
        for pattern in nd:
            try:
                re.compile(pattern)
            except re.error as exc:
                e.add(
                    "optimizer.no_decay",
                    f"{pattern!r} is not a valid regular expression ({exc}); expected "
                    "name patterns such as 'bias' or '(?:^|\\.)norm\\.'",
                )
    if _check_int(e, "optimizer.warmup_steps", o.warmup_steps, lo=0) and steps is not None:
        if o.warmup_steps > steps:
            e.add(
                "optimizer.warmup_steps",
                f"got {o.warmup_steps}, more than train.steps ({steps}); expected at most {steps}",
            )
    if not (_is_num(o.min_lr_ratio) and 0 <= o.min_lr_ratio <= 1):
        e.bad("optimizer.min_lr_ratio", o.min_lr_ratio, "a number in [0, 1]")
    _check_int(e, "optimizer.threads", o.threads, lo=0)
    _check_choice(e, "optimizer.name", o.name, OPTIMIZERS)
    if not (_is_num(o.momentum) and 0 <= o.momentum < 1):
        e.bad("optimizer.momentum", o.momentum, "a number in [0, 1)")
    if not isinstance(o.nesterov, bool):
        e.bad("optimizer.nesterov", o.nesterov, "true or false")
    elif o.nesterov and not (o.name == "sgd" and _is_num(o.momentum) and o.momentum > 0):
        e.add("optimizer.nesterov", "got True; it needs name: sgd and a momentum > 0")
    if o.name != "sgd" and _is_num(o.momentum) and o.momentum != 0:
        e.add(
            "optimizer.momentum",
            f"got {o.momentum}; momentum applies to name: sgd only (name is {o.name!r})",
        )


def _check_output(e: _Errors, o: OutputSpec) -> None:
    if o.dir is not None:
        if not isinstance(o.dir, str) or not o.dir:
            e.bad("output.dir", o.dir, "a directory path or null")
        elif os.path.exists(o.dir) and not os.path.isdir(o.dir):
            e.add("output.dir", f"{o.dir!r} exists and is not a directory")
    _check_int(e, "output.checkpoint_every", o.checkpoint_every, lo=0)
    _check_int(e, "output.keep_last", o.keep_last, lo=0)
    _check_staging(e, o.checkpoint_staging)
    _check_bool(e, "output.timeline", o.timeline)
    _check_bool(e, "output.tensorboard", o.tensorboard)


def _check_staging(e: _Errors, v: Any) -> None:
    if v == "auto":
        return
    try:
        ok = not isinstance(v, bool) and staging_limit_bytes(v) >= 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        e.bad("output.checkpoint_staging", v, '"auto", a size such as "8GiB", or 0')


def staging_limit_bytes(value: str | int) -> int | None:
    """``output.checkpoint_staging`` in bytes; None for ``"auto"``."""
    from roundpipe.shared.units import parse_quantity

    if value == "auto":
        return None
    return int(parse_quantity(value, what="output.checkpoint_staging"))


# --------------------------------------------------------------------------- model config


def _config_class(architecture: str) -> type:
    # Lazy: importing transformers takes seconds, and a spec without an architecture
    # model never needs it.
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[architecture]


def model_config_from_spec(model: ModelSpec) -> PretrainedConfig:
    """The transformers config of a (validated) model section.

    Path model: ``AutoConfig.from_pretrained(path, local_files_only=True)``; architecture
    model: the architecture's config class with ``model.config`` as overrides.
    """
    if model.path is not None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model.path, local_files_only=True)
        if model.dequantize:
            from roundpipe.shared.model import without_mxfp4

            config = without_mxfp4(config)
        return config
    assert model.architecture is not None, "validated spec has path or architecture"
    return _config_class(model.architecture)(**model.config)


def _config_get(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def _model_errors(
    spec: JobSpec, model_config: Any, vocab_size_needed: int | None
) -> list[FieldError]:
    e = _Errors()
    max_pos = _config_get(model_config, "max_position_embeddings")
    if _is_int(max_pos) and _is_int(spec.data.seq_len) and spec.data.seq_len > max_pos:
        e.add(
            "data.seq_len",
            f"got {spec.data.seq_len}; expected at most the model's max_position_embeddings "
            f"({max_pos})",
        )
    packing = _PACKING_ALIASES.get(spec.data.packing, spec.data.packing)
    layer_types = _config_get(model_config, "layer_types") or ()
    if packing == "documents" and "linear_attention" in layer_types:
        # A linear-attention layer carries its state along the whole row: packed
        # documents would see each other (the executor refuses them too).
        e.add(
            "data.packing",
            "documents packing needs every layer to keep packed documents apart; this "
            "model's linear-attention layers cannot: expected none or concat",
        )
    vocab = _config_get(model_config, "vocab_size")
    if vocab_size_needed is not None and _is_int(vocab) and vocab_size_needed > vocab:
        e.add(
            "data",
            f"the data uses token ids up to {vocab_size_needed - 1}, but the model's "
            f"vocab_size is {vocab}; expected a tokenizer that matches the model",
        )
    return e.items


def validate_against_model(
    spec: JobSpec,
    model_config: PretrainedConfig | Mapping[str, Any],
    *,
    vocab_size_needed: int | None = None,
) -> None:
    """Checks that need the model's config; raise JobSpecError listing every problem.

    ``model_config`` is the transformers config the coordinator built (or a config.json
    dict). ``vocab_size_needed`` is one more than the largest token id in the data
    (``PackedDataset.vocab_size_needed``), checked against ``vocab_size``.
    """
    errors = _model_errors(spec, model_config, vocab_size_needed)
    if errors:
        raise JobSpecError(errors)
