"""The rules of each section of a job spec: types, ranges, choices, files that must exist.

Each ``check_*`` adds every problem of its section to a :class:`Problems` list; the
checks that compare sections with each other, with the data or with a checkpoint are in
roundpipe.coordinator.spec.jobspec, which runs all of them when a JobSpec is built.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from roundpipe.coordinator.spec.checkpoint_format import LATEST, MANIFEST
from roundpipe.coordinator.spec.choices import (
    ARCHITECTURES,
    DATA_COLUMNS,
    DATA_FORMATS,
    DATA_LOSS_ON,
    DATA_OVERLONG,
    DATA_PACKING,
    DTYPES,
    GRAD_TRANSPORTS,
    INT8_SCALES,
    LOSS_SCALINGS,
    OPTIMIZER_KERNELS,
    OPTIMIZER_SHARDINGS,
    OPTIMIZERS,
    QUANTIZATIONS,
    SCHEDULE_CONVENTIONS,
    SCHEDULES,
    STATE_DTYPES,
)
from roundpipe.coordinator.spec.errors import Problems, show_value
from roundpipe.coordinator.spec.paths import open_for_read
from roundpipe.coordinator.spec.sections import (
    DataSpec,
    LoraSpec,
    ModelSpec,
    OptimizerSpec,
    OutputSpec,
    TrainSpec,
    json_like,
    staging_limit_bytes,
)
from roundpipe.coordinator.spec.spec_yaml import number_string_hint
from roundpipe.coordinator.spec.tokenizers import NO_TOKENIZER_FILES, has_tokenizer_files
from roundpipe.shared.plan import RECOMPUTE_GRAINS

__all__ = [
    "bad_number",
    "check_bool",
    "check_choice",
    "check_data",
    "check_dir",
    "check_int",
    "check_lora",
    "check_model",
    "check_optimizer",
    "check_output",
    "check_plan_splits",
    "check_tokenizer_dir",
    "check_sharding",
    "check_train",
    "config_class",
    "is_int",
    "is_num",
]

# Keys a transformers config accepts without their being dataclass fields: older names
# that transformers 5 still folds into the new ones (rope_theta -> rope_parameters), and
# head_dim, which some configs do not declare though their models read it (Qwen3-MoE:
# Qwen3-30B-A3B's heads are 128 wide, not hidden_size / heads = 64).
_LEGACY_CONFIG_KEYS = frozenset({"rope_theta", "rope_scaling", "torch_dtype", "head_dim"})


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def bad_number(e: Problems, path: str, v: Any, expected: str) -> None:
    """``e.bad`` for a field of numbers; a string such as ``'3e-3'`` (or a list holding
    one) also gets why YAML made it a string (Note [YAML 1.1 numbers])."""
    items = v if isinstance(v, tuple) else (v,)
    hint = next((h for x in items if (h := number_string_hint(x)) is not None), None)
    if hint is None:
        e.bad(path, v, expected)
    elif isinstance(v, str):
        e.add(path, f"got the string {v!r}; expected {expected}: {hint}")
    else:
        e.add(path, f"got {show_value(v)}; expected {expected}: {hint}")


MAX_SPEC_INT = 2**64 - 1
MIN_SPEC_INT = -(2**63)
"""The integers any spec field may hold: a spec travels in msgpack, which carries
integers in [-2**63, 2**64 - 1] (a larger one failed in the client, as a traceback)."""


def check_int(e: Problems, path: str, v: Any, lo: int | None = None, hi: int | None = None) -> bool:
    top = MAX_SPEC_INT if hi is None else hi
    ok = is_int(v) and (lo is None or v >= lo) and MIN_SPEC_INT <= v <= top
    if not ok:
        rng = (
            f"an integer >= {lo}"
            if hi is None and lo is not None
            else f"an integer in [{lo}, {hi}]"
            if lo is not None
            else "an integer"
        )
        if hi is None and is_int(v) and not MIN_SPEC_INT <= v <= MAX_SPEC_INT:
            rng += " within 64 bits (at most 2**64 - 1)"
        e.bad(path, v, rng)
    return ok


def check_choice(e: Problems, path: str, v: Any, choices: tuple[str, ...]) -> bool:
    if v in choices and isinstance(v, str):
        return True
    e.bad(path, v, "one of " + ", ".join(repr(c) for c in choices))
    return False


def check_bool(e: Problems, path: str, v: Any) -> None:
    if not isinstance(v, bool):
        e.bad(path, v, "true or false")


def check_dir(e: Problems, path: str, v: Any, what: str) -> bool:
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


def check_tokenizer_dir(e: Problems, path: str, v: Any) -> None:
    """``model.tokenizer`` / ``data.tokenizer``: a directory holding tokenizer files."""
    if check_dir(e, path, v, "a tokenizer directory") and not has_tokenizer_files(v):
        e.add(path, f"{v!r} {NO_TOKENIZER_FILES}")


def check_plan_splits(e: Problems, plan: Any, num_microbatches: int) -> None:
    """A microbatch split in ``train.plan`` must leave both tasks of its stage at least
    one microbatch (Note [microbatch-split stages] in roundpipe.shared.plan); a data-
    parallel group checks its nodes' shares again when the job starts."""
    from roundpipe.shared.plan import Plan

    if not isinstance(plan, str):
        return
    try:
        parsed = Plan.parse(plan)
    except ValueError:
        return  # check_train reports it
    try:
        parsed.validate_microbatches(num_microbatches)
    except ValueError as exc:
        e.bad("train.plan", plan, f"splits that fit batch.num_microbatches ({exc})")


