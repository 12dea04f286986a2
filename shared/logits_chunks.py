"""How many tokens of logits the chunked LM head holds at once (Note [chunked LM head]):
shared by the worker, which chunks so, and the planner, which prices that memory
(roundpipe.coordinator.planning.costs). A GPU and a CPU chunk differently, so the two
must agree on which rule a job's workers follow."""

from __future__ import annotations

__all__ = ["CPU_LOGITS_CHUNK_BYTES", "GPU_LOGITS_CHUNK_TOKENS", "logits_chunk_tokens"]

CPU_LOGITS_CHUNK_BYTES = 128 * 1024 * 1024
"""CPU: fp32 bytes of one chunk of logits, about 1000 tokens at a 32k vocabulary (a CPU
runs a chunk no faster for being larger, and host memory is shared with everything)."""

GPU_LOGITS_CHUNK_TOKENS = 4096
"""GPU: tokens per chunk of logits, as the paper's library (2.5 GB of fp32 logits at a
151,936 vocabulary): large enough that the head's matmuls run near peak."""


def logits_chunk_tokens(
    vocab_size: int, *, on_gpu: bool, cpu_chunk_bytes: int = CPU_LOGITS_CHUNK_BYTES
) -> int:
    """Tokens per chunk of logits for a worker on a GPU or on the CPU (whose chunk is
    ``cpu_chunk_bytes`` of fp32 logits)."""
    if on_gpu:
        return GPU_LOGITS_CHUNK_TOKENS
    return max(1, cpu_chunk_bytes // (4 * vocab_size))
