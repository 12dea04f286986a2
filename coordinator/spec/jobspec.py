"""The job spec: everything a fine-tuning job needs, validated before any work starts.

A spec is built three ways, all ending in the same validation:

* from a YAML file: :func:`load_job_spec` (relative paths are relative to the file);
* from a plain dict: :meth:`JobSpec.from_dict` (this is also how it arrives at the
  coordinator: the client sends :meth:`JobSpec.to_dict`, a msgpack-able dict);
* as Python objects: ``JobSpec(model=ModelSpec(...), data=DataSpec(...), ...)``.

The section classes (roundpipe.coordinator.spec.sections) only normalise. All checking
happens in one place, when a :class:`JobSpec` is constructed, so that a single
:class:`JobSpecError` can list *every* problem in the spec at once, across sections,
each with its field path, the value given and what is expected: the rules of each
section (roundpipe.coordinator.spec.section_checks), then here the checks that span
sections: the data against its settings and tokenizer, the model's config, a checkpoint
to resume from.

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
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from roundpipe.coordinator.spec.checkpoint_format import (
    LATEST,
    MANIFEST,
    CheckpointError,
    read_manifest,
    read_pointer,
)
from roundpipe.coordinator.spec.choices import (
    packing_alias,
)
from roundpipe.coordinator.spec.errors import DataError, FieldError, JobSpecError, Problems
from roundpipe.coordinator.spec.formats import columns_of, resolve_format
from roundpipe.coordinator.spec.section_checks import (
    ModelConfigError,
    check_data,
    check_int,
    check_lora,
    check_model,
    check_optimizer,
    check_output,
    check_plan_splits,
    check_sharding,
    check_train,
    config_class,
    is_int,
    read_model_config,
)
from roundpipe.coordinator.spec.sections import (
    SECTIONS,
    BatchSpec,
    DataSpec,
    LoraSpec,
    ModelSpec,
    OptimizerSpec,
    OutputSpec,
    TrainSpec,
    path_fields_of,
    plain,
)
from roundpipe.coordinator.spec.spec_yaml import SpecYamlError, parse_spec_yaml
from roundpipe.coordinator.spec.tokenizers import has_tokenizer_files
from roundpipe.coordinator.spec.unknown_keys import check_keys

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "MAX_SPEC_BYTES",
    "JobSpec",
    "load_job_spec",
    "model_config_from_spec",
    "validate_against_model",
]

MAX_SPEC_BYTES = 1024 * 1024
"""Largest job spec: a YAML file, or a SubmitJob message. A spec names files and holds
settings; a megabyte of it is a mistake or an attack, not a job."""


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
    def loss_scaling(self) -> bool:
        """Whether the backward is seeded with a dynamic loss scale (``train.loss_scale``:
        ``dynamic``, or ``auto`` with float16)."""
        scale = self.train.loss_scale
        return scale == "dynamic" or (scale == "auto" and self.train.dtype == "float16")

    @property
    def optimizer_waits_for_whole_step(self) -> bool:
        """Whether the optimizer needs every gradient of a step before its first update:
        for the global norm that clipping scales by, or that loss scaling tests for an
        overflow (then each layer has a gradient slot of its own: Note [gradient
        buffer] in roundpipe.coordinator.training.layout)."""
        return self.optimizer.grad_clip is not None or self.loss_scaling

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
        return plain(dataclasses.asdict(self))

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
        errors = Problems()
        if not isinstance(data, Mapping):
            errors.bad("", data, "a mapping with sections " + ", ".join(SECTIONS))
            raise JobSpecError(errors.items, source)
        check_keys(errors, "", data, list(SECTIONS))
        malformed: set[str] = set()  # sections reported as not-a-mapping
        sections: dict[str, Any] = {}
        for name, section_cls in SECTIONS.items():
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
            check_keys(errors, name, raw, names)
            kwargs = {k: v for k, v in raw.items() if k in names}
            if base_dir is not None:
                for f in path_fields_of(section_cls):
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
        data = parse_spec_yaml(text)
    except SpecYamlError as exc:
        raise JobSpecError([FieldError("", str(exc))], source) from None
    except yaml.YAMLError as exc:
        raise JobSpecError([FieldError("", f"not valid YAML: {exc}")], source) from None
    except RecursionError:
        raise JobSpecError([FieldError("", "not valid YAML: nested too deeply")], source) from None
    if data is None:
        data = {}
    return JobSpec.from_dict(data, base_dir=spec_path.parent, source=source)


# --------------------------------------------------------------------------- checks across sections


def _validate(spec: JobSpec) -> list[FieldError]:
    """The single validation pass: every rule on every field, all problems collected."""
    e = Problems()
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

    train_ok = check_train(e, spec.train)
    model_config = check_model(e, spec.model)
    if spec.lora is not None:
        check_lora(e, spec.lora)
    if check_data(e, spec.data):
        _check_data_format(e, spec)
    check_int(e, "batch.microbatch_size", spec.batch.microbatch_size, lo=1)
    if check_int(e, "batch.num_microbatches", spec.batch.num_microbatches, lo=1):
        check_plan_splits(e, spec.train.plan, spec.batch.num_microbatches)
    check_optimizer(e, spec.optimizer, spec.train.steps if train_ok else None)
    check_sharding(e, spec.train, spec.optimizer)
    check_output(e, spec.output)
    _check_output_is_not_the_model(e, spec)
    if model_config is not None and is_int(spec.data.seq_len):
        e.items.extend(_model_errors(spec, model_config, None))
    if spec.model.resume_from is not None and not e.items:
        # Only on an otherwise valid spec: the comparisons below assume valid values.
        _check_resume(e, spec, model_config)
    return e.items


def _check_output_is_not_the_model(e: Problems, spec: JobSpec) -> None:
    """The final model is written over the output directory's model files (those of
    the other kind removed first, roundpipe.coordinator.training.exporter): into the
    base model's own directory, that overwrote the base, or put an adapter over it."""
    out, base = spec.output.dir, spec.model.path
    if not (isinstance(out, str) and out and isinstance(base, str) and base):
        return
    if os.path.realpath(out) == os.path.realpath(base):
        e.add(
            "output.dir",
            f"{out!r} is model.path, the base model's directory: the trained model would "
            "be written over it; set output.dir to a directory of its own",
        )


