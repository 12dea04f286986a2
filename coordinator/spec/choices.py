"""The values a job spec's fields may take: data formats, packing, dtypes, schedules, ...

Each list is defined here once; the spec's checks, the data pipeline and the optimizer
read it from here.
"""

from __future__ import annotations

from typing import Any

from roundpipe.coordinator.spec.errors import DataError
from roundpipe.shared.families import FAMILIES
from roundpipe.shared.quant_choices import INT8_SCALES, QUANTIZATIONS

__all__ = [
    "ARCHITECTURES",
    "DATA_COLUMNS",
    "DATA_FORMATS",
    "DATA_LOSS_ON",
    "DATA_OVERLONG",
    "DATA_PACKING",
    "DTYPES",
    "LOSS_SCALINGS",
    "GRAD_TRANSPORTS",
    "HF_NO_DECAY",
    "INT8_SCALES",
    "OPTIMIZERS",
    "OPTIMIZER_KERNELS",
    "OPTIMIZER_SHARDINGS",
    "PACKING_ALIASES",
    "QUANTIZATIONS",
    "SCHEDULES",
    "SCHEDULE_CONVENTIONS",
    "STATE_DTYPES",
    "optimizer_state_sharded",
    "packing_alias",
    "packing_mode",
]

ARCHITECTURES = tuple(FAMILIES)
"""``model.architecture`` choices: the model_type of every declared family
(roundpipe.shared.families)."""
DATA_FORMATS = ("auto", "jsonl_text", "jsonl_tokens", "text", "chat", "prompt_completion")
DATA_PACKING = ("documents", "concat", "none")
DATA_LOSS_ON = ("assistant", "all")
DATA_OVERLONG = ("truncate", "refuse")
PACKING_ALIASES: dict[Any, str] = {True: "documents", False: "none"}
"""``data.packing``'s booleans: ``true`` is ``documents``, ``false`` is ``none``."""
DATA_COLUMNS = ("text", "messages", "prompt", "completion", "input_ids", "labels")
DTYPES = ("float32", "bfloat16", "float16")
LOSS_SCALINGS = ("auto", "dynamic", "none")
"""``train.loss_scale``: ``auto`` is ``dynamic`` with float16, ``none`` otherwise."""
SCHEDULES = ("constant", "linear", "cosine")
OPTIMIZERS = ("adamw", "sgd")
STATE_DTYPES = ("float32", "int8")
"""``optimizer.state_dtype``: how AdamW's moments are stored (docs/memory.md)."""
OPTIMIZER_KERNELS = ("auto", "torch")
"""``optimizer.kernel``: ``auto`` runs AdamW with float32 states on the compiled one-pass
kernel when it loads and passes its bitwise self-check (else torch's); ``torch`` always
on torch's fused kernel (Note [compiled AdamW kernel])."""
# ``lora.base_quantization`` (QUANTIZATIONS) and ``lora.int8_scales`` (INT8_SCALES) are
# defined in roundpipe.shared.quant_choices (no torch: the client checks specs) and
# re-exported here.
OPTIMIZER_SHARDINGS = ("auto", "replicated", "sharded")
"""``train.optimizer_sharding`` with several nodes (docs/multi-node.md): every node holds
all fp32 masters and moments (``replicated``), or each node only its shard of them
(``sharded``: gradients reduce-scattered, updated weights all-gathered); ``auto``:
sharded where it is implemented (see ``optimizer_state_sharded``)."""


def optimizer_state_sharded(sharding: str, state_dtype: str) -> bool:
    """Whether a job with ``train.optimizer_sharding: sharding`` and
    ``optimizer.state_dtype: state_dtype`` shards its optimizer state over the nodes of
    a group: ``sharded``, or ``auto`` unless the states are int8 (not implemented
    sharded; ``auto`` then keeps them replicated). One node: its shard is the whole."""
    return sharding == "sharded" or (sharding == "auto" and state_dtype != "int8")


GRAD_TRANSPORTS = ("float32", "bfloat16")
"""``train.grad_transport``: the dtype gradients cross the network in between nodes
(``float32``: exact; ``bfloat16``: half the bytes, rounded; docs/multi-node.md)."""
SCHEDULE_CONVENTIONS = ("hf", "one_based")
"""Which schedule position optimizer step s uses: ``hf``: s - 1, as the Hugging Face
Trainer (step 1 of a warmup has lr 0); ``one_based``: s (warmup peaks at step W)."""

HF_NO_DECAY = ("bias", "layernorm", "rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
"""The Hugging Face Trainer's rule (``Trainer.get_decay_parameter_names``): no weight
decay for biases and normalisation weights (``input_layernorm``, ``model.norm``,
``q_norm``, ...). The default of ``optimizer.no_decay``."""


def packing_alias(value: object) -> object:
    """The canonical name of a ``data.packing`` value (``true`` is ``documents``, ``false``
    is ``none``); any other value, a wrong type included, as it is (reported elsewhere)."""
    return PACKING_ALIASES.get(value, value) if isinstance(value, (bool, str)) else value


def packing_mode(packing: bool | str) -> str:
    """``documents`` / ``concat`` / ``none`` for a ``data.packing`` value (``true`` is
    ``documents``, ``false`` is ``none``)."""
    if isinstance(packing, bool):
        return PACKING_ALIASES[packing]
    if packing not in DATA_PACKING:
        raise DataError(
            f"unknown packing {packing!r}; expected true, false or one of {DATA_PACKING}"
        )
    return str(packing)
