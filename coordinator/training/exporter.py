"""A job's model in Hugging Face layout: the final export, and the model files of
every checkpoint (docs/checkpoints.md).

``write_hf_model`` writes ``save_pretrained`` of the transformers model, or for LoRA a
PEFT adapter directory whose base is the job's model directory or, for a randomly
initialised base, ``<output>/base_model`` (written once per run); plus the tokenizer.
``export`` writes the final model into the output directory through its pin
(roundpipe.coordinator.training.job_output)."""

from __future__ import annotations

import functools
import logging
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from roundpipe.coordinator.spec.jobspec import JobSpec
from roundpipe.coordinator.spec.paths import modes, restrict_tree
from roundpipe.coordinator.training.checkpoint import (
    as_os_error,
    fsync_dir,
    remove_stale_temporaries,
    sync_files,
)
from roundpipe.coordinator.training.job_errors import JobPaused
from roundpipe.coordinator.training.job_output import JobOutput
from roundpipe.coordinator.training.layout import JobLayout
from roundpipe.shared.model import LayeredModel
from roundpipe.shared.quantized_base import PART_SEP

if TYPE_CHECKING:
    from transformers import GenerationConfig

__all__ = ["ModelExporter"]

log = logging.getLogger(__name__)

_FULL_MODEL_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
)
"""What ``save_pretrained`` writes for a full model (beside its shards, model-*-of-*)."""
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
"""What peft's ``save_pretrained`` writes for an adapter."""
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)
"""What a tokenizer's ``save_pretrained`` writes, for the tokenizers transformers has."""