def _check_data_format(e: Problems, spec: JobSpec) -> None:
    """The data's format, and a tokenizer for it if it is text."""
    d = spec.data
    assert d.path is not None  # check_data passed
    try:
        fmt = resolve_format(d.path, d.format, d.text_field, columns=columns_of(d), split=d.split)
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


def _resume_manifest(e: Problems, path: str) -> tuple[str, int, dict[str, Any]] | None:
    """(checkpoint directory, step, manifest) of the checkpoint ``model.resume_from``
    names, read without checksums (the coordinator verifies the files when it loads
    them). None if it cannot be told here: a damaged ``latest`` may still leave an older
    good checkpoint, which the coordinator finds."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        try:
            info = read_manifest(p)
        except CheckpointError as exc:
            e.add("model.resume_from", str(exc))
            return None
    else:
        root = p if (p / LATEST).is_file() else p / "checkpoints"
        name = read_pointer(root)
        if name is None:
            return None
        try:
            info = read_manifest(root / name)
        except CheckpointError:
            return None
    spec = info.manifest.get("spec")
    return (str(info.path), info.step, info.manifest) if isinstance(spec, dict) else None


def _check_resume(e: Problems, spec: JobSpec, model_config: Any) -> None:
    """Refuse, before submit, a resume the trainer could not continue: a checkpoint past
    ``train.steps``, another global batch size, other rows or row order, another kind of
    model. The trainer checks the same when it loads the checkpoint; this only moves
    the error to validation."""
    assert spec.model.resume_from is not None
    found = _resume_manifest(e, spec.model.resume_from)
    if found is None:
        return
    where, step, manifest = found
    old = manifest["spec"]
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
    if is_int(mb) and is_int(nm) and mb * nm != spec.global_batch_size:
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
            before, now = packing_alias(before), packing_alias(now)
        if before is not None and before != now:
            e.add(
                f"data.{key}",
                f"got {now!r}, but {ckpt} was trained with {before!r}; resuming needs the "
                "same rows in the same order",
            )
    old_train_seed = old_value("train", "seed")
    old_data_seed = old_value("data", "seed")
    before_seed = old_train_seed if old_data_seed is None else old_data_seed
    if spec.data.shuffle and is_int(before_seed) and before_seed != spec.data_seed:
        e.add(
            "data.seed",
            f"the shuffle seed is {spec.data_seed} (data.seed, else train.seed), but {ckpt} "
            f"shuffled with {before_seed}; set data.seed: {before_seed} to resume its order",
        )
    old_opt = old.get("optimizer")
    if isinstance(old_opt, dict):
        before = optimizer_state_kind(
            old_opt.get("name", "adamw"), old_opt.get("momentum", 0), old_opt.get("state_dtype")
        )
        now = optimizer_state_kind(
            spec.optimizer.name, spec.optimizer.momentum, spec.optimizer.state_dtype
        )
        if before != now:
            e.add(
                "optimizer",
                f"this spec keeps {now}, but {ckpt} holds {before}; resume with the "
                "checkpoint's optimizer.name, momentum and state_dtype",
            )
    old_lora = old.get("lora")
    if (old_lora is None) != (spec.lora is None):
        has = "LoRA adapters" if old_lora is not None else "a fully fine-tuned model"
        want = "LoRA (a lora section)" if spec.lora is not None else "full fine-tuning"
        e.add("model.resume_from", f"{ckpt} holds {has}, but this spec asks for {want}")
    elif isinstance(old_lora, dict) and spec.lora is not None:
        # (alpha scales every adapter's output: another is another model, as another r)
        for key in ("r", "alpha", "target_modules"):
            before = old_lora.get(key)
            now = plain(getattr(spec.lora, key))
            if before is not None and before != now:
                e.add(
                    f"lora.{key}",
                    f"got {now!r}, but the adapters of {ckpt} have {before!r}",
                )
        _check_resumed_base(e, spec, model_config, manifest, ckpt)
        _check_resumed_random_base(e, spec, old, ckpt)


def _check_resumed_base(
    e: Problems, spec: JobSpec, model_config: Any, manifest: dict, ckpt: str
) -> None:
    """A LoRA resume continues on the base its adapters were trained on: stored the same
    way (none, nf4 with or without double quantisation, int8 and its scales) and from
    the same codes (quantised at load, or a bitsandbytes checkpoint's own). Compared as
    each side loads it, not as the specs spell it: a spec may leave a bitsandbytes
    checkpoint's quantisation unnamed (the checkpoint decides). The checkpoint's base is
    its manifest's record; an older manifest's is worked out from its spec and, if it is
    still there, its model's config."""
    assert spec.lora is not None
    now = _base_record(spec.lora.model_settings(), _config_get(model_config, "quantization_config"))
    before = (manifest.get("model") or {}).get("base")
    if not isinstance(before, dict):
        old = manifest["spec"]
        path = (old.get("model") or {}).get("path")
        try:
            config: dict[str, Any] | None = read_model_config(str(path)) if path else {}
        except ModelConfigError:
            config = None
        # its model moved or gone: what it was quantised as is not known here
        before = (
            None if config is None else _base_record(old["lora"], config.get("quantization_config"))
        )
    if now is None or before is None or now == before:
        return  # an invalid setting is reported by the checks that read it
    e.add(
        "lora.base_quantization",
        f"this spec trains on {describe_base(now)}, but the adapters of {ckpt} were "
        f"trained on {describe_base(before)}; resume on that base (its model.path and "
        "lora.base_quantization settings): on another, the adapters go on as another model",
    )


def _check_resumed_random_base(e: Problems, spec: JobSpec, old: dict, ckpt: str) -> None:
    """A LoRA checkpoint holds only the adapters; a randomly initialised base is made
    again by every run, from its architecture, config and seed. Another of any of them
    is another base (one whose adapters' shapes still fit trains on without an error),
    and the job would rewrite ``<output>/base_model``, which the checkpoint's
    ``adapter_config.json`` names, under the checkpoint. ``old``: the checkpoint's spec.
    (A base on disk on either side is not compared: that ``base_model`` directory, as
    ``model.path``, is the very base.)"""
    m = spec.model
    before = old.get("model")
    if not isinstance(before, dict) or m.architecture is None or not before.get("architecture"):
        return
    if before["architecture"] != m.architecture:
        e.add(
            "model.architecture",
            f"got {m.architecture!r}, but the adapters of {ckpt} were trained on a random "
            f"{before['architecture']!r} base",
        )
    differ = _config_differences(m.architecture, before.get("config"), m.config)
    if differ:
        e.add(
            "model.config",
            f"{', '.join(differ)} differ from the config of the random base the adapters "
            f"of {ckpt} were trained on ({before.get('config')!r}); resume with that "
            "model.config",
        )
    old_train = old.get("train") if isinstance(old.get("train"), dict) else {}
    old_seed = before.get("init_seed")
    old_seed = old_train.get("seed") if old_seed is None else old_seed
    if is_int(old_seed) and old_seed != spec.init_seed:
        e.add(
            "model.init_seed",
            f"the base is initialised with seed {spec.init_seed} (model.init_seed, else "
            f"train.seed), but the adapters of {ckpt} were trained on the base of seed "
            f"{old_seed}; set model.init_seed: {old_seed}",
        )


def _config_differences(architecture: str, before: Any, now: Mapping[str, Any]) -> list[str]:
    """The keys in which two ``model.config`` overrides of ``architecture`` give other
    configs, compared as built (a default spelt out, or left out, is the same config);
    [] if the checkpoint's cannot be built (its spec was checked when it was written)."""
    if not isinstance(before, dict) or before == now:
        return []
    try:
        old_config = config_class(architecture)(**before).to_dict()
        new_config = config_class(architecture)(**now).to_dict()
    except Exception:  # an invalid override is the model checks' to report
        return []
    keys = old_config.keys() | new_config.keys()
    return sorted(k for k in keys if old_config.get(k) != new_config.get(k))


def _base_record(lora: Mapping[str, Any], quant_config: Any) -> dict[str, Any] | None:
    """``LoraSettings.base_record`` of a spec's lora settings on a model whose
    ``quantization_config`` is ``quant_config``; None if the settings are invalid."""
    from roundpipe.shared.model import LoraSettings

    try:
        return LoraSettings.from_mapping(lora).with_checkpoint(quant_config).base_record()
    except (ValueError, TypeError):
        return None


def describe_base(record: Mapping[str, Any]) -> str:
    """A base record (``LoraSettings.base_record``) in words."""
    kind = record.get("quantization")
    if kind == "none":
        return "an unquantised base"
    if kind == "nf4":
        how = f"nf4, double quantisation {'on' if record.get('double_quantization') else 'off'}"
    else:
        how = f"{kind}, {record.get('int8_scales')} scales"
    if record.get("layout") == "bitsandbytes":
        return f"a bitsandbytes checkpoint's own codes ({how})"
    return f"a base quantised at load ({how})"


def optimizer_state_kind(name: Any, momentum: Any, state_dtype: Any) -> str:
    """The optimizer state a checkpoint holds under these settings, in words: a resume
    needs the same (AdamW's moments in float32 or 8 bits, SGD's momentum or none)."""
    if name == "sgd":
        return "SGD's momentum buffers" if momentum else "no optimizer state (plain SGD)"
    return f"AdamW's moments in {'8 bits' if state_dtype == 'int8' else 'float32'}"


# --------------------------------------------------------------------------- model config


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
    return config_class(model.architecture)(**model.config)


def _config_get(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def _model_errors(
    spec: JobSpec, model_config: Any, vocab_size_needed: int | None
) -> list[FieldError]:
    e = Problems()
    max_pos = _config_get(model_config, "max_position_embeddings")
    if is_int(max_pos) and is_int(spec.data.seq_len) and spec.data.seq_len > max_pos:
        e.add(
            "data.seq_len",
            f"got {spec.data.seq_len}; expected at most the model's max_position_embeddings "
            f"({max_pos})",
        )
    packing = packing_alias(spec.data.packing)
    layer_types = _config_get(model_config, "layer_types") or ()
    if packing == "documents" and "linear_attention" in layer_types:
        # A linear-attention layer carries its state along the whole row: packed
        # documents would see each other (the executor refuses them too).
        e.add(
            "data.packing",
            "documents packing needs every layer to keep packed documents apart; this "
            "model's linear-attention layers cannot: expected none or concat",
        )
    _check_quantised_checkpoint(e, spec, model_config)
    vocab = _config_get(model_config, "vocab_size")
    if vocab_size_needed is not None and is_int(vocab) and vocab_size_needed > vocab:
        e.add(
            "data",
            f"the data uses token ids (inputs or labels) up to {vocab_size_needed - 1}, but the model's "
            f"vocab_size is {vocab}; expected a tokenizer that matches the model",
        )
    return e.items


def _check_quantised_checkpoint(e: Problems, spec: JobSpec, model_config: Any) -> None:
    """A checkpoint that bitsandbytes quantised (``load_in_4bit`` / ``load_in_8bit``)
    cannot be fully fine-tuned: its weights are frozen codes. A LoRA job takes its codes
    as the quantised base (Note [bitsandbytes checkpoint] in
    roundpipe.shared.bnb_checkpoint), unless ``lora.base_quantization`` asks for another
    quantisation or the checkpoint's has no parts here (fp4), or the model is a mixture
    of experts (bitsandbytes leaves its fused expert tensors unquantised)."""
    from roundpipe.shared.bnb_checkpoint import bnb_format, is_bnb
    from roundpipe.shared.model import LoraSettings

    quant = _config_get(model_config, "quantization_config")
    if not is_bnb(quant):
        return
    experts = _config_get(model_config, "num_experts") or _config_get(
        model_config, "num_local_experts"
    )
    if is_int(experts) and experts > 0:
        e.add(
            "model.path",
            "this bitsandbytes checkpoint is of a mixture-of-experts model: bitsandbytes "
            "quantises linear layers only and leaves the fused expert tensors (most of "
            "the model) unquantised, which a quantised base here cannot take; point "
            "model.path at the unquantised checkpoint and set lora.base_quantization: "
            "nf4 (the experts are quantised too)",
        )
        return
    if spec.lora is None:
        e.add(
            "model.path",
            "this checkpoint is quantised by bitsandbytes (quantization_config); a "
            "quantised base trains only with LoRA (its weights are frozen), so full "
            "fine-tuning is refused: add a lora section (the checkpoint's codes become "
            "its quantised base), or point model.path at the unquantised checkpoint",
        )
        return
    try:
        bnb_format(quant)
    except ValueError as exc:
        e.add("model.path", str(exc))
        return
    try:
        LoraSettings.from_mapping(spec.lora.model_settings()).with_checkpoint(quant)
    except ValueError as exc:
        e.add("lora.base_quantization", str(exc).removeprefix("lora.base_quantization: "))


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
