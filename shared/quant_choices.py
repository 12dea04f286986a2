"""The names a job spec may give a LoRA base's quantisation, without torch.

The client and the CLI check a spec before sending it; importing torch for two tuples
of names would cost them seconds per command. quant_format.py, the format itself,
takes its names from here.
"""

from __future__ import annotations

__all__ = ["INT8_SCALES", "QUANTIZATIONS"]

QUANTIZATIONS = ("none", "nf4", "int8")
"""``lora.base_quantization``'s values."""
INT8_SCALES = ("per_channel", "per_block")
"""``lora.int8_scales``'s values."""
