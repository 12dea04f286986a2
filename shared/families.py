"""Which Hugging Face causal-LM families RoundPipe runs, and what each needs declared.

Every supported family has the standard decoder-only layout transformers uses::

    model.embed_tokens          prefix (our layer 0)
    model.layers[i]             decoder layer i (our layer i + 1)
    model.norm, lm_head         tail (our last layer; the loss is ours)
    model.rotary_emb            rotary tables, rebuilt on each worker

and a model ``forward`` that does nothing between those modules but build masks and
rotary tables. What differs between families is small and is declared in a ``Family``:
which mask each decoder layer attends with, whether the rotary module is keyed by layer
type, buffers outside the rotary module (Gemma 3's embedding scale) and settings the
layered run cannot reproduce (refused, with the setting named).

A ``Family`` is *declared*, never guessed: two models with identical module trees can
still differ in their ``forward`` (Granite scales embeddings and logits there, Gemma 2
soft-caps logits), and running such a model through the generic layering would train it
silently wrong. ``check_layout`` names what a model without the standard layout lacks;
``register_family`` adds a family once an oracle test (tests/test_model_oracle.py) shows
its layered run equals the whole transformers model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where needed: job specs read this module cheaply
    import torch
    from torch import nn

__all__ = [
    "FAMILIES",
    "Family",
    "MASK_OF_LAYER_TYPE",
    "check_layout",
    "family_for",
    "register_family",
    "supported_architectures",
]

MASK_OF_LAYER_TYPE: dict[str, str] = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "linear_attention": "recurrent",
}
"""transformers' ``config.layer_types`` entry -> the mask a layer of that type takes:
``full`` (causal), ``sliding`` (causal within ``sliding_window``), ``recurrent`` (the
padding mask of linear-attention / state-space layers, None for unpadded rows)."""


def _no_refusals(config: Any) -> list[str]:
    return []


def _no_buffers(config: Any) -> dict[str, torch.Tensor]:
    return {}


@dataclass(frozen=True, kw_only=True)
class Family:
    """The declared differences of one causal-LM family from the standard layout."""

    model_type: str
    """``config.model_type`` of the text-only causal LM (e.g. ``gemma3_text``)."""
    architecture: str
    """The transformers class ``AutoModelForCausalLM`` builds (``Gemma3ForCausalLM``)."""
    window_applies_to_all_layers: bool = False
    """No ``config.layer_types``: every layer is sliding-window when
    ``config.sliding_window`` is set (Mistral, Qwen3-MoE), else full attention."""
    rotary_keyed_by_layer_type: bool = False
    """``rotary_emb(x, position_ids, layer_type)`` gives per-type tables (Gemma 3: local
    and global RoPE bases)."""
    buffers: Callable[[Any], dict[str, torch.Tensor]] = _no_buffers
    """Non-rotary buffers by HF name (``model.embed_tokens.embed_scale``), rebuilt from the
    config: the skeleton lives on the meta device, so their values must come from here."""
    refusals: Callable[[Any], list[str]] = _no_refusals
    """Settings of this family the layered run does not reproduce, each as a message."""
    attn_implementation: str = "sdpa"
    """transformers attention implementation used unless the caller picks one (``eager``
    where transformers has no SDPA path for the family)."""
    moe: bool = False
    """Has routed experts (``mlp.experts``), run through transformers' grouped path."""
    router: str | None = None
    """Path of the router inside a decoder layer (its output[0] are the router logits
    transformers' load-balancing loss reads), for ``output_router_logits``."""
    notes: str = ""
    """One line for docs and ``roundpipe plan``: what is special about the family."""
    extra_model_types: tuple[str, ...] = field(default=())
    """Other ``model_type`` spellings of the same causal LM."""


def _gemma3_buffers(config: Any) -> dict[str, torch.Tensor]:
    # Gemma3TextScaledWordEmbedding multiplies by sqrt(hidden) held in a non-persistent
    # fp32 buffer (cast to the weight dtype at use, as HF does: 55.4256 becomes 55.5 in bf16).
    import torch

    return {"model.embed_tokens.embed_scale": torch.tensor(float(config.hidden_size) ** 0.5)}


def _gemma3_refusals(config: Any) -> list[str]:
    out = []
    if getattr(config, "use_bidirectional_attention", False):
        out.append(
            "use_bidirectional_attention=True (an encoder-style mask overlay) is not "
            "supported: set it to False"
        )
    return out


def _gpt_oss_refusals(config: Any) -> list[str]:
    quant = getattr(config, "quantization_config", None)
    method = (
        quant.get("quant_method")
        if isinstance(quant, dict)
        else getattr(quant, "quant_method", None)
    )
    if method is None:
        return []
    return [
        f"the checkpoint's experts are {str(method).upper()}-packed (quantization_config."
        f"quant_method={method!r}); RoundPipe trains bf16 / fp32 weights: use a bf16 "
        "checkpoint of the model (the layout transformers saves after "
        "`from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))` and "
        "`save_pretrained`), or dequantise on load: job spec model.dequantize: true "
        "(`roundpipe plan --dequantize`; LayeredModel dequantize_mxfp4=True)"
    ]


FAMILIES: dict[str, Family] = {}
"""model_type -> Family, for every declared family."""


def register_family(family: Family) -> Family:
    """Declare a family (see the module docstring for what that promises)."""
    for model_type in (family.model_type, *family.extra_model_types):
        FAMILIES[model_type] = family
    return family