def check_train(e: Problems, t: TrainSpec) -> bool:
    steps_ok = check_int(e, "train.steps", t.steps, lo=1)
    if not (is_int(t.staleness) and t.staleness in (0, 1)):
        e.bad("train.staleness", t.staleness, "0 (exact) or 1 (one step stale)")
    check_choice(e, "train.dtype", t.dtype, DTYPES)
    check_choice(e, "train.loss_scale", t.loss_scale, LOSS_SCALINGS)
    if t.loss_scale == "dynamic" and t.dtype in DTYPES and t.dtype != "float16":
        e.bad(
            "train.loss_scale",
            t.loss_scale,
            f"none or auto with train.dtype {t.dtype} (loss scaling keeps float16's small "
            "gradients from flushing to zero; this dtype has float32's range)",
        )
    initial = t.loss_scale_initial
    if not (is_int(initial) and 1 <= initial <= 2**32 and initial & (initial - 1) == 0):
        e.bad("train.loss_scale_initial", initial, "a power of two from 1 to 4294967296 (2**32)")
    check_int(e, "train.loss_scale_growth_interval", t.loss_scale_growth_interval, lo=1)
    check_int(e, "train.seed", t.seed, lo=0)
    check_bool(e, "train.replan", t.replan)
    check_int(e, "train.grad_buffer_stages", t.grad_buffer_stages, lo=0)
    check_choice(e, "train.recompute", t.recompute, ("auto", *RECOMPUTE_GRAINS))
    check_choice(e, "train.optimizer_sharding", t.optimizer_sharding, OPTIMIZER_SHARDINGS)
    check_choice(e, "train.grad_transport", t.grad_transport, GRAD_TRANSPORTS)
    if not (is_num(t.grad_bucket_mb) and t.grad_bucket_mb >= 0):
        bad_number(e, "train.grad_bucket_mb", t.grad_bucket_mb, "a number of MiB >= 0")
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


def check_sharding(e: Problems, t: TrainSpec, o: OptimizerSpec) -> None:
    """What ``train.optimizer_sharding: sharded`` cannot be combined with (yet); ``auto``
    keeps those replicated (``optimizer_state_sharded``)."""
    if t.optimizer_sharding != "sharded":
        return
    if o.state_dtype == "int8":
        e.add(
            "train.optimizer_sharding",
            "'sharded' is not implemented for optimizer.state_dtype int8; use float32 "
            "states or train.optimizer_sharding: replicated (docs/multi-node.md)",
        )


def unknown_config_keys(config_cls: type, keys: Iterable[str]) -> dict[str, str]:
    """Each of ``keys`` that ``config_cls`` (a transformers config class) has no field
    for, with what to say (a close field name, if any): transformers itself keeps an
    unknown key as an attribute and the model ignores it."""
    known = (
        {f.name for f in dataclasses.fields(config_cls)}
        | set(getattr(config_cls, "attribute_map", {}))
        | _LEGACY_CONFIG_KEYS
    )
    out = {}
    for key in keys:
        if key not in known:
            hint = difflib.get_close_matches(key, sorted(known), n=1)
            guess = f" (did you mean {hint[0]!r}?)" if hint else ""
            out[key] = f"unknown {config_cls.__name__} field{guess}"
    return out


