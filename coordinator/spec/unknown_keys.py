"""Keys a job spec does not know: each is reported with a hint at the field it means.

Spelling similarity finds ``learnig_rate``; a table of the names users of the Hugging
Face Trainer, peft, TRL and LLaMA-Factory reach for finds ``learning_rate`` ->
``optimizer.lr``, across sections too.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from roundpipe.coordinator.spec.errors import Problems

__all__ = ["check_keys"]


def check_keys(errors: Problems, path: str, raw: Mapping[str, Any], allowed: list[str]) -> None:
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
    "warmup_steps": ("optimizer.warmup_steps", ""),
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
    "packing": ("data.packing", ""),
    "packing_strategy": (
        "data.packing",
        "documents, for bfd and for wrapped (text is cut anywhere there too)",
    ),
    "train_file": ("data.path", ""),
    "dataset": ("data.path", "a local file"),
    "dataset_name": ("data.path", "a local file or folder; nothing is downloaded"),
    "train_on_prompt": ("data.loss_on", "assistant (false) or all (true)"),
    "neat_packing": ("data.packing", "documents: packed rows, no cross-document attention"),
    "template": ("data.chat_template", "a Jinja template file"),
    "min_lr_rate": ("optimizer.min_lr_ratio", ""),
    # LoRA (peft LoraConfig, LLaMA-Factory)
    "lora_r": ("lora.r", ""),
    "r": ("lora.r", ""),
    "lora_rank": ("lora.r", ""),
    "rank": ("lora.r", ""),
    "lora_alpha": ("lora.alpha", ""),
    "lora_dropout": ("lora.dropout", ""),
    "lora_target": ("lora.target_modules", ""),
    "target_modules": ("lora.target_modules", ""),
    # A quantised base (transformers' BitsAndBytesConfig, QLoRA scripts): LoRA only.
    "load_in_4bit": ("lora.base_quantization", "nf4 (a quantised base trains only with LoRA)"),
    "load_in_8bit": ("lora.base_quantization", "int8 (a quantised base trains only with LoRA)"),
    "bnb_4bit_quant_type": ("lora.base_quantization", "nf4"),
    "bnb_4bit_use_double_quant": ("lora.double_quantization", ""),
    "quantization": ("lora.base_quantization", "nf4 or int8 (LoRA only)"),
    "base_quantization": ("lora.base_quantization", "nf4 or int8 (LoRA only)"),
}