for _family in (
    Family(model_type="llama", architecture="LlamaForCausalLM"),
    Family(model_type="qwen3", architecture="Qwen3ForCausalLM", notes="per-layer sliding window"),
    Family(
        model_type="qwen3_moe",
        architecture="Qwen3MoeForCausalLM",
        window_applies_to_all_layers=True,
        moe=True,
        router="mlp.gate",
        notes="routed experts, top-k",
    ),
    Family(
        model_type="mistral",
        architecture="MistralForCausalLM",
        window_applies_to_all_layers=True,
        notes="sliding window on every layer when set",
    ),
    Family(
        model_type="gemma3_text",
        architecture="Gemma3ForCausalLM",
        rotary_keyed_by_layer_type=True,
        buffers=_gemma3_buffers,
        refusals=_gemma3_refusals,
        notes="embedding scaled by sqrt(hidden), (1 + w) RMSNorm, local/global RoPE, "
        "5:1 sliding/full layers",
    ),
    Family(
        model_type="qwen3_5_text",
        architecture="Qwen3_5ForCausalLM",
        notes="hybrid Gated DeltaNet (linear) / full attention layers",
    ),
    Family(
        model_type="qwen3_5_moe_text",
        architecture="Qwen3_5MoeForCausalLM",
        moe=True,
        router="mlp.gate",
        notes="hybrid linear / full attention, routed + shared experts",
    ),
    Family(
        model_type="gpt_oss",
        architecture="GptOssForCausalLM",
        refusals=_gpt_oss_refusals,
        # Sinks join the softmax: transformers has eager and flash-attention-3 kernels for
        # them, no SDPA.
        attn_implementation="eager",
        moe=True,
        router="mlp.router",
        notes="attention sinks, alternating sliding / full layers, experts with biases",
    ),
):
    register_family(_family)

# Multimodal wrappers whose text model we do support: the message points at the latter.
_TEXT_MODEL_OF = {
    "gemma3": "gemma3_text",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(dict.fromkeys(f.architecture for f in FAMILIES.values()))


def family_for(config: Any) -> Family:
    """The declared family of ``config``, or ValueError naming what is unsupported."""
    model_type = getattr(config, "model_type", None) or ""
    family = FAMILIES.get(model_type)
    if family is None:
        text = _TEXT_MODEL_OF.get(model_type)
        if text is not None:
            raise ValueError(
                f"model type {model_type!r} is the multimodal model (vision tower + text "
                f"model); RoundPipe fine-tunes the text causal LM: use its text_config "
                f"(model_type {text!r}, {FAMILIES[text].architecture})"
            )
        raise ValueError(
            f"unsupported model type {model_type!r}: supported architectures are "
            f"{', '.join(supported_architectures())}. A decoder-only causal LM with the "
            "standard layout needs a declared Family (roundpipe.shared.families."
            "register_family) proven by the oracle tests"
        )
    declared = list(getattr(config, "architectures", None) or [])
    if declared and family.architecture not in declared:
        raise ValueError(
            f"unsupported architecture {declared}: only causal LMs "
            f"{', '.join(supported_architectures())} are supported"
        )
    problems = family.refusals(config)
    if getattr(config, "final_logit_softcapping", None) is not None:
        problems.append(
            "final_logit_softcapping is set: the chunked LM-head loss computes plain "
            "logits; set it to null"
        )
    if problems:
        raise ValueError(f"{family.architecture}: " + "; ".join(problems))
    return family


def layer_types(family: Family, config: Any) -> list[str]:
    """transformers' layer type of every decoder layer (``full_attention``, ...)."""
    n = int(config.num_hidden_layers)
    if family.window_applies_to_all_layers:
        sliding = getattr(config, "sliding_window", None) is not None
        return ["sliding_attention" if sliding else "full_attention"] * n
    types = getattr(config, "layer_types", None)
    if types is None:
        return ["full_attention"] * n
    types = list(types)[:n]
    unknown = sorted(set(types) - set(MASK_OF_LAYER_TYPE))
    if unknown or len(types) != n:
        raise ValueError(
            f"{family.architecture}: config.layer_types {types} has "
            + (
                f"layer types {unknown} with no known mask"
                if unknown
                else f"fewer than {n} entries"
            )
            + f" (known: {', '.join(MASK_OF_LAYER_TYPE)})"
        )
    return types


_STANDARD_MODULES = (
    "model.embed_tokens",
    "model.layers",
    "model.norm",
    "model.rotary_emb",
    "lm_head",
)


def check_layout(hf_model: nn.Module, family: Family, num_layers: int) -> None:
    """Refuse a model without the standard decoder layout, naming what it lacks."""
    from torch import nn

    missing = []
    for path in _STANDARD_MODULES:
        mod: Any = hf_model
        for part in path.split("."):
            mod = getattr(mod, part, None)
            if mod is None:
                break
        if mod is None:
            missing.append(path)
    if missing:
        raise ValueError(
            f"{family.architecture} lacks {', '.join(missing)}: RoundPipe layers a causal LM "
            f"with the standard layout ({', '.join(_STANDARD_MODULES)})"
        )
    layers = hf_model.model.layers
    if not isinstance(layers, nn.ModuleList) or len(layers) != num_layers:
        raise ValueError(
            f"{family.architecture}: model.layers is not a list of num_hidden_layers="
            f"{num_layers} decoder layers"
        )