class ModelConfigError(ValueError):
    """A model directory's config.json is missing, unreadable or not a JSON object."""


def read_model_config(path: str) -> dict[str, Any]:
    """A model directory's ``config.json`` as a dict; :class:`ModelConfigError` names the
    file and what is wrong with it otherwise."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ModelConfigError(
            f"{path!r} has no config.json; expected a Hugging Face model directory"
        )
    try:
        with open_for_read(cfg_file) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"cannot read {cfg_file!r}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{cfg_file!r} does not hold a JSON object")
    return cfg


def check_model(e: Problems, m: ModelSpec) -> Mapping[str, Any] | Any | None:
    """Check the model section; return its config (dict or transformers config) if known."""
    if m.init_seed is not None:
        check_int(e, "model.init_seed", m.init_seed, lo=0)
    if not isinstance(m.config, dict) or not json_like(m.config):
        e.bad("model.config", m.config, "a mapping of transformers config fields")
        return None
    if m.tokenizer is not None:
        check_tokenizer_dir(e, "model.tokenizer", m.tokenizer)
    if m.resume_from is not None and check_dir(
        e, "model.resume_from", m.resume_from, "a checkpoint directory"
    ):
        if not any(
            os.path.isfile(os.path.join(m.resume_from, *parts))
            for parts in ((MANIFEST,), (LATEST,), ("checkpoints", LATEST))
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
        check_bool(e, "model.dequantize", m.dequantize)
        if not check_dir(e, "model.path", m.path, "a model directory"):
            return None
        try:
            return read_model_config(m.path)
        except ModelConfigError as exc:
            e.add("model.path", str(exc))
            return None
    if not check_choice(e, "model.architecture", m.architecture, ARCHITECTURES):
        return None
    config_cls = config_class(m.architecture)
    unknown = unknown_config_keys(config_cls, m.config)
    for key, problem in unknown.items():
        e.add(f"model.config.{key}", problem)
    if unknown:
        return None
    try:
        return config_cls(**m.config)
    except Exception as exc:  # transformers raises several types for bad values
        detail = " ".join(str(exc).split())
        e.add("model.config", f"transformers rejected the config: {detail}")
        return None


def check_lora(e: Problems, lora: LoraSpec) -> None:
    check_int(e, "lora.r", lora.r, lo=1)
    if not (is_num(lora.alpha) and lora.alpha > 0):
        bad_number(e, "lora.alpha", lora.alpha, "a number > 0")
    if not (is_num(lora.dropout) and 0 <= lora.dropout < 1):
        bad_number(e, "lora.dropout", lora.dropout, "a number in [0, 1)")
    check_choice(e, "lora.base_quantization", lora.base_quantization, QUANTIZATIONS)
    check_bool(e, "lora.double_quantization", lora.double_quantization)
    check_choice(e, "lora.int8_scales", lora.int8_scales, INT8_SCALES)
    tm = lora.target_modules
    if tm == "all-linear":
        return
    if not (isinstance(tm, tuple) and tm and all(isinstance(x, str) and x for x in tm)):
        e.bad("lora.target_modules", tm, "a non-empty list of module names or 'all-linear'")


def check_data(e: Problems, d: DataSpec) -> bool:
    """The data section; whether its format can be told (the path exists, the format,
    text field and columns are valid)."""
    if d.seed is not None:
        check_int(e, "data.seed", d.seed, lo=0)
    check_int(e, "data.seq_len", d.seq_len, lo=2)
    check_bool(e, "data.shuffle", d.shuffle)
    if not isinstance(d.packing, bool) and d.packing not in DATA_PACKING:
        e.bad("data.packing", d.packing, "true or false, or one of " + ", ".join(DATA_PACKING))
    check_choice(e, "data.loss_on", d.loss_on, DATA_LOSS_ON)
    check_choice(e, "data.overlong", d.overlong, DATA_OVERLONG)
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
    if d.tokenizer is not None:
        check_tokenizer_dir(e, "data.tokenizer", d.tokenizer)
    format_ok = check_choice(e, "data.format", d.format, DATA_FORMATS)
    if d.path is None:
        e.add("data.path", "missing; expected a path to a local .jsonl, .parquet or .txt file")
        return False
    if not isinstance(d.path, str) or not d.path:
        e.bad("data.path", d.path, "a path to a local .jsonl, .parquet or .txt file")
        return False
    if not os.path.exists(d.path):
        e.add("data.path", f"data file {d.path!r} does not exist")
        return False
    if not (os.path.isfile(d.path) or os.path.isdir(d.path)):
        e.add("data.path", f"{d.path!r} is not a regular file; expected a .jsonl or .txt file")
        return False
    # Without these, format detection would only repeat their errors.
    return format_ok and text_field_ok and columns_ok


def check_optimizer(e: Problems, o: OptimizerSpec, steps: int | None) -> None:
    if not (is_num(o.lr) and o.lr > 0):
        bad_number(e, "optimizer.lr", o.lr, "a number > 0")
    b = o.betas
    if not (isinstance(b, tuple) and len(b) == 2 and all(is_num(x) and 0 <= x < 1 for x in b)):
        bad_number(e, "optimizer.betas", b, "two numbers in [0, 1), e.g. [0.9, 0.999]")
    if not (is_num(o.eps) and o.eps > 0):
        bad_number(e, "optimizer.eps", o.eps, "a number > 0")
    if not (is_num(o.weight_decay) and o.weight_decay >= 0):
        bad_number(e, "optimizer.weight_decay", o.weight_decay, "a number >= 0")
    if o.grad_clip is not None and not (is_num(o.grad_clip) and o.grad_clip > 0):
        bad_number(e, "optimizer.grad_clip", o.grad_clip, "null (no clipping) or a number > 0")
    check_choice(e, "optimizer.schedule", o.schedule, SCHEDULES)
    check_choice(e, "optimizer.state_dtype", o.state_dtype, STATE_DTYPES)
    if o.state_dtype == "int8" and o.name != "adamw":
        e.bad("optimizer.state_dtype", o.state_dtype, "float32 with optimizer.name sgd")
    check_choice(e, "optimizer.schedule_convention", o.schedule_convention, SCHEDULE_CONVENTIONS)
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
    if check_int(e, "optimizer.warmup_steps", o.warmup_steps, lo=0) and steps is not None:
        if o.warmup_steps > steps:
            e.add(
                "optimizer.warmup_steps",
                f"got {o.warmup_steps}, more than train.steps ({steps}); expected at most {steps}",
            )
    if not (is_num(o.min_lr_ratio) and 0 <= o.min_lr_ratio <= 1):
        bad_number(e, "optimizer.min_lr_ratio", o.min_lr_ratio, "a number in [0, 1]")
    check_int(e, "optimizer.threads", o.threads, lo=0)
    check_choice(e, "optimizer.kernel", o.kernel, OPTIMIZER_KERNELS)
    check_choice(e, "optimizer.name", o.name, OPTIMIZERS)
    if not (is_num(o.momentum) and 0 <= o.momentum < 1):
        bad_number(e, "optimizer.momentum", o.momentum, "a number in [0, 1)")
    if not isinstance(o.nesterov, bool):
        e.bad("optimizer.nesterov", o.nesterov, "true or false")
    elif o.nesterov and not (o.name == "sgd" and is_num(o.momentum) and o.momentum > 0):
        e.add("optimizer.nesterov", "got True; it needs name: sgd and a momentum > 0")
    if o.name != "sgd" and is_num(o.momentum) and o.momentum != 0:
        e.add(
            "optimizer.momentum",
            f"got {o.momentum}; momentum applies to name: sgd only (name is {o.name!r})",
        )


def check_output(e: Problems, o: OutputSpec) -> None:
    if o.dir is not None:
        if not isinstance(o.dir, str) or not o.dir:
            e.bad("output.dir", o.dir, "a directory path or null")
        elif os.path.exists(o.dir) and not os.path.isdir(o.dir):
            e.add("output.dir", f"{o.dir!r} exists and is not a directory")
    check_int(e, "output.checkpoint_every", o.checkpoint_every, lo=0)
    check_int(e, "output.keep_last", o.keep_last, lo=0)
    _check_staging(e, o.checkpoint_staging)
    check_bool(e, "output.timeline", o.timeline)
    check_bool(e, "output.tensorboard", o.tensorboard)


def _check_staging(e: Problems, v: Any) -> None:
    if v == "auto":
        return
    try:
        ok = not isinstance(v, bool) and staging_limit_bytes(v) >= 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        e.bad("output.checkpoint_staging", v, '"auto", a size such as "8GiB", or 0')


def config_class(architecture: str) -> type:
    # Lazy: importing transformers takes seconds, and a spec without an architecture
    # model never needs it.
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[architecture]