class ModelExporter:
    """Writes one prepared job's model: trainable weights from ``masters`` (fp32),
    frozen ones from the params arena of ``layout``."""

    def __init__(
        self,
        spec: JobSpec,
        model: LayeredModel,
        layout: JobLayout,
        masters: Mapping[int, Mapping[str, torch.Tensor]],
        output: JobOutput,
    ):
        self.spec = spec
        self.model = model
        self.layout = layout
        self.masters = masters
        self.output = output
        self._base_model_written = False

    def final_weights(self) -> dict[int, dict[str, torch.Tensor]]:
        """fp32 masters for trainable weights, params-arena copies for frozen ones."""
        weights = self.weights_with(self.masters)
        return {layer: {n: t.clone() for n, t in per.items()} for layer, per in weights.items()}

    def base_model_dir(self) -> Path:
        """The base model a LoRA adapter names: the job's local model directory, or for
        a randomly initialised base, ``<output>/base_model``."""
        if self.spec.model.path is not None:
            return Path(self.spec.model.path).resolve()
        return (self.output.output_dir / "base_model").resolve()

    def weights_with(
        self, masters: Mapping[int, Mapping[str, torch.Tensor]], *, placeholders: bool = False
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Every layer's weights: ``masters`` for trainable ones (no copy), the params
        arena's for frozen ones (they never change), or with ``placeholders`` tensors of
        their shapes on the meta device (no data, nothing dequantised)."""
        qb = self.model.quantized_base
        out: dict[int, dict[str, torch.Tensor]] = {}
        for layer, names in self.layout.params.items():
            out[layer] = {}
            for name, (even, _odd) in names.items():
                if name in self.masters.get(layer, {}):
                    out[layer][name] = masters[layer][name]
                elif placeholders:  # a quantised weight's parts: the weight's shape, once
                    weight = name.split(PART_SEP)[0]
                    shape = qb.shapes[weight] if weight != name else self.layout.view(even).shape
                    out[layer][weight] = torch.empty(shape, dtype=torch.float32, device="meta")
                elif PART_SEP in name:  # a part of a quantised weight, as stored
                    out[layer][name] = self.layout.view(even)
                else:
                    out[layer][name] = self.layout.view(even).to(torch.float32)
        if qb is not None and not placeholders:
            # The parts back into weights, what the workers computed with: an exported
            # base model is the dequantised one (Note [quantised base]).
            qb.dequantize_weights(out, torch.float32)
        return out

    def adapter_only(self) -> bool:
        """Whether the model files are a LoRA adapter alone: its base is on disk already
        (``model.path``, or ``<output>/base_model`` written this run)."""
        return self.model.lora is not None and (
            self.spec.model.path is not None or self._base_model_written
        )

    def file_weights(
        self, masters: Mapping[int, Mapping[str, torch.Tensor]]
    ) -> dict[int, dict[str, torch.Tensor]]:
        """The weights ``write_hf_model`` needs: every one, or when only the adapter is
        written (``adapter_only``) placeholders for the frozen base: peft writes the
        adapters alone, and dequantising a quantised base to fp32 for each checkpoint
        cost 8x its arena."""
        return self.weights_with(masters, placeholders=self.adapter_only())

    def write_hf_model(
        self, directory: Path, weights: Mapping[int, Mapping[str, torch.Tensor]] | None = None
    ) -> None:
        """Write the current model in Hugging Face layout into ``directory`` (shared by
        ``export`` and checkpoints): ``save_pretrained`` of the transformers model
        (safetensors + config), or for LoRA a PEFT adapter directory whose
        ``base_model_name_or_path`` is ``base_model_dir()``, so that
        ``AutoPeftModelForCausalLM.from_pretrained`` works offline; plus the tokenizer.
        A randomly initialised base is written once per run, atomically, to
        ``<output>/base_model`` (it never changes: only adapters train). ``weights``:
        the weights to write (default: the current ones, ``file_weights``)."""
        from transformers.utils import logging as hf_logging

        if weights is None:
            # The masters themselves, not copies (final_weights): the export comes after
            # the last update, and a copy was one more fp32 model while all the training
            # state is still held.
            weights = self.file_weights(self.masters)
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            if self.model.lora is not None:
                base_dir = self.base_model_dir()
                if self.spec.model.path is None and not self._base_model_written:
                    # First, so that peft finds the base's config when saving the adapter.
                    base = self.model.hf_model_of(weights).unload()
                    self._write_base_model(base, self.output.root / base_dir.name)
                model = self.model.hf_model_of(weights)
                for config in model.peft_config.values():
                    config.base_model_name_or_path = str(base_dir)
                model.save_pretrained(str(directory))
            else:
                model = self.model.hf_model_of(weights)
                generation = self._generation
                if generation is not None:
                    model.generation_config = generation
                model.save_pretrained(str(directory))
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        tokenizer_dir = self.spec.tokenizer_path
        if tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
            from roundpipe.coordinator.spec.tokenizers import load_tokenizer

            tokenizer = load_tokenizer(tokenizer_dir)
            if self.spec.data.chat_template is not None:
                # The exported model chats with the template it was trained on.
                from roundpipe.coordinator.spec.instruct import load_chat_template

                load_chat_template(tokenizer, self.spec.data.chat_template)
            tokenizer.save_pretrained(str(directory))
        restrict_tree(directory)  # whatever the umask: full weights are private

    @functools.cached_property
    def _generation(self) -> GenerationConfig | None:
        """The generation settings of the model trained from (``model.path``), which a
        full model's files carry on: its stop tokens (an instruct model lists several)
        and sampling defaults. A model built from its config alone derived them from
        ``config.json``, one EOS id and no sampling settings, so an exported model
        generated past its turn's end. None: no such file, or one transformers cannot
        read (then the derived settings are written, as before)."""
        path = self.spec.model.path
        if path is None or not (Path(path) / "generation_config.json").is_file():
            return None
        from transformers import GenerationConfig

        try:
            return GenerationConfig.from_pretrained(path)
        except (OSError, ValueError) as exc:
            log.warning(
                "[trainer] cannot read %s/generation_config.json (%s); the model's "
                "files carry the settings its config implies",
                path,
                exc,
            )
            return None

    def _write_base_model(self, base_model, base_dir: Path) -> None:
        remove_stale_temporaries(base_dir.parent)  # a copy left by a writer killed mid-way
        tmp = base_dir.parent / f".tmp-{base_dir.name}-{os.getpid()}-{secrets.token_hex(4)}"
        trash = base_dir.parent / f".trash-{base_dir.name}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            base_model.save_pretrained(str(tmp))
            restrict_tree(tmp)
            for file in tmp.iterdir():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
            if base_dir.exists():
                os.rename(base_dir, trash)
            os.rename(tmp, base_dir)
            fsync_dir(base_dir.parent)  # the renames
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if trash.is_dir() and not trash.is_symlink():
                shutil.rmtree(trash, ignore_errors=True)
            else:  # what stood in its place was a file or a link
                trash.unlink(missing_ok=True)
        self._base_model_written = True

    def export(self, directory: Path | None = None) -> Path:
        """Write the final model in Hugging Face layout (``write_hf_model``) into
        ``directory`` (default: the output directory). Raises JobPaused if it cannot be
        written (the final checkpoint holds the same model)."""
        output_dir = self.output.output_dir
        directory = output_dir if directory is None else Path(directory)
        what = f"cannot write the final model to {directory}"
        # Written in place: a new try overwrites (Note [out of descriptors]).
        return self.output.retry_short_of_descriptors(
            what, lambda: self._export_pinned(what, output_dir, directory)
        )

    def _remove_an_earlier_model(self, target: Path) -> None:
        """Remove from ``target`` the model files an earlier job's export left there,
        whatever its kind, before this one is written (``save_pretrained`` overwrites
        only the files it writes):

        * a LoRA job's ``adapter_config.json`` beside a later full fine-tune's weights
          made ``from_pretrained`` load the old base and adapter (peft installed), and a
          full model's weights beside a later adapter were read by tools that take
          ``model.safetensors``;
        * a sharded model's ``model.safetensors.index.json`` beside a later single file
          named shards that were gone (transformers deletes old shards, not the index),
          and this runtime reads a model directory's index first: ``model.path: <output>``
          failed;
        * an earlier job's tokenizer files (its chat template) stayed beside a model
          trained with another tokenizer, or with none.

        Only the files those writers write go, from ``target`` itself; validation keeps
        ``output.dir`` off ``model.path``. What this job reads stays: its tokenizer, where
        ``target`` is the tokenizer's directory (re-saved over itself), and its data and
        chat template files. (A ``base_model`` folder stays too: it may be the model this
        job trained from.)"""
        names = [*_FULL_MODEL_FILES, *_ADAPTER_FILES]
        names += [p.name for p in target.glob("model-*-of-*.safetensors")]
        tokenizer_dir = self.spec.tokenizer_path
        if tokenizer_dir is None or os.path.realpath(tokenizer_dir) != os.path.realpath(target):
            names += _TOKENIZER_FILES
        inputs = {self.spec.data.path, self.spec.data.chat_template} - {None}
        read = {os.path.realpath(p) for p in inputs}
        for name in names:
            if os.path.realpath(target / name) not in read:
                (target / name).unlink(missing_ok=True)

    def _export_pinned(self, what: str, output_dir: Path, directory: Path) -> Path:
        """One try of ``export``."""
        with self.output.pinned(what) as output:
            target = output if directory == output_dir else directory
            try:
                target.mkdir(mode=modes().dir, parents=True, exist_ok=True)
                self._remove_an_earlier_model(target)
                self.write_hf_model(target)
                # On disk before the job is recorded as succeeded: save_pretrained
                # writes in place and syncs nothing.
                sync_files(target)
            except Exception as exc:
                os_error = as_os_error(exc, target)
                if os_error is None:
                    raise
                # Chained to the OSError, not the library's error that carried it: the
                # retry (Note [out of descriptors]) reads the errno from the chain.
                raise JobPaused(self.output.io_error_message(what, os_error)) from os_error
        return directory
