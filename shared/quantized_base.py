"""Which frozen weights of a LoRA job are stored quantised, and how they travel.

With ``lora.base_quantization: nf4 | int8`` the coordinator quantises the frozen base
once, at load (roundpipe.shared.quant_format has the formats); the host arenas, the
uploads and the workers carry the quantised *parts* and each worker dequantises a
layer's weights into the compute dtype just before that layer runs
(roundpipe.worker.executor). A LoRA job on a bitsandbytes-quantised checkpoint takes its
codes as the parts instead, as they are (Note [bitsandbytes checkpoint] in
roundpipe.shared.bnb_checkpoint); from there on nothing differs.

Note [quantised base]
~~~~~~~~~~~~~~~~~~~~~
A quantised weight is not a new kind of thing to the runtime: it is stored as a few
plain tensors named ``<weight name>#<part>`` (``...q_proj.base_layer.weight#codes``,
``...#absmax``), laid out in the params arena, described in ``JobSetup`` and uploaded
exactly like any frozen weight. Only two places know what the parts mean: the trainer,
which replaces each quantised weight by its parts before it copies W_0 into the arena
(and the exporter, which puts them back together), and the executor, which rebuilds the
weight from the parts it was handed, per layer and per microbatch, so no more than one
layer's dequantised weights live at a time outside autograd's saved tensors.

Which weights: the frozen matrices of the decoder layers that QLoRA quantises, i.e. the
weights of linear layers (``nn.Linear``, also as peft's ``base_layer``) and the fused 3-D
expert tensors of MoE layers (``...Experts`` modules: Qwen3-MoE, Qwen3.5-MoE, GPT-OSS).
Kept in the compute dtype: everything 1-D (norms, biases, sinks), the embedding and the
LM head (outside the decoder layers, as QLoRA), an MoE router (small, and routing
decisions are sensitive to it), an expert module's 2-D biases, and a depthwise
``nn.Conv1d`` (Qwen3.5's short convolution: a few KB). A frozen matrix of any other
module is refused: the quantiser does not know whether a plain per-block format is safe
for it, and guessing would train a silently different model.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from roundpipe.shared.quant_format import QuantFormat

__all__ = ["PART_SEP", "QUANTISED_MODULES", "QuantizedBase", "part_name"]

PART_SEP = "#"
"""Between a weight's name and a part's name: no parameter name contains it."""


def part_name(name: str, part: str) -> str:
    return f"{name}{PART_SEP}{part}"


@dataclass(frozen=True)
class QuantizedBase:
    """The quantised weights of one model: name -> shape, and their format."""

    format: QuantFormat
    shapes: dict[str, tuple[int, ...]]
    """Every quantised weight's full name and (unquantised) shape."""

    @classmethod
    def of(cls, model: Any, fmt: QuantFormat) -> QuantizedBase:
        """Select ``model``'s quantised weights (a roundpipe.shared.model.LayeredModel);
        raises ValueError naming a frozen matrix of a module the quantiser does not know
        (Note [quantised base])."""
        shapes: dict[str, tuple[int, ...]] = {}
        for layer in range(1, model.num_layers - 1):
            router = model.router_module(layer)
            for spec in model.layer_params(layer):
                if spec.trainable or spec.tied_to is not None or len(spec.shape) < 2:
                    continue
                module_path, attr = spec.name.rsplit(".", 1)
                module = model.skeleton.get_submodule(module_path)
                if _quantised(module, attr, len(spec.shape)):
                    shapes[spec.name] = spec.shape
                elif not _kept(module, router, len(spec.shape)):
                    raise ValueError(
                        f"lora.base_quantization: {fmt.kind} does not know how to quantise "
                        f"{spec.name} {spec.shape} of a {type(module).__name__} module: only "
                        "linear layers and MoE expert tensors are quantised (routers, biases, "
                        "norms and depthwise convolutions stay in the compute dtype); use "
                        "base_quantization: none for this model"
                    )
        return cls(fmt, shapes)

    def parts(self, name: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Full part name -> (dtype, shape) of quantised weight ``name``."""
        return {
            part_name(name, p): spec for p, spec in self.format.parts(self.shapes[name]).items()
        }

    def stored_nbytes(self, name: str, shape: tuple[int, ...], compute_bytes: int) -> int:
        """Bytes weight ``name`` takes in the params arena (and on the bus)."""
        if name in self.shapes:
            return self.format.nbytes(shape)
        n = 1
        for d in shape:
            n *= d
        return n * compute_bytes

    # -- the coordinator: W_0 into parts, and back for export -------------------------

    def quantize_weights(self, weights: MutableMapping[int, MutableMapping[str, torch.Tensor]]):
        """Replace, in place, every quantised weight of a weight set by its parts (those
        already given as parts, as a bitsandbytes checkpoint's are, stay as they are)."""
        for per_layer in weights.values():
            for name in [n for n in per_layer if n in self.shapes]:
                w = per_layer.pop(name)
                for part, t in self.format.quantize(w).items():
                    per_layer[part_name(name, part)] = t

    def dequantize_weights(
        self, weights: MutableMapping[int, MutableMapping[str, torch.Tensor]], dtype: torch.dtype
    ) -> None:
        """The inverse, in place: every weight's parts replaced by the weight in ``dtype``."""
        for per_layer in weights.values():
            for name in [n for n in self.shapes if part_name(n, "codes") in per_layer]:
                parts = self.take_parts(per_layer, name)
                per_layer[name] = self.format.dequantize(parts, self.shapes[name], dtype)

    def take_parts(self, named: MutableMapping[str, Any], name: str) -> dict[str, Any]:
        """Remove quantised weight ``name``'s parts from ``named``; by short part name."""
        prefix = name + PART_SEP
        return {p[len(prefix) :]: named.pop(p) for p in list(self.parts(name))}

    def get_parts(self, named: Mapping[str, Any], name: str) -> dict[str, Any] | None:
        """Quantised weight ``name``'s parts in ``named``, by short part name (None if
        any is missing)."""
        out = {}
        for full in self.parts(name):
            t = named.get(full)
            if t is None:
                return None
            out[full[len(name) + len(PART_SEP) :]] = t
        return out

    def dequantize(self, parts: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype):
        return self.format.dequantize(parts, self.shapes[name], dtype)


QUANTISED_MODULES: tuple[type[nn.Module], ...] = (nn.Linear,)
"""Module types whose ``weight`` is quantised (besides fused ``...Experts`` tensors)."""


def _quantised(module: nn.Module, attr: str, ndim: int) -> bool:
    if isinstance(module, QUANTISED_MODULES) and attr == "weight":
        return True
    # Fused MoE experts: [experts, out, in] (or [experts, in, out]) matrices.
    return type(module).__name__.endswith("Experts") and ndim == 3


def _kept(module: nn.Module, router: nn.Module | None, ndim: int) -> bool:
    if router is not None:
        # peft may wrap the router (parameter-level LoRA): its frozen weight is then
        # the wrapped module's.
        base = router.get_base_layer() if hasattr(router, "get_base_layer") else router
        if module is router or module is base:
            return True
    if type(module).__name__.endswith("Experts") and ndim == 2:  # per-expert biases
        return True
    return isinstance(module, nn.Conv1d)
