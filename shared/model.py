"""Causal LMs as sequences of layers, with weights kept outside the modules.

A supported Hugging Face causal LM (``SUPPORTED_ARCHITECTURES``; each family declared in
roundpipe.shared.families) becomes ``n`` layers::

    layer 0          prefix: model.embed_tokens            (input_ids -> hidden)
    layer 1..n-2     decoder layers: HF layer i is our layer i + 1
    layer n-1        tail: model.norm + lm_head + loss      (hidden -> loss)

Only hidden states ``[rows, seq, hidden]`` cross layer boundaries; positions, rotary
tables and the masks (per layer: full, sliding-window or recurrent, from the family) are
recomputed from the shape wherever they are needed.

Parameters keep their Hugging Face names (``model.layers.3.self_attn.q_proj.weight``) so
an exported checkpoint stays loadable by transformers; with LoRA they keep the names of
peft's wrapped model (``base_model.model.model.layers.3.self_attn.q_proj.lora_A.default
.weight``). ``checkpoint_name`` maps a name to the key a saved HF / peft file uses.

Note [tied embeddings]
    With ``tie_word_embeddings`` the LM head reuses the embedding matrix. The tail layer
    still lists ``lm_head.weight``, with ``ParamSpec.tied_to`` naming its owner
    (``model.embed_tokens.weight``, layer 0). A tied entry has no storage of its own (no
    params/master/optimizer slot): tasks receive the owner's tensor under the tied name.
    It does get its own gradient: the tail returns the LM head's contribution under the
    tied name, and the owner's total gradient is the sum of both (what
    the tests' ``run_iteration`` and the optimizer must do).

A ``LayeredModel`` also owns the *skeleton*: the HF module tree (peft-wrapped for LoRA)
built once on the meta device. Workers run layers of it through
``torch.func.functional_call`` with weights handed in per task, so the skeleton never
holds real weights.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from roundpipe.shared.bnb_checkpoint import bnb_format, is_bnb, is_quantised, read_parts
from roundpipe.shared.families import (
    MASK_OF_LAYER_TYPE,
    Family,
    check_layout,
    family_for,
    layer_types,
    supported_architectures,
)
from roundpipe.shared.quant_format import QUANTIZATIONS, QuantFormat
from roundpipe.shared.quantized_base import QuantizedBase, part_name

__all__ = [
    "ALL_LINEAR",
    "SUPPORTED_ARCHITECTURES",
    "IGNORE_INDEX",
    "LayeredModel",
    "LoraSettings",
    "ParamSpec",
    "RouterAux",
    "count_label_tokens",
    "shift_labels",
    "without_mxfp4",
    "model_config_dict",
]

SUPPORTED_ARCHITECTURES: tuple[str, ...] = supported_architectures()

IGNORE_INDEX = -100
"""Label value that contributes no loss (Hugging Face's convention)."""

ALL_LINEAR = "all-linear"
"""LoRA ``target_modules`` shorthand, with peft's meaning: every linear layer except the
output layer (the LM head), resolved by peft for each model."""

_PEFT_PREFIX = "base_model.model."
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# Per-expert checkpoint keys (the format HF saves by default and the hub uses for Qwen3-MoE)
# that transformers >= 5 merges into 3-D expert tensors at load time.
_FUSED_EXPERTS_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter of one layer, independent of the dtype it is stored in."""

    name: str
    """Full name in the (peft-wrapped) HF model, unique across the model."""
    shape: tuple[int, ...]
    trainable: bool
    """Gets a gradient, master copy and optimizer state (False: LoRA base weights)."""
    tied_to: str | None = None
    """Owner's name when this entry aliases another layer's weight. Note [tied embeddings]."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True)
class RouterAux:
    """transformers' load-balancing loss of an MoE model (``output_router_logits``).

    Note [router auxiliary loss]
        transformers adds ``coef * E * sum_e C_e * P_e / R^2`` to the LM loss, where over
        every MoE layer and token of the batch C_e counts top-k picks of expert e, P_e
        sums its router softmax and R is layers x tokens. C and P span all layers, so a
        pipeline cannot form it per stage; it is formed per microbatch m and summed with
        weight ``w_m = tokens_m / tokens of the batch`` (the LM loss is summed over
        microbatches the same way; one microbatch gives transformers' value exactly).
        Forward stages return each microbatch's partial (C, P) of their layers; the
        fused tail adds its own, so it has the loss and the complete C; backward
        stages receive C and add ``coef * w_m * E * C / R^2`` as the gradient of their
        layers' P. C is a count (no gradient), as in transformers. Padding is no token
        here: transformers, given a padded batch's attention mask, leaves it out of C, P
        and R, and so do the executors given each row's real tokens (the data's row
        lengths; padding is always at a row's end), tokens_m and the batch's counting
        real tokens only.
    """

    coef: float
    """``router_aux_loss_coef``."""
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    """Our layer indices of the decoder layers that route (have a router)."""


_LORA_KEYS = (
    "r",
    "alpha",
    "dropout",
    "target_modules",
    "base_quantization",
    "double_quantization",
    "int8_scales",
    "base_layout",
)


@dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """LoRA adapters added through peft; base weights are frozen."""

    r: int
    """Adapter rank."""
    alpha: float
    """Scale numerator: the adapter output is multiplied by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapter input (reproduced on recompute, see the executor)."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Module names (peft semantics) inside decoder layers that receive adapters, or
    ``("all-linear",)`` (``ALL_LINEAR``, also given as the bare string): peft's shorthand."""
    base_quantization: str = "none"
    """How the frozen base is stored: ``none`` (compute dtype), ``nf4`` or ``int8``
    (roundpipe.shared.quant_format; Note [quantised base] in roundpipe.shared.quantized_base)."""
    double_quantization: bool = True
    """nf4: the block absmaxes in 8 bits too (QLoRA's double quantisation)."""
    int8_scales: str = "per_channel"
    """int8: one absmax per row (``per_channel``) or per 64 elements (``per_block``)."""
    base_layout: str = "roundpipe"
    """``bitsandbytes``: the base is a bitsandbytes checkpoint's codes, not quantised at
    load (set from the checkpoint by ``with_checkpoint``; Note [bitsandbytes checkpoint])."""

    def __post_init__(self) -> None:
        tm = self.target_modules
        object.__setattr__(self, "target_modules", (tm,) if isinstance(tm, str) else tuple(tm))
        if not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"LoRA r must be a positive integer, got {self.r!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be positive, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules or not all(isinstance(t, str) for t in self.target_modules):
            raise ValueError(
                f"LoRA target_modules must be a non-empty list of names, got {self.target_modules!r}"
            )
        if self.base_quantization not in QUANTIZATIONS:
            raise ValueError(
                f"LoRA base_quantization must be one of {QUANTIZATIONS}, got "
                f"{self.base_quantization!r}"
            )
        self.quant_format()  # checks int8_scales

    def quant_format(self) -> QuantFormat | None:
        """The frozen base's storage format; None: the compute dtype."""
        if self.base_quantization == "none":
            return None
        return QuantFormat(
            self.base_quantization,
            double_quant=bool(self.double_quantization),
            int8_scales=self.int8_scales,
            layout=self.base_layout,
        )

    def with_checkpoint(self, quant_config: Any) -> LoraSettings:
        """These settings on a checkpoint with ``quant_config`` (its
        ``quantization_config``, or None): a bitsandbytes checkpoint's own quantisation
        becomes the base's (Note [bitsandbytes checkpoint]); ValueError if the settings
        ask for another."""
        if not is_bnb(quant_config):
            return self
        fmt = bnb_format(quant_config)
        ours = self.quant_format()
        if ours is not None and dataclasses.replace(ours, layout=fmt.layout) != fmt:
            raise ValueError(
                f"lora.base_quantization: {self.base_quantization} (double_quantization: "
                f"{ours.double_quant}, int8_scales: {ours.int8_scales}) conflicts with the "
                f"checkpoint, which bitsandbytes quantised as {fmt.kind}"
                + (f" (double_quantization: {fmt.double_quant})" if fmt.kind == "nf4" else "")
                + ": omit lora.base_quantization (the checkpoint decides), or point "
                "model.path at the unquantised checkpoint"
            )
        return dataclasses.replace(
            self,
            base_quantization=fmt.kind,
            double_quantization=fmt.double_quant,
            int8_scales=fmt.int8_scales,
            base_layout=fmt.layout,
        )

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Any]) -> LoraSettings:
        """Accept ``{r, alpha, dropout, target_modules}`` (peft's ``lora_`` spellings too)."""
        aliases = {"lora_alpha": "alpha", "lora_dropout": "dropout"}
        kw: dict[str, Any] = {}
        for key, value in spec.items():
            key = aliases.get(key, key)
            if key not in _LORA_KEYS:
                raise ValueError(
                    f"unknown LoRA setting {key!r}: expected one of {', '.join(_LORA_KEYS)}"
                )
            if key in kw:
                raise ValueError(f"LoRA setting {key!r} given twice")
            kw[key] = value
        for key in ("r", "alpha"):
            if key not in kw:
                raise ValueError(f"LoRA settings need {key!r}")
        return cls(**kw)

    def to_mapping(self) -> dict[str, Any]:
        """The settings as :meth:`from_mapping` reads them back (``JobSetup.lora``)."""
        out: dict[str, Any] = {
            "r": self.r,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "target_modules": list(self.target_modules),
        }
        if self.base_quantization != "none":  # a plain LoRA job's JobSetup is unchanged
            out["base_quantization"] = self.base_quantization
            out["double_quantization"] = self.double_quantization
            out["int8_scales"] = self.int8_scales
        if self.base_layout != "roundpipe":
            out["base_layout"] = self.base_layout
        return out

    def base_record(self) -> dict[str, Any]:
        """The frozen base these adapters train against, as a checkpoint records it (its
        manifest's ``model.base``): how it is stored and where its codes came from. A
        resume needs the same: adapters trained on one base continue on another
        without an error, but not as the same model."""
        fmt = self.quant_format()
        if fmt is None:
            return {"quantization": "none"}
        record: dict[str, Any] = {"quantization": fmt.kind, "layout": fmt.layout}
        if fmt.kind == "nf4":
            record["double_quantization"] = fmt.double_quant
        else:
            record["int8_scales"] = fmt.int8_scales
        return record

    def peft_config(self) -> Any:
        from peft import LoraConfig

        targets: str | list[str] = list(self.target_modules)
        if self.target_modules == (ALL_LINEAR,):
            # peft knows the shorthand only as a bare string; in a list it is taken as a
            # module name and matches nothing ("Target modules {'all-linear'} not found").
            # As a string peft resolves it per model: every linear layer but the output
            # layer, and on transformers-5 MoE models the fused experts and the router.
            targets = ALL_LINEAR
        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM",
        )


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels aligned with the positions that predict them, as HF's causal-LM loss does.

    Position t predicts token t + 1, so the target of position t is ``labels[..., t+1]``;
    the last position of each row has no target.
    """
    return nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def count_label_tokens(labels: torch.Tensor) -> int:
    """Number of tokens that contribute to the loss of one microbatch (after the shift).

    The loss is normalised by the sum of this over the whole global batch.
    """
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def _without_base_layers(name: str) -> str:
    """A peft-wrapped weight's name as the base model's checkpoint holds it: every
    ``.base_layer`` gone, however many wrappers are nested (peft wraps each fused MoE
    expert parameter in a wrapper of its own: ``experts.base_layer.base_layer.x``)."""
    return re.sub(r"(?:\.base_layer)+\.", ".", _strip_peft(name))


def _strip_peft(name: str) -> str:
    return name[len(_PEFT_PREFIX) :] if name.startswith(_PEFT_PREFIX) else name


class LayeredModel:
    """A supported causal LM described as ``num_layers`` layers of named parameters.

    Build it with ``from_config`` (random init via ``init_weights``) or ``from_hf_dir``
    (weights via ``load_weights``). Weight sets are ``dict[layer, dict[name, Tensor]]``
    holding every non-tied parameter of ``layer_params(layer)``.
    """

    def __init__(
        self,
        config: Any,
        lora: LoraSettings | Mapping[str, Any] | None = None,
        *,
        source_dir: str | Path | None = None,
        attn_implementation: str | None = None,
        dequantize_mxfp4: bool = False,
    ) -> None:
        self.config = copy.deepcopy(config)
        # MXFP4-packed experts (GPT-OSS hub checkpoints) become plain weights on load;
        # the model trained and exported is then the unquantised one.
        self.dequantize_mxfp4 = dequantize_mxfp4
        if dequantize_mxfp4:
            self.config = without_mxfp4(self.config)
        self.family: Family = family_for(self.config)
        self.architecture = self.family.architecture
        self._check_config()
        if lora is not None and not isinstance(lora, LoraSettings):
            lora = LoraSettings.from_mapping(lora)
        quant_config = getattr(self.config, "quantization_config", None)
        if lora is not None:
            lora = lora.with_checkpoint(quant_config)
        elif is_bnb(quant_config):
            raise ValueError(
                "this checkpoint is quantised by bitsandbytes: its weights are frozen codes, "
                "so it trains only with LoRA (full fine-tuning is refused)"
            )
        self.lora: LoraSettings | None = lora
        self.source_dir = Path(source_dir) if source_dir is not None else None
        # The family's default (SDPA; eager where transformers has no SDPA path, as for
        # GPT-OSS's attention sinks) unless the caller asks for another.
        self.attn_implementation = attn_implementation or self.family.attn_implementation
        self.num_decoder_layers: int = int(self.config.num_hidden_layers)
        self.num_layers: int = self.num_decoder_layers + 2
        self.skeleton: nn.Module = self._build_skeleton()
        check_layout(self._hf, self.family, self.num_decoder_layers)
        self._layer_types = layer_types(self.family, self.config)
        self._buffers = self.family.buffers(self.config)
        self._prefix = _PEFT_PREFIX if self.lora is not None else ""
        self._specs: list[list[ParamSpec]] = [[] for _ in range(self.num_layers)]
        self._layer_of: dict[str, int] = {}
        self._index_params()
        fmt = self.lora.quant_format() if self.lora is not None else None
        self.quantized_base: QuantizedBase | None = (
            QuantizedBase.of(self, fmt) if fmt is not None else None
        )
        """The frozen weights stored quantised (``lora.base_quantization``), or None.
        Note [quantised base] in roundpipe.shared.quantized_base."""
        self.router_aux: RouterAux | None = self._make_router_aux()
        """The load-balancing loss settings when ``config.output_router_logits`` is on.
        Note [router auxiliary loss]."""

    # ------------------------------------------------------------ constructors

    @classmethod
    def from_config(
        cls, config: Any, lora: LoraSettings | Mapping[str, Any] | None = None, **kw: Any
    ) -> LayeredModel:
        """From a transformers config object (or a plain dict with ``model_type``)."""
        if isinstance(config, Mapping):
            from transformers import AutoConfig

            d = dict(config)
            model_type = d.pop("model_type", None)
            if model_type is None:
                raise ValueError("a config dict needs 'model_type' (e.g. 'llama', 'qwen3')")
            try:
                config = AutoConfig.for_model(model_type, **d)
            except Exception as e:
                raise ValueError(f"transformers cannot build a config from {config!r}: {e}") from e
        return cls(config, lora, **kw)

    @classmethod
    def from_hf_dir(
        cls, path: str | Path, lora: LoraSettings | Mapping[str, Any] | None = None, **kw: Any
    ) -> LayeredModel:
        """From a local Hugging Face model directory (config.json + safetensors). No hub."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
        if not any(path.glob("*.safetensors")):
            raise FileNotFoundError(
                f"model directory {str(path)!r} has no *.safetensors weights "
                "(only safetensors checkpoints are supported)"
            )
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        except Exception as e:
            raise ValueError(f"cannot read the config in {str(path)!r}: {e}") from e
        return cls(config, lora, source_dir=path, **kw)

    # ------------------------------------------------------------------ checks

    def _check_config(self) -> None:
        c = self.config
        if int(getattr(c, "num_hidden_layers", 0) or 0) < 1:
            raise ValueError("config.num_hidden_layers must be >= 1")
        if getattr(c, "output_router_logits", False) and self.family.router is None:
            # HF adds a router auxiliary loss then; without a declared router the layered
            # run could not add it, and gradients would silently differ.
            raise ValueError(
                f"output_router_logits=True (router auxiliary loss) is not supported for "
                f"{self.family.architecture}; set it to False in the config"
            )

    def _build_skeleton(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(
                    self.config, attn_implementation=self.attn_implementation
                )
        except Exception as e:
            raise ValueError(
                f"transformers cannot build {self.architecture} from this config: "
                f"{type(e).__name__}: {e}"
            ) from e
        self.config = model.config
        if self.lora is not None:
            # On the meta device too: peft would otherwise initialise every adapter for
            # real (a 235B MoE's expert adapters: 40 s of kaiming_uniform_) only for the
            # skeleton's names and shapes.
            with torch.device("meta"):
                model = self._wrap_lora(model)
        # Train mode: dropout (attention, LoRA) is live; the executor seeds it per layer.
        model.train()
        return model

    def _index_params(self) -> None:
        seen: dict[int, str] = {}
        trainable_outside: list[str] = []
        for name, p in self.skeleton.named_parameters(remove_duplicate=False):
            layer = self._layer_of_hf(_strip_peft(name))
            owner = seen.get(id(p))
            if owner is None:
                seen[id(p)] = name
            trainable = bool(p.requires_grad)
            if self.lora is not None and trainable and not 1 <= layer <= self.num_layers - 2:
                trainable_outside.append(name)
            self._specs[layer].append(ParamSpec(name, tuple(p.shape), trainable, owner))
            self._layer_of[name] = layer
        if trainable_outside:
            raise ValueError(
                "LoRA adapters are supported inside decoder layers only; target_modules "
                f"{list(self.lora.target_modules)} put adapters on {trainable_outside}"
            )
        for name, _ in self.skeleton.named_buffers():
            if ".rotary_emb." not in name and _strip_peft(name) not in self._buffers:
                # The executor rebuilds the rotary tables and the family's declared
                # buffers; any other buffer would be a meta tensor at run time.
                raise ValueError(
                    f"{self.architecture} has buffer {name!r}, which its Family does not "
                    "declare (roundpipe.shared.families)"
                )

    def _layer_of_hf(self, hf_name: str) -> int:
        if hf_name.startswith("model.embed_tokens."):
            return 0
        m = _LAYER_RE.match(hf_name)
        if m is not None:
            return int(m.group(1)) + 1
        if hf_name.startswith(("model.norm.", "lm_head.")):
            return self.num_layers - 1
        raise ValueError(f"parameter {hf_name!r} belongs to no layer of {self.architecture}")

    # ----------------------------------------------------------------- queries

    def parameter_count(self, *, trainable_only: bool = False) -> int:
        """Elements of every stored parameter (tied aliases counted once, at their owner);
        ``trainable_only``: those with a master copy and optimizer state."""
        return sum(
            spec.numel
            for layer in range(self.num_layers)
            for spec in self.layer_params(layer)
            if spec.tied_to is None and (spec.trainable or not trainable_only)
        )

    def layer_params(self, layer: int) -> list[ParamSpec]:
        """Parameters of one layer in a fixed order (tied entries included, flagged)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        return list(self._specs[layer])

    def param_specs(self) -> list[ParamSpec]:
        """All parameters, layer by layer."""
        return [s for specs in self._specs for s in specs]

    def layer_of(self, name: str) -> int:
        """Layer index that lists ``name``."""
        try:
            return self._layer_of[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a parameter of this {self.architecture}") from None

    @property
    def tied_params(self) -> dict[str, str]:
        """Tied name -> owner name. Note [tied embeddings]."""
        return {s.name: s.tied_to for s in self.param_specs() if s.tied_to is not None}

    @property
    def trainable_names(self) -> list[str]:
        """Names that get gradients, tied entries excluded (their owner is listed)."""
        return [s.name for s in self.param_specs() if s.trainable and s.tied_to is None]

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def checkpoint_name(self, name: str) -> str | None:
        """Key of ``name`` in an exported checkpoint, None for tied entries.

        Full fine-tuning: the HF name. LoRA: base weights map to the HF name of the base
        model; adapters map to the key peft writes in ``adapter_model.safetensors``.
        """
        spec = next(s for s in self._specs[self.layer_of(name)] if s.name == name)
        if spec.tied_to is not None:
            return None
        if self.lora is None:
            return name
        if ".lora_" in name:
            return re.sub(r"\.lora_([AB])\.[^.]+\.", r".lora_\1.", name)
        return _without_base_layers(name)

    def read_exported(self, hf_dir: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names`` as an exported checkpoint in ``hf_dir`` holds them (under
        ``checkpoint_name``), read one at a time; names it lacks are left out."""
        reader = _SafetensorsDir(Path(hf_dir))
        out: dict[str, torch.Tensor] = {}
        for name in names:
            key = self.checkpoint_name(name)
            t = None if key is None else reader.get(key)
            if t is not None:
                out[name] = t
        return out

    # ------------------------------------------------------ skeleton accessors
    # For the executor: which module runs which layer, and the prefix that turns a full
    # parameter name into a name relative to that module.

    @property
    def _hf(self) -> nn.Module:
        return self.skeleton.base_model.model if self.lora is not None else self.skeleton

    def embed_part(self) -> tuple[nn.Module, str]:
        return self._hf.model.embed_tokens, f"{self._prefix}model.embed_tokens."

    def decoder_part(self, layer: int) -> tuple[nn.Module, str]:
        i = layer - 1
        return self._hf.model.layers[i], f"{self._prefix}model.layers.{i}."

    def norm_part(self) -> tuple[nn.Module, str]:
        return self._hf.model.norm, f"{self._prefix}model.norm."

    def layer_type(self, layer: int) -> str:
        """transformers' type of decoder ``layer`` (``full_attention``, ``sliding_attention``,
        ``linear_attention``), as the model's own forward picks its mask and rotary."""
        if not 1 <= layer <= self.num_decoder_layers:
            raise IndexError(f"layer {layer} is not a decoder layer")
        return self._layer_types[layer - 1]

    def mask_kind(self, layer: int) -> str:
        """``"full"``, ``"sliding"`` or ``"recurrent"``: the mask decoder ``layer`` takes
        (``MASK_OF_LAYER_TYPE``)."""
        return MASK_OF_LAYER_TYPE[self.layer_type(layer)]

    def part_buffers(self, layer: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        """The family's declared buffers of ``layer``'s module, by name relative to it, on
        ``device`` (the skeleton's own are meta tensors)."""
        prefix = self.part_prefix(layer)[len(self._prefix) :]
        return {
            name[len(prefix) :]: t.to(device)
            for name, t in self._buffers.items()
            if name.startswith(prefix)
        }

    def part_prefix(self, layer: int) -> str:
        """The prefix that turns a full parameter name of ``layer`` into a name relative
        to the module that runs it (``embed_part`` / ``decoder_part`` / ``norm_part``)."""
        if layer == 0:
            return self.embed_part()[1]
        if layer == self.num_layers - 1:
            return self.norm_part()[1]
        return self.decoder_part(layer)[1]

    def _make_router_aux(self) -> RouterAux | None:
        c = self.config
        if not getattr(c, "output_router_logits", False):
            return None
        assert self.family.router is not None  # _check_config
        moe_layers = tuple(
            layer
            for layer in range(1, self.num_layers - 1)
            if self.router_module(layer) is not None
        )
        num_experts = int(getattr(c, "num_experts", None) or c.num_local_experts)
        return RouterAux(
            coef=float(c.router_aux_loss_coef),
            num_experts=num_experts,
            top_k=int(c.num_experts_per_tok),
            moe_layers=moe_layers,
        )

    def router_module(self, layer: int) -> nn.Module | None:
        """Decoder ``layer``'s router (None for a dense layer or a dense family)."""
        path = self.family.router
        if path is None or not 1 <= layer <= self.num_decoder_layers:
            return None
        mod, _ = self.decoder_part(layer)
        try:
            return mod.get_submodule(path)
        except AttributeError:  # a dense layer of an MoE model (mlp_only_layers)
            return None

    @property
    def lm_head_name(self) -> str:
        return f"{self._prefix}lm_head.weight"

    @property
    def rotary_keyed_by_layer_type(self) -> bool:
        """The rotary module takes the layer type (Gemma 3: local and global tables)."""
        return self.family.rotary_keyed_by_layer_type

    def make_rotary(self, device: torch.device | str) -> nn.Module:
        """A real (non-meta) rotary embedding module like the model's, on ``device``."""
        rot_cls = type(self._hf.model.rotary_emb)
        with torch.device(device):
            return rot_cls(config=self.config)

    # ----------------------------------------------------------------- weights

    def init_weights(
        self, seed: int, dtype: torch.dtype = torch.float32
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Random weights equal to ``torch.manual_seed(seed); AutoModelForCausalLM.from_config``.

        With LoRA, peft's ``get_peft_model`` then initialises the adapters from the same
        RNG stream. The caller's RNG state is left untouched. This materialises the whole
        model once on the CPU, in fp32.
        """
        model = self._seeded_hf_model(seed)
        named = dict(model.named_parameters(remove_duplicate=False))
        return {
            layer: {s.name: named[s.name].detach().to(dtype) for s in specs if s.tied_to is None}
            for layer, specs in enumerate(self._specs)
        }

    def hf_model(self, seed: int) -> nn.Module:
        """A real (CPU, fp32) transformers model -- peft-wrapped with LoRA -- with the
        random weights ``init_weights(seed)`` gives, without a second copy of them (for
        reference loops and benchmarks)."""
        model = self._seeded_hf_model(seed)
        model.train()
        return model

    def _seeded_hf_model(self, seed: int) -> nn.Module:
        from transformers import AutoModelForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(
                self.config, attn_implementation=self.attn_implementation
            )
            if self.lora is not None:
                model = self._wrap_lora(model)
        return model

    def _wrap_lora(self, model: nn.Module) -> nn.Module:
        from peft import get_peft_model

        assert self.lora is not None
        with warnings.catch_warnings():
            # peft calls a transformers API deprecated in v5; not ours to act on.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            return get_peft_model(model, self.lora.peft_config())

    def load_weights(
        self,
        hf_dir: str | Path | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        quantize_base: bool = False,
        sink: Callable[[int, str, torch.Tensor], None] | None = None,
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Weights from a local HF directory's safetensors (``source_dir`` by default).

        Reads tensor by tensor (no whole-model copy). ``quantize_base``: a quantised
        base's weights come as their parts (``QuantizedBase.quantize_weights``), each
        quantised as it is read, so loading never holds the base in ``dtype`` (fp32: 8x
        NF4's bytes). Accepts both the per-expert MoE
        layout HF writes by default and the fused 3-D expert tensors. With LoRA the base
        weights come from the directory and the adapters are freshly initialised as peft
        does by default (A: Kaiming-uniform from a generator seeded with ``seed``, B: 0).
        A bitsandbytes checkpoint's quantised base comes as its parts, not cast to
        ``dtype`` (Note [bitsandbytes checkpoint] in roundpipe.shared.bnb_checkpoint).
        ``sink(layer, name, tensor)``: each weight (or part) is handed over as it is read
        instead of kept, and the dict comes back empty: the trainer copies it into its
        arena at once, so loading holds one weight at a time.
        """
        path = Path(hf_dir) if hf_dir is not None else self.source_dir
        if path is None:
            raise ValueError("load_weights needs hf_dir: this model was not built from a dir")
        reader = _SafetensorsDir(path)
        qb = self.quantized_base
        bnb = qb if qb is not None and qb.format.bnb else None
        gen = torch.Generator().manual_seed(seed)
        out: dict[int, dict[str, torch.Tensor]] = {}
        missing: list[str] = []

        def put(layer: int, name: str, t: torch.Tensor) -> None:
            if sink is None:
                out[layer][name] = t
            else:
                sink(layer, name, t)

        for layer, specs in enumerate(self._specs):
            out[layer] = {}
            for s in specs:
                if s.tied_to is not None:
                    continue
                if ".lora_" in s.name:
                    t = _init_lora_tensor(s, gen)
                else:
                    key = _without_base_layers(s.name)
                    if bnb is not None:  # Note [bitsandbytes checkpoint]
                        if s.name in bnb.shapes:
                            parts = read_parts(reader.raw, key, bnb.format, s.shape)
                            for p, part in parts.items():
                                put(layer, part_name(s.name, p), part)
                            continue
                        if is_quantised(reader.raw, key):
                            parts = read_parts(reader.raw, key, bnb.format, s.shape)
                            t = bnb.format.dequantize(parts, s.shape, torch.float32)
                            put(layer, s.name, t.to(dtype))
                            continue
                    t = reader.get(key)
                    if t is None and self.dequantize_mxfp4:
                        t = reader.mxfp4(key)
                    if t is None:
                        if reader.has(f"{key}_blocks"):
                            raise ValueError(
                                f"{path}: {key} is stored MXFP4-packed ({key}_blocks / "
                                "_scales); RoundPipe trains bf16 / fp32 weights: use the "
                                "bf16 checkpoint of this model (transformers writes one "
                                "after loading with Mxfp4Config(dequantize=True)), or "
                                "dequantise on load (LayeredModel dequantize_mxfp4=True, "
                                "job spec model.dequantize: true)"
                            )
                        missing.append(key)
                        continue
                    if tuple(t.shape) != s.shape:
                        raise ValueError(
                            f"{path}: {key} has shape {tuple(t.shape)}, the config implies {s.shape}"
                        )
                    if quantize_base and qb is not None and bnb is None and s.name in qb.shapes:
                        parts = qb.format.quantize(t.to(dtype))
                        for p, part in parts.items():
                            put(layer, part_name(s.name, p), part)
                        continue
                # A copy even in the same dtype: safetensors' tensor is a copy-on-write
                # view of the file's mapping, and a trained weight's master kept it (a
                # model file rewritten in place before the first step changed it, or
                # SIGBUS).
                put(layer, s.name, t.to(dtype, copy=True))
        if missing:
            raise ValueError(
                f"{path}: checkpoint lacks {len(missing)} weight(s) the config needs, e.g. {missing[:5]}"
            )
        return out

    def flat_weights(
        self, weights: Mapping[int, Mapping[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """All weights by name, tied entries resolved to their owner's tensor."""
        flat = {n: t for per_layer in weights.values() for n, t in per_layer.items()}
        for tied, owner in self.tied_params.items():
            flat[tied] = flat[owner]
        return flat

    def range_weights(
        self, weights: Mapping[int, Mapping[str, torch.Tensor]], start: int, stop: int
    ) -> dict[str, torch.Tensor]:
        """What a task over layers [start, stop) receives: its names, tied ones resolved."""
        out: dict[str, torch.Tensor] = {}
        for layer in range(start, stop):
            for s in self._specs[layer]:
                if s.tied_to is None:
                    out[s.name] = weights[layer][s.name]
                else:
                    out[s.name] = weights[self.layer_of(s.tied_to)][s.tied_to]
        return out

    def to_hf_model(self, weights: Mapping[int, Mapping[str, torch.Tensor]]) -> nn.Module:
        """A real (CPU) transformers / peft model holding copies of ``weights``.

        For tests and export; it has the dtype of the given tensors and is in train mode.
        """
        model = self._seeded_hf_model(0)
        flat = self.flat_weights(weights)
        dtype = next(iter(flat.values())).dtype
        model.to(dtype)
        missing, unexpected = model.load_state_dict(flat, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        model.train()
        return model

    def hf_model_of(self, weights: Mapping[int, Mapping[str, torch.Tensor]]) -> nn.Module:
        """A transformers / peft model whose parameters *are* ``weights``: no copy, no
        random initialisation, the process RNG untouched (``save_pretrained`` in a
        background thread must not disturb the training's RNG state). Its non-persistent
        buffers (rotary tables) stay on the meta device: for saving, not for running."""
        from transformers import AutoModelForCausalLM

        # transformers builds a model under its config's dtype by setting torch's
        # default dtype, for the whole process, for the while: a background checkpoint
        # would make the training threads' tensors bfloat16 meanwhile. dtype=None builds
        # it under the default (the parameters are meta placeholders, replaced below) on
        # a copy of the config, whose dtype comes back for the files written.
        config = copy.deepcopy(self.config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config, dtype=None, attn_implementation=self.attn_implementation
            )
            if self.lora is not None:
                model = self._wrap_lora(model)
        for sub in (model.config, *(getattr(model.config, k) for k in model.config.sub_configs)):
            if sub is not None:
                sub.dtype = self.config.dtype
        missing, unexpected = model.load_state_dict(
            self.flat_weights(weights), strict=False, assign=True
        )
        if missing or unexpected:
            raise ValueError(
                f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        return model


def _init_lora_tensor(spec: ParamSpec, gen: torch.Generator) -> torch.Tensor:
    t = torch.zeros(spec.shape)
    if ".lora_A." in spec.name:
        # peft's default init: nn.Linear's Kaiming-uniform for A (B stays zero, so the
        # adapted model starts equal to the base model).
        fan_in = spec.shape[1]
        bound = 1.0 / math.sqrt(fan_in)
        t.uniform_(-bound, bound, generator=gen)
    return t


class _SafetensorsDir:
    """Lazy tensor lookup over a directory's safetensors shards."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        if not path.is_dir():
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"model directory {str(path)!r} has no *.safetensors files")
        self._handles = [safe_open(str(path / f), framework="pt") for f in files]
        self._where: dict[str, Any] = {}
        for h in self._handles:
            for k in h.keys():
                self._where[k] = h

    def has(self, key: str) -> bool:
        return key in self._where

    def mxfp4(self, key: str) -> torch.Tensor | None:
        """``key`` dequantised from its MXFP4 ``_blocks`` / ``_scales`` (None if absent),
        by transformers' own conversion: fp4 (e2m1) pairs per byte, low nibble first,
        times 2^(scale - 127) per 32 values, transposed to the expert tensors' layout."""
        blocks, scales = self.raw(f"{key}_blocks"), self.raw(f"{key}_scales")
        if blocks is None or scales is None:
            return None
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        # Every fp4 value times a power of two is exact in bf16 (and so in fp32).
        return convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)

    def raw(self, key: str) -> torch.Tensor | None:
        h = self._where.get(key)
        return None if h is None else h.get_tensor(key)

    def get(self, key: str) -> torch.Tensor | None:
        t = self.raw(key)
        if t is not None:
            return t
        m = _FUSED_EXPERTS_RE.match(key)
        if m is None:
            return None
        base, which = m.groups()
        experts = sorted(
            int(k[len(base) + 1 :].split(".", 1)[0])
            for k in self._where
            if k.startswith(base + ".") and k.endswith(".down_proj.weight")
        )
        if not experts or experts != list(range(len(experts))):
            return None
        parts: list[torch.Tensor] = []
        for e in experts:
            if which == "down_proj":
                t = self.raw(f"{base}.{e}.down_proj.weight")
            else:
                gate = self.raw(f"{base}.{e}.gate_proj.weight")
                up = self.raw(f"{base}.{e}.up_proj.weight")
                t = None if gate is None or up is None else torch.cat([gate, up], dim=0)
            if t is None:
                return None
            parts.append(t)
        return torch.stack(parts)


def without_mxfp4(config: Any) -> Any:
    """A copy of ``config`` without an MXFP4 ``quantization_config`` (what a model
    dequantised on load is); any other quantisation method is refused."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return config
    method = quant.get("quant_method") if isinstance(quant, dict) else quant.quant_method
    if str(method).lower() != "mxfp4":
        raise ValueError(
            f"cannot dequantise quantization_config.quant_method={method!r}: only MXFP4 "
            "(GPT-OSS's packed experts) is dequantised on load"
        )
    out = copy.deepcopy(config)
    del out.quantization_config
    return out


def model_config_dict(config: Any) -> dict:
    """A transformers config as a plain, msgpack-able dict (what JobSetup carries)."""
    return json.loads(config.to_json_string(use_diff=False))
