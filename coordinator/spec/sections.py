"""The job spec's sections: what each field means, its type and its default.

The section classes (:class:`ModelSpec`, :class:`DataSpec`, ...) are plain frozen
records; they only normalise (paths made absolute, lists made tuples). They check
nothing: :class:`roundpipe.coordinator.spec.jobspec.JobSpec` checks the whole spec when it
is built (roundpipe.coordinator.spec.section_checks has the rules of each section). See
docs/job-spec.md for every field with its default and an example.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from roundpipe.coordinator.spec.choices import HF_NO_DECAY

__all__ = [
    "PATH_ACCESS",
    "PATH_FIELDS",
    "SECTIONS",
    "BatchSpec",
    "DataSpec",
    "LoraSpec",
    "ModelSpec",
    "OptimizerSpec",
    "OutputSpec",
    "PathField",
    "TrainSpec",
    "json_like",
    "path_fields_of",
    "plain",
    "read_path",
    "staging_limit_bytes",
    "write_path",
]


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
# confinement to its --allow-read / --allow-write roots (spec.paths), so a new
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


def path_fields_of(section_cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(section_cls) if PATH_ACCESS in f.metadata]


def _normalise_paths(section: Any) -> None:
    """Make every path field of a section object absolute (Note [paths are a type])."""
    for f in path_fields_of(type(section)):
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
        if isinstance(self.config, Mapping) and json_like(dict(self.config)):
            # A private deep copy (tuples become lists, as after a msgpack/YAML trip): the
            # spec must not change under the caller's feet, and must round-trip.
            object.__setattr__(self, "config", plain(dict(self.config)))


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
    base_quantization: str = "none"
    """How the frozen base is stored, moved and uploaded: ``none`` (the compute dtype),
    ``nf4`` (QLoRA's 4-bit NormalFloat, block 64) or ``int8`` (absmax int8); workers
    dequantise each layer into the compute dtype before it runs. docs/memory.md."""
    double_quantization: bool = True
    """With ``nf4``: store the block scales in 8 bits too (QLoRA's double quantisation)."""
    int8_scales: str = "per_channel"
    """With ``int8``: one scale per row (``per_channel``) or per 64 values (``per_block``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", _freeze_seq(self.target_modules))

    def model_settings(self) -> dict[str, Any]:
        """The settings ``roundpipe.shared.model.LayeredModel`` takes for LoRA."""
        return {
            "r": self.r,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "target_modules": self.target_modules,
            "base_quantization": self.base_quantization,
            "double_quantization": self.double_quantization,
            "int8_scales": self.int8_scales,
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
    loss_scale: str = "auto"
    """float16 loss scaling, one of ``LOSS_SCALINGS``: ``dynamic`` (the backward is
    seeded with a power-of-two scale that halves, and the step is skipped, when a
    gradient overflows, and doubles after ``loss_scale_growth_interval`` steps without
    one, as torch's GradScaler does), ``none``, or ``auto`` (dynamic with float16, none
    otherwise: bfloat16 and float32 do not need it). docs/job-spec.md."""
    loss_scale_initial: int = 65536
    """The first loss scale: a power of two from 1 to 2**32 (GradScaler's default)."""
    loss_scale_growth_interval: int = 2000
    """Steps without an overflow after which the loss scale doubles (>= 1)."""
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
    layer. Ignored (one slot per layer) with ``optimizer.grad_clip`` or float16 loss
    scaling (``loss_scale``)."""
    optimizer_sharding: str = "auto"
    """With several nodes (docs/multi-node.md), one of ``OPTIMIZER_SHARDINGS``:
    ``replicated`` (every node holds all fp32 masters and moments), ``sharded`` (each
    node holds and steps only its 1/W of them; the same results, bitwise) or ``auto``
    (sharded, unless ``optimizer.state_dtype`` is int8). One node: ignored (its shard is
    the whole state)."""
    grad_transport: str = "float32"
    """With several nodes, one of ``GRAD_TRANSPORTS``: the dtype the gradients cross the
    network in (``bfloat16``: half the bytes, rounded; ``float32``: exact)."""
    grad_bucket_mb: float = 25.0
    """With several nodes: consecutive layers are reduced (and, sharded, their weights
    gathered) in one collective until their gradients reach this many MiB in the
    transport dtype, as DDP's ``bucket_cap_mb``; a larger layer is a bucket of its own.
    0: one collective per layer. Both ``optimizer_sharding`` modes give the same bits
    at any value; over 3 nodes or more it sets the order in which the nodes' gradients
    are added (last-bit differences between values)."""
    recompute: str = "auto"
    """How backward tasks recompute their stage: ``stage`` (the whole stage under
    autograd: fastest), ``layer`` (one layer at a time, keeping only each layer's input:
    far less GPU memory at long sequences, one more forward of the stage) or ``auto`` (the
    planner takes layer grain when no stage-grain plan fits the workers' memory). The
    gradients are the same, bitwise."""


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
    kernel: str = "auto"
    """One of ``OPTIMIZER_KERNELS``: ``auto`` runs AdamW with float32 states on the compiled
    one-pass kernel (update and bf16 copy in one pass; bitwise torch's fused AdamW) when
    numba is installed and its self-check passes, else on torch's fused kernel; ``torch``
    always on torch's. Results do not depend on it."""

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


SECTIONS: dict[str, type] = {
    "model": ModelSpec,
    "lora": LoraSpec,
    "data": DataSpec,
    "batch": BatchSpec,
    "train": TrainSpec,
    "optimizer": OptimizerSpec,
    "output": OutputSpec,
}


PATH_FIELDS: tuple[PathField, ...] = tuple(
    PathField(section, f.name, f.metadata[PATH_ACCESS])
    for section, section_cls in SECTIONS.items()
    for f in path_fields_of(section_cls)
)
"""Every path-typed field of the spec, read from the schema (Note [paths are a type])."""


def staging_limit_bytes(value: str | int) -> int | None:
    """``output.checkpoint_staging`` in bytes; None for ``"auto"``."""
    from roundpipe.shared.units import parse_quantity

    if value == "auto":
        return None
    return int(parse_quantity(value, what="output.checkpoint_staging"))


def plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def json_like(v: Any) -> bool:
    if v is None or isinstance(v, bool | int | str):
        return True
    if isinstance(v, float):
        return True
    if isinstance(v, list | tuple):
        return all(json_like(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and json_like(x) for k, x in v.items())
    return False
