"""Layer-wise CPU AdamW over fp32 master weights, and the learning-rate schedule.

The coordinator updates each layer as soon as that layer's gradient of step k is
complete (``wgrad[l] >= k``), last layers first, while other layers' backward tasks are
still running; see Note [weight-update ordering] (roundpipe.coordinator.training.schedule). So the
optimizer is not one object over the whole model but one ``torch.optim.AdamW`` per
layer, driven by ``LayerwiseOptimizer.step_layer(layer, grads, step)``. This module keeps
no counters: ``step_layer`` returns after the masters, the moments and the ``out``
copy (params[k % 2]) are fully written, and only then may the caller publish
``version[l] = k`` (and free the grads slot for the next iteration).

Exactness. AdamW is elementwise per parameter tensor, so splitting the parameters into
per-layer optimizers changes no arithmetic: with the same ``impl`` (below) the masters
are bitwise equal to one ``torch.optim.AdamW`` over the whole model fed the same
gradients and learning rates. Weight decay is decoupled (``p *= 1 - lr * wd``) and
applies to every trainable tensor except those ``no_decay`` exempts (by default in the
job spec: biases and norm weights, as the Hugging Face Trainer), exactly as a
``torch.optim.AdamW`` with those two parameter groups.

Global-norm clipping is the one step that is not per layer: the norm covers every
gradient of the step, so with ``grad_clip`` set the coordinator must wait for the whole
step's gradients, compute ``clip_coefficient(global_grad_norm(...), grad_clip)``, and
pass that coefficient to every ``step_layer`` call of the step. This gives up the
overlap of the optimizer with the same step's backward (with staleness 1 it still
overlaps the next iteration). The result matches ``torch.nn.utils.clip_grad_norm_``
followed by AdamW to within float rounding of the norm (1e-6 relative).

``impl`` picks the AdamW kernel:

* ``"fused"`` (default): the arithmetic of torch's fused CPU AdamW kernel (what
  ``torch.optim.AdamW(fused=True)`` runs), bitwise equal to it: on the compiled one-pass
  kernel (``kernel`` below), or torch's own kernel called on cache-sized chunks by a
  team of ``threads`` threads, with the compute-dtype cast done per chunk right after
  (Note [chunked fused AdamW]).
* ``"foreach"``: torch's multi-tensor implementation (several passes over memory).
* ``"for-loop"``: the single-tensor reference; what ``torch.optim.AdamW`` uses on CPU
  when neither ``fused`` nor ``foreach`` is given.
The three agree to rounding but not bitwise, so compare against a reference built with
the same choice.

``kernel`` (fused AdamW with float32 states only): ``"auto"`` (default) runs the compiled
one-pass kernel of roundpipe.coordinator.training.adamw_kernel, bitwise the same as
``"fused"`` above but one pass over memory for the update and the bf16 cast (Note
[compiled AdamW kernel]); if it cannot be loaded or its bitwise self-check fails, one log
line says so and torch's kernel runs instead. ``"torch"``: always torch's kernel.

Memory. Masters (and, optionally, the moments) are given by the caller: they may be
views into the shared-memory arenas and are updated in place. Moments not given are
allocated once, at construction; nothing is allocated per step except for gradients
whose dtype is not float32, which go through a per-tensor scratch buffer allocated on
first use.

Threads. ``step_layers`` steps a group of ready layers in one multi-threaded pass, lowest
layer first, reporting each layer as soon as it is written. The optimizer is driven from
one thread (the trainer's optimizer thread), whose intra-op team does the parallel work.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from roundpipe.coordinator.spec.choices import (
    HF_NO_DECAY,
    OPTIMIZER_KERNELS,
    SCHEDULE_CONVENTIONS,
    STATE_DTYPES,
)
from roundpipe.coordinator.training import adamw_kernel
from roundpipe.coordinator.training.quantized_state import (
    BLOCK,
    SIGNED_MAP,
    UNSIGNED_MAP,
    absmax_numel,
    dequantize_,
    quantize_,
)

if TYPE_CHECKING:
    from roundpipe.coordinator.spec.jobspec import JobSpec
    from roundpipe.coordinator.spec.sections import OptimizerSpec

__all__ = [
    "HF_NO_DECAY",
    "IMPLS",
    "SCHEDULE_CONVENTIONS",
    "STATE_DTYPES",
    "LRSchedule",
    "ALGORITHMS",
    "CHUNK_NUMEL",
    "OPTIMIZER_KERNELS",
    "LayerwiseOptimizer",
    "OptimizerStepError",
    "clip_coefficient",
    "decays",
    "default_threads",
    "global_grad_norm",
]

IMPLS = ("fused", "foreach", "for-loop")
INT8_KINDS = ("exp_avg", "exp_avg_absmax", "exp_avg_sqrt", "exp_avg_sqrt_absmax")
"""The 8-bit state: the first moment's codes and scales, and the second moment's square
root's (Note [8-bit second moment])."""
"""State tensors per parameter with ``state_dtype="int8"`` (Note [8-bit states])."""
ALGORITHMS = ("adamw", "sgd")
_STATE_VERSION = 1

log = logging.getLogger(__name__)


class OptimizerStepError(RuntimeError):
    """A layer was stepped out of order, twice, or with gradients that do not match."""


# --------------------------------------------------------------------------- schedule


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """Learning rate as a pure function of the optimizer step.

    Optimizer steps count from 1: step 1 is the first optimizer step (the first gradient
    applied). The schedule itself is a factor ``f(c)`` of a schedule position ``c``, with
    *W* = ``warmup_steps``, *T* = ``total_steps``, *m* = ``min_lr_ratio``:

    * warmup (any schedule, if ``W > 0``): ``f(c) = c / W`` for ``c < W``, rising
      linearly from 0;
    * then ``constant``: 1;
    * ``linear``: ``m + (1 - m) * (T - c) / (T - W)``; ``cosine``:
      ``m + (1 - m) * (1 + cos(pi * p)) / 2`` with ``p = (c - W) / (T - W)``; positions
      beyond *T* stay at the minimum ``m``.

    These are transformers' ``get_{constant,linear,cosine}_schedule_with_warmup`` (and
    ``get_cosine_with_min_lr_schedule_with_warmup``) factors, computed in the same
    order. ``convention`` says which position step *s* uses:

    * ``"hf"`` (default): ``c = s - 1``, as the Hugging Face Trainer, which calls
      ``scheduler.step()`` after each optimizer step: with warmup, step 1 has lr 0 and
      step ``W + 1`` the peak; linear/cosine have not quite reached the minimum at the
      last step. Learning rates equal the Trainer's step for step.
    * ``"one_based"``: ``c = s``: step 1 already has ``lr / W``, step *W* the peak, and
      linear/cosine reach ``m * lr`` exactly at the last step.
    """

    lr: float
    """Peak learning rate."""
    schedule: str = "constant"
    """``"constant"``, ``"linear"`` or ``"cosine"``."""
    warmup_steps: int = 0
    """Steps of linear warmup (0: none)."""
    total_steps: int = 1
    """Schedule length *T*: where linear/cosine reach their minimum (``train.steps``)."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of ``lr``."""
    convention: str = "hf"
    """Which schedule position an optimizer step uses: one of ``SCHEDULE_CONVENTIONS``."""

    def __post_init__(self) -> None:
        # Internal API: the job spec has already told the user about bad values.
        if self.schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown schedule {self.schedule!r}")
        if self.convention not in SCHEDULE_CONVENTIONS:
            raise ValueError(
                f"unknown schedule convention {self.convention!r}; expected one of "
                f"{', '.join(SCHEDULE_CONVENTIONS)}"
            )
        if not (self.lr > 0 and self.warmup_steps >= 0 and self.total_steps >= 1):
            raise ValueError(f"bad schedule parameters: {self}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    @classmethod
    def from_spec(cls, optimizer: OptimizerSpec, total_steps: int) -> LRSchedule:
        return cls(
            lr=float(optimizer.lr),
            schedule=optimizer.schedule,
            warmup_steps=optimizer.warmup_steps,
            total_steps=total_steps,
            min_lr_ratio=float(optimizer.min_lr_ratio),
            convention=optimizer.schedule_convention,
        )

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (>= 1)."""
        if step < 1:
            raise ValueError(f"optimizer steps count from 1, got {step}")
        if self.convention == "hf":
            return self.lr * self.factor(step - 1)
        if step <= self.warmup_steps:
            # Warmup ends at step W itself, also when W == total_steps.
            return self.lr * (float(step) / float(self.warmup_steps))
        return self.lr * self.factor(step)

    def factor(self, position: int) -> float:
        """The schedule's multiplier of ``lr`` at schedule position ``position`` (>= 0)."""
        w, t, m = self.warmup_steps, self.total_steps, self.min_lr_ratio
        if position < w:
            return float(position) / float(w)
        if self.schedule == "constant":
            return 1.0
        span = max(1, t - w)
        if self.schedule == "linear":
            decay = max(0.0, float(t - position) / float(span))
        else:
            progress = min(1.0, float(position - w) / float(span))
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        # transformers' order of operations (factor * (1 - rate) + rate), so that with
        # the hf convention the learning rates are bitwise the Trainer's.
        return decay * (1 - m) + m


# --------------------------------------------------------------------------- weight decay


def decays(name: str, no_decay: Iterable[str | re.Pattern[str]]) -> bool:
    """Whether the tensor ``name`` gets weight decay: no pattern of ``no_decay`` is
    found (``re.search``) in the lower-cased name, as the Hugging Face Trainer matches."""
    lowered = name.lower()
    return not any(re.search(p, lowered) for p in no_decay)


# --------------------------------------------------------------------------- clipping


def global_grad_norm(
    grads: Iterable[torch.Tensor] | Mapping[Any, Mapping[str, torch.Tensor]],
) -> torch.Tensor:
    """L2 norm over all of a step's gradients, as a 0-dim float32 tensor.

    Accepts a flat iterable of tensors or ``{layer: {name: grad}}`` (taken in ascending
    layer order, names in insertion order: the order of ``model.parameters()`` when
    layers are numbered front to back, which makes the result bitwise equal to
    ``torch.nn.utils.get_total_norm`` over the model).
    """
    if isinstance(grads, Mapping):
        tensors = [g for layer in sorted(grads) for g in grads[layer].values()]
    else:
        tensors = list(grads)
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    return torch.nn.utils.get_total_norm(tensors, norm_type=2.0)


def clip_coefficient(total_norm: torch.Tensor | float, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))`` as 0-dim float32, exactly as
    ``torch.nn.utils.clip_grad_norm_`` computes it."""
    if not isinstance(total_norm, torch.Tensor):
        total_norm = torch.tensor(float(total_norm), dtype=torch.float32)
    return torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)


# --------------------------------------------------------------------------- optimizer

# Note [8-bit states]
# ~~~~~~~~~~~~~~~~~~~
# With ``state_dtype="int8"`` AdamW's moments are block-wise quantized
# (roundpipe.coordinator.training.quantized_state): per tensor, uint8 codes and one fp32 scale per
# 256 elements, ~2.03 bytes per parameter instead of 8. A chunk is dequantized into fp32
# scratch, stepped by the same fused kernel and quantized back, so the update differs
# from fp32 states only by the rounding of the stored moments. Codes and scales are the
# whole state (``state_dict`` kinds ``INT8_KINDS``): a checkpoint resumes bit for bit.

# Note [8-bit second moment]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# The second moment is stored as its square root. Stored as itself it needs twice the
# first moment's range in orders of magnitude (it is the gradient squared): an element
# whose v was below ~1.4e-7 of its block's largest rounded to code 0 while its m kept a
# value, and every later step divided m by sqrt((1 - beta2) g^2) alone: updates of up to
# ~100x the learning rate (an embedding row of a rare token beside a frequent one, 707%
# off fp32 states after 20 steps of a tiny model). sqrt(v) spans the same range as m.
# An element whose sqrt(v) still rounds to 0 gets m = 0 too (its update is then 0, not
# m / eps). A checkpoint written before this holds v's codes (kind ``exp_avg_sq``):
# restoring converts them (``square_to_root_``), so an upgrade does not break a resume.

# Note [chunked fused AdamW]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# The "fused" path without the compiled kernel (``kernel="torch"``, numba missing, or
# AdamW's int8 states and SGD, which always take it; Note [compiled AdamW kernel] is the
# default) calls torch's fused CPU AdamW kernel (``torch._fused_adamw_``, what
# ``torch.optim.AdamW(fused=True)`` calls) on flat chunks of CHUNK_NUMEL elements rather
# than on whole tensors, and casts each chunk into the params arena right after updating
# it, while its masters are still in cache: one pass over memory instead of two. Each
# call runs on torch's intra-op OpenMP team, sized to ``threads`` (torch.set_num_threads:
# process-wide, but the coordinator process's only heavy compute is the optimizer), so a
# group of ready layers is one multi-threaded pass. The kernel is elementwise and splits its work between threads at arbitrary
# 16-element boundaries, so its results cannot depend on where a range starts: chunking
# changes no bit (tests/test_optimizer.py compares against torch.optim.AdamW(fused=True)).
# Why not a pool of Python threads each stepping its own chunks: every kernel call forks
# an OpenMP team of its own (the kernel's grain is 0), so the pool would oversubscribe
# the cores; and the call overhead (about 10-20 us) wants chunks far larger than a
# thread-private cache anyway. 1M elements (4 MiB of masters) amortises it to ~2% and
# keeps a chunk's masters within a server's L3 until the cast re-reads them.
CHUNK_NUMEL = 1 << 20


def default_threads(cpus: int | None = None) -> int:
    """The coordinator's optimizer threads unless ``--threads`` or the job spec's
    ``optimizer.threads`` says otherwise: half the
    cores this process may run on (the rest stay with the workers' host-side work:
    copies, pinning, CPU workers' compute), at least 1, at most 16 (memory bandwidth,
    the bound, is saturated well before that on common hosts)."""
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
    return max(1, min(16, cpus // 2))


def _chunks(t: torch.Tensor) -> list[torch.Tensor]:
    flat = t.view(-1)
    return [flat[i : i + CHUNK_NUMEL] for i in range(0, flat.numel(), CHUNK_NUMEL)]


class _Layer:
    """One layer's tensors, moments, step count and (reference impls) torch optimizer."""

    __slots__ = (
        "names",
        "params",
        "state",
        "steps",
        "opt",
        "chunks",
        "decayed",
        "step",
        "scratch",
        "views",
        "arrays",
    )

    def __init__(self, names: list[str], params: list[torch.Tensor]) -> None:
        self.names = names
        self.params = params
        # Per state kind (ALGORITHM_STATE), one buffer per tensor.
        self.state: dict[str, list[torch.Tensor]] = {}
        self.steps: list[torch.Tensor] = []  # torch's per-tensor step counts
        self.opt: torch.optim.AdamW | None = None  # "foreach" / "for-loop" only
        self.chunks: list[tuple[int, int]] = []  # "fused" only: (tensor index, chunk)
        self.decayed: list[bool] = []
        self.step = 0  # last optimizer step applied to this layer
        self.scratch: dict[str, torch.Tensor] = {}
        # Chunk views of gradient / out tensors, keyed by (role, index): rebuilt only
        # when the caller passes a tensor at another address (the arenas do not move).
        self.views: dict[tuple[str, int], tuple[tuple, list[torch.Tensor]]] = {}
        # The same for the compiled kernel: flat numpy views, keyed by (role, index).
        self.arrays: dict[tuple[str, int], tuple[tuple, Any]] = {}

    def chunk_views(self, role: str, index: int, t: torch.Tensor) -> list[torch.Tensor]:
        """``t``'s CHUNK_NUMEL chunks (flat views), cached per role and tensor index."""
        key = (t.data_ptr(), t.dtype, t.shape)
        cached = self.views.get((role, index))
        if cached is None or cached[0] != key:
            cached = self.views[(role, index)] = (key, _chunks(t))
        return cached[1]

    def array(self, role: str, index: int, t: torch.Tensor) -> Any:
        """``t`` as a flat numpy array (adamw_kernel.flat_array), cached like chunk_views."""
        key = (t.data_ptr(), t.dtype, t.shape)
        cached = self.arrays.get((role, index))
        if cached is None or cached[0] != key:
            cached = self.arrays[(role, index)] = (key, adamw_kernel.flat_array(t))
        return cached[1]


class LayerwiseOptimizer:
    """AdamW (or SGD) over ``{layer: {name: fp32 master tensor}}``, stepped layer by layer.

    ``algorithm="sgd"``: torch.optim.SGD's update (fused kernel, same chunked path) with
    ``momentum`` and ``nesterov``, no dampening; its ``weight_decay`` is SGD's (added to
    the gradient), under the same ``no_decay`` groups. ``betas`` and ``eps`` are unused.
    Bitwise equal to ``torch.optim.SGD(fused=True)``.

    Construct with :meth:`from_spec` or directly. ``moments``, if given, supplies the
    state buffers ``{layer: {name: (exp_avg, exp_avg_sq)}}`` (e.g. views into the optim
    arena); they are zeroed here. Otherwise they are allocated here, once.

    ``no_decay``: regular expressions; a tensor whose lower-cased name any of them
    matches (``re.search``) gets no weight decay (see :func:`decays`). The arithmetic
    per tensor stays that of one whole-model AdamW with two parameter groups, as the
    Hugging Face Trainer builds them.

    ``threads``: the size of the intra-op thread team that steps the layers handed to one
    :meth:`step_layers` call (Note [chunked fused AdamW]). It is torch's process-wide
    setting (``torch.set_num_threads``), applied when a step begins: in the coordinator
    process, whose only heavy compute is the optimizer, it is the optimizer's thread count
    (with several jobs at once, the one stepping last sets it). ``None``: leave torch's
    setting as it is (the coordinator daemon sets it from ``--threads``, by default
    :func:`default_threads`).

    ``kernel``: one of ``OPTIMIZER_KERNELS`` (module docstring); :attr:`kernel_in_use`
    says which kernel AdamW runs on.
    """

    def __init__(
        self,
        masters: Mapping[int, Mapping[str, torch.Tensor]],
        *,
        schedule: LRSchedule,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        grad_clip: float | None = None,
        impl: str = "fused",
        moments: Mapping[int, Mapping[str, tuple[torch.Tensor, torch.Tensor]]] | None = None,
        no_decay: Sequence[str] = (),
        threads: int | None = None,
        algorithm: str = "adamw",
        momentum: float = 0.0,
        nesterov: bool = False,
        state_dtype: str = "float32",
        kernel: str = "auto",
    ) -> None:
        if kernel not in OPTIMIZER_KERNELS:
            raise ValueError(f"kernel must be one of {OPTIMIZER_KERNELS}, got {kernel!r}")
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {state_dtype!r}")
        if state_dtype == "int8" and (algorithm, impl, moments) != ("adamw", "fused", None):
            raise ValueError("int8 states: AdamW on the fused path, its own buffers only")
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if algorithm == "sgd" and (impl != "fused" or moments is not None):
            raise ValueError("sgd runs on the fused path with its own momentum buffers only")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        patterns = [re.compile(p) for p in no_decay]
        self.decayed: set[str] = set()
        """Names of the tensors that get weight decay."""
        self.schedule = schedule
        self.betas = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.grad_clip = grad_clip
        self.impl = impl
        self.algorithm = algorithm
        self.momentum = momentum
        self.nesterov = nesterov
        self.state_dtype = state_dtype
        self.kinds: tuple[str, ...] = (
            INT8_KINDS
            if state_dtype == "int8"
            else ("exp_avg", "exp_avg_sq")
            if algorithm == "adamw"
            else ("momentum_buffer",)
            if momentum
            else ()
        )
        """The state buffers each tensor has, as named in :meth:`state_dict`."""
        self.threads = threads
        self._scratch8: tuple[torch.Tensor, torch.Tensor] | None = None
        # torch keeps the step count in float32, or float64 for the non-fused kernels
        # under a float64 default dtype (torch.optim.optimizer._get_scalar_dtype).
        step_dtype = (
            torch.float64
            if impl != "fused" and torch.get_default_dtype() == torch.float64
            else torch.float32
        )
        self._layers: dict[int, _Layer] = {}
        for layer, tensors in masters.items():
            if not tensors:
                raise ValueError(f"layer {layer} has no trainable tensors; leave it out")
            names = list(tensors)
            entry = _Layer(names, [tensors[n] for n in names])
            entry.state = {kind: [] for kind in self.kinds}
            given = None if moments is None else moments.get(layer)
            for name, p in zip(names, entry.params):
                if p.dtype != torch.float32 or p.device.type != "cpu" or p.requires_grad:
                    raise ValueError(
                        f"master {layer}/{name} must be a float32 CPU tensor without "
                        f"requires_grad, got {p.dtype} on {p.device} (requires_grad={p.requires_grad})"
                    )
                if impl == "fused" and not p.is_contiguous():
                    raise ValueError(f"master {layer}/{name} must be contiguous")
                if given is not None:
                    bufs = given[name]
                    for buf in bufs:
                        if (
                            buf.shape != p.shape
                            or buf.dtype != torch.float32
                            or not buf.is_contiguous()
                        ):
                            raise ValueError(
                                f"moment buffer of {layer}/{name} must be contiguous float32 "
                                f"{tuple(p.shape)}, got {buf.dtype} {tuple(buf.shape)}"
                            )
                        buf.zero_()
                elif state_dtype == "int8":  # Note [8-bit states]
                    codes = torch.zeros(p.numel(), dtype=torch.uint8)
                    absmax = torch.zeros(absmax_numel(p.numel()), dtype=torch.float32)
                    bufs = (codes, absmax, codes.clone(), absmax.clone())
                else:
                    bufs = tuple(torch.zeros_like(p) for _ in self.kinds)
                for kind, buf in zip(self.kinds, bufs):
                    entry.state[kind].append(buf)
                entry.steps.append(torch.zeros((), dtype=step_dtype))
            decayed = [decays(n, patterns) for n in names]
            self.decayed.update(n for n, d in zip(names, decayed) if d)
            entry.decayed = decayed
            if impl == "fused":
                for i, p in enumerate(entry.params):
                    num_chunks = -(-p.numel() // CHUNK_NUMEL)
                    entry.chunks += [(i, j) for j in range(num_chunks)]
            else:
                entry.opt = self._torch_optimizer(entry, decayed)
            self._layers[layer] = entry
        self._compiled = self._load_kernel() if kernel == "auto" else None
        self._team = adamw_kernel.Team()
        self.kernel_in_use = (
            "compiled" if self._compiled is not None else "torch" if impl == "fused" else impl
        )
        """``"compiled"`` (the one-pass AdamW kernel), ``"torch"`` (torch's fused AdamW or
        SGD kernel), or the reference ``impl`` this optimizer steps with."""

    def _load_kernel(self) -> Any:
        """The compiled AdamW kernel if this optimizer can use it (AdamW, the fused path,
        float32 states), it loads, and it is bitwise torch's under these hyperparameters;
        else None, with one log line saying why."""
        if (self.algorithm, self.impl, self.state_dtype) != ("adamw", "fused", "float32"):
            return None
        compiled, why = adamw_kernel.load()
        if compiled is not None and not adamw_kernel.self_check(
            compiled,
            lr=self.schedule.lr,
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
        ):
            compiled, why = None, "its results differ from this torch build's fused AdamW"
        if compiled is None:
            log.warning(
                "optimizer: the compiled AdamW kernel is not used (%s); running torch's "
                "fused AdamW instead (same results, a second pass for the bf16 copy)",
                why,
            )
        return compiled

    def _torch_optimizer(self, entry: _Layer, decayed: list[bool]) -> torch.optim.AdamW:
        """The reference path: a torch.optim.AdamW over one layer, its state set up
        eagerly (as torch.optim.adam's lazy _init_group would) in our buffers."""
        on = [p for p, d in zip(entry.params, decayed) if d]
        off = [p for p, d in zip(entry.params, decayed) if not d]
        groups = [{"params": on}] if on else []
        if off:
            groups.append({"params": off, "weight_decay": 0.0})
        opt = torch.optim.AdamW(
            groups,
            lr=self.schedule.lr,
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
            foreach=self.impl == "foreach",
            fused=False,
        )
        for i, p in enumerate(entry.params):
            opt.state[p] = {
                "step": entry.steps[i],
                "exp_avg": entry.state["exp_avg"][i],
                "exp_avg_sq": entry.state["exp_avg_sq"][i],
            }
        return opt

    @classmethod
    def from_spec(
        cls,
        spec: JobSpec,
        masters: Mapping[int, Mapping[str, torch.Tensor]],
        *,
        impl: str = "fused",
        moments: Mapping[int, Mapping[str, tuple[torch.Tensor, torch.Tensor]]] | None = None,
    ) -> LayerwiseOptimizer:
        """The optimizer a job spec describes (schedule over ``train.steps``)."""
        o = spec.optimizer
        return cls(
            masters,
            schedule=LRSchedule.from_spec(o, spec.train.steps),
            betas=(float(o.betas[0]), float(o.betas[1])),
            eps=float(o.eps),
            weight_decay=float(o.weight_decay),
            grad_clip=None if o.grad_clip is None else float(o.grad_clip),
            impl=impl,
            moments=moments,
            no_decay=o.no_decay,
            threads=o.threads or None,
            algorithm=o.name,
            momentum=float(o.momentum),
            nesterov=bool(o.nesterov),
            state_dtype=o.state_dtype,
            kernel=o.kernel,
        )

    @property
    def layers(self) -> tuple[int, ...]:
        """Layer indices, ascending."""
        return tuple(sorted(self._layers))

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (>= 1)."""
        return self.schedule.lr_at(step)

    def last_step(self, layer: int) -> int:
        """Last step applied to ``layer`` (0: none yet)."""
        return self._layers[layer].step

    def step_layer(
        self,
        layer: int,
        grads: Mapping[str, torch.Tensor],
        step: int,
        *,
        clip_coef: torch.Tensor | float | None = None,
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> float:
        """Apply step ``step``'s gradients to ``layer``; return the learning rate used.

        ``step`` must be exactly one more than the layer's last step (a repeated or
        skipped step raises OptimizerStepError before touching anything). ``grads``
        holds one gradient per master, same shape; float32 gradients are used in place,
        and when ``clip_coef`` is given they are scaled by it in place (the grads slot
        is consumed by this step; pass ``clip_coefficient(...)`` computed over the whole
        step). ``clip_coef`` is required when the optimizer has ``grad_clip``. ``out``,
        if given, receives the updated weights in its tensors' dtype (the params arena
        buffer of this version), round-to-nearest-even as ``copy_`` casts.
        """
        outs = None if out is None else {layer: out}
        return self.step_layers({layer: grads}, step, clip_coef=clip_coef, outs=outs)

    def step_layers(
        self,
        grads: Mapping[int, Mapping[str, torch.Tensor]],
        step: int,
        *,
        clip_coef: torch.Tensor | float | None = None,
        outs: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> float:
        """:meth:`step_layer` for several layers in one multi-threaded pass.

        Layers are worked on lowest first, and ``on_layer_done(layer)`` is called, in
        ascending layer order, as soon as that layer's masters, moments and ``outs`` are
        fully written (so the caller may publish its version while higher layers are
        still being stepped). Everything is checked before anything is touched.
        """
        layers = sorted(grads)
        entries = [self._check(layer, grads[layer], step, clip_coef, outs) for layer in layers]
        lr = self.schedule.lr_at(step)
        coef = None
        if clip_coef is not None:
            coef = (
                clip_coef if isinstance(clip_coef, torch.Tensor) else torch.tensor(float(clip_coef))
            )
            # The multiply clip_grads_with_norm_ performs (elementwise, by a float32
            # 0-dim tensor), so the scaled gradients match it bitwise.
            coef = coef.to(torch.float32)
        plans = [
            self._prepare(entry, grads[layer], None if outs is None else outs.get(layer))
            for layer, entry in zip(layers, entries)
        ]
        if self.impl != "fused":
            for layer, entry, (grad_list, out_list) in zip(layers, entries, plans):
                self._step_reference(entry, grad_list, coef, lr)
                self._finish(layer, entry, step, out_list, on_layer_done)
            return lr
        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        for layer, entry, (grad_list, out_list) in zip(layers, entries, plans):
            for t in entry.steps:
                t.add_(1)  # as torch.optim.adam._fused_adam does before the kernel
            if self._compiled is not None:
                self._step_compiled(entry, grad_list, out_list, coef, lr, step)
            else:
                self._step_chunks(entry, grad_list, out_list, coef, lr)
            self._finish(layer, entry, step, out_list, on_layer_done)
        return lr

    # -- step internals --

    def _check(
        self,
        layer: int,
        grads: Mapping[str, torch.Tensor],
        step: int,
        clip_coef: object,
        outs: Mapping[int, Mapping[str, torch.Tensor]] | None,
    ) -> _Layer:
        entry = self._layers.get(layer)
        if entry is None:
            raise OptimizerStepError(f"layer {layer} has no trainable weights here")
        if step != entry.step + 1:
            raise OptimizerStepError(
                f"layer {layer}: asked for step {step}, but its last step was {entry.step}"
                f" (expected {entry.step + 1})"
            )
        if self.grad_clip is not None and clip_coef is None:
            raise OptimizerStepError(
                "grad_clip is set: pass clip_coef=clip_coefficient(global_grad_norm(<all "
                "grads of the step>), grad_clip)"
            )
        if grads.keys() != set(entry.names):
            missing = sorted(set(entry.names) - grads.keys())
            extra = sorted(grads.keys() - set(entry.names))
            raise OptimizerStepError(
                f"layer {layer}: gradients missing {missing}, unexpected {extra}"
            )
        out = None if outs is None else outs.get(layer)
        if out is not None and out.keys() != set(entry.names):
            raise OptimizerStepError(
                f"layer {layer}: out must have exactly the names {entry.names}"
            )
        for name, p in zip(entry.names, entry.params):
            if grads[name].shape != p.shape:
                raise OptimizerStepError(
                    f"layer {layer}/{name}: gradient shape {tuple(grads[name].shape)}, "
                    f"weight {tuple(p.shape)}"
                )
            if out is not None and out[name].shape != p.shape:
                raise OptimizerStepError(
                    f"layer {layer}/{name}: out shape {tuple(out[name].shape)}, "
                    f"weight {tuple(p.shape)}"
                )
        return entry

    def _prepare(
        self,
        entry: _Layer,
        grads: Mapping[str, torch.Tensor],
        out: Mapping[str, torch.Tensor] | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Float32 contiguous gradients (non-float32 or strided ones through a scratch
        buffer) and the out tensors, in the layer's tensor order."""
        grad_list = []
        for name, p in zip(entry.names, entry.params):
            g = grads[name]
            if g.dtype != torch.float32 or g.device != p.device or not g.is_contiguous():
                buf = entry.scratch.get(name)
                if buf is None:
                    buf = entry.scratch[name] = torch.empty_like(p)
                buf.copy_(g)
                g = buf
            grad_list.append(g)
        out_list: list[torch.Tensor | None] = (
            [None] * len(entry.names) if out is None else [out[n] for n in entry.names]
        )
        return grad_list, out_list

    def _step_chunks(
        self,
        entry: _Layer,
        grad_list: list[torch.Tensor],
        out_list: list[torch.Tensor | None],
        coef: torch.Tensor | None,
        lr: float,
    ) -> None:
        """Clip, AdamW and cast chunk by chunk (Note [chunked fused AdamW])."""
        beta1, beta2 = self.betas
        views = entry.chunk_views
        first_step = entry.step == 0  # torch's SGD starts its momentum buffer as the gradient
        for i, j in entry.chunks:
            p = views("param", i, entry.params[i])[j]
            g = views("grad", i, grad_list[i])[j]
            if self.state_dtype == "int8":  # Note [8-bit states]
                state, packed = self._unpack_int8(entry, i, j, p.numel())
            else:
                state = [views(k, i, entry.state[k][i])[j] for k in self.kinds]
            weight_decay = self.weight_decay if entry.decayed[i] else 0.0
            if coef is not None:
                g.mul_(coef)
            if self.algorithm == "adamw":
                torch._fused_adamw_(
                    [p],
                    [g],
                    [state[0]],
                    [state[1]],
                    [],
                    [entry.steps[i]],
                    amsgrad=False,
                    lr=lr,
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=weight_decay,
                    eps=self.eps,
                    maximize=False,
                )
            else:
                # The call torch.optim.SGD(fused=True) makes (torch.optim.sgd._fused_sgd).
                torch._fused_sgd_(
                    [p],
                    [g],
                    state,
                    weight_decay=weight_decay,
                    momentum=self.momentum,
                    lr=lr,
                    dampening=0.0,
                    nesterov=self.nesterov,
                    maximize=False,
                    is_first_step=first_step,
                )
            if self.state_dtype == "int8":
                self._pack_int8(packed)
            out = out_list[i]
            if self._casts_in_pass(out):
                views("out", i, out)[j].copy_(p)

    def _step_compiled(
        self,
        entry: _Layer,
        grad_list: list[torch.Tensor],
        out_list: list[torch.Tensor | None],
        coef: torch.Tensor | None,
        lr: float,
        step: int,
    ) -> None:
        """Clip, AdamW and cast in one pass on the compiled kernel (Note [compiled AdamW
        kernel]), the layer's elements split evenly between the team's threads."""
        beta1, beta2 = self.betas
        scale = None if coef is None else np.float32(coef.item())
        consts = {
            wd: adamw_kernel.constants(
                lr=lr, beta1=beta1, beta2=beta2, eps=self.eps, weight_decay=wd, step=step
            )
            for wd in {self.weight_decay if d else 0.0 for d in entry.decayed}
        }
        kernel, array = self._compiled, entry.array
        args = []
        for i, p in enumerate(entry.params):
            out = out_list[i]
            args.append(
                (
                    array("param", i, p),
                    array("grad", i, grad_list[i]),
                    array("exp_avg", i, entry.state["exp_avg"][i]),
                    array("exp_avg_sq", i, entry.state["exp_avg_sq"][i]),
                    array("out", i, out) if self._casts_in_pass(out) else None,
                    consts[self.weight_decay if entry.decayed[i] else 0.0],
                )
            )

        def run(share: list[tuple[int, int, int]]) -> None:
            for i, lo, hi in share:
                p, g, m, v, out, c = args[i]
                adamw_kernel.step_range(kernel, p, g, m, v, out, lo, hi, c, scale)

        threads = self.threads or torch.get_num_threads()
        shares = adamw_kernel.split([p.numel() for p in entry.params], threads)
        self._team.run([lambda share=share: run(share) for share in shares])

    def _casts_in_pass(self, out: torch.Tensor | None) -> bool:
        """Whether the update pass also writes ``out`` (else _finish copies it after):
        contiguous outs on the chunked torch path; contiguous bf16 ones on the compiled."""
        if out is None or self.impl != "fused" or not out.is_contiguous():
            return False
        return self._compiled is None or out.dtype == torch.bfloat16

    def _unpack_int8(
        self, entry: _Layer, i: int, j: int, n: int
    ) -> tuple[list[torch.Tensor], list[tuple]]:
        """Note [8-bit states]: chunk j (``n`` elements) of tensor i's moments,
        dequantized into fp32 scratch, and what ``_pack_int8`` needs to store them back."""
        if self._scratch8 is None:
            self._scratch8 = (torch.empty(CHUNK_NUMEL), torch.empty(CHUNK_NUMEL))
        start, first_block = j * CHUNK_NUMEL, j * (CHUNK_NUMEL // BLOCK)
        state, packed = [], []
        for kind, scratch, code_map in (
            ("exp_avg", self._scratch8[0][:n], SIGNED_MAP),
            ("exp_avg_sqrt", self._scratch8[1][:n], UNSIGNED_MAP),
        ):
            codes = entry.state[kind][i][start : start + n]
            absmax = entry.state[f"{kind}_absmax"][i][first_block : first_block + absmax_numel(n)]
            dequantize_(codes, absmax, code_map, scratch)
            if kind == "exp_avg_sqrt":
                scratch.square_()  # Note [8-bit second moment]
            state.append(scratch)
            packed.append((scratch, codes, absmax, code_map))
        return state, packed

    @staticmethod
    def _pack_int8(packed: list[tuple]) -> None:
        """Store the chunk's moments back. An element whose second moment overflowed (a
        gradient above ~6e20) restarts both its moments at zero: this step its update
        was already zero (m / inf, as with fp32 states), and keeping its huge first
        moment beside a finite second moment would move its weight by ~1e6 a step. An
        element whose gradient was NaN does the same: its weight is NaN from this step's
        update, as with fp32 states, and its NaN moments must not reach its block's scale."""
        (m, m_codes, m_absmax, m_map), (v, v_codes, v_absmax, v_map) = packed
        overflowed = quantize_(v.sqrt_(), v_codes, v_absmax, v_map)  # Note [8-bit second moment]
        if overflowed is not None:
            m.masked_fill_(overflowed, 0.0)
        m.masked_fill_(v_codes == 0, 0.0)  # no second moment left: no first either
        quantize_(m, m_codes, m_absmax, m_map)

    def _step_reference(
        self, entry: _Layer, grad_list: list[torch.Tensor], coef: torch.Tensor | None, lr: float
    ) -> None:
        assert entry.opt is not None
        if coef is not None:
            for g in grad_list:
                g.mul_(coef)
        for group in entry.opt.param_groups:
            group["lr"] = lr
        for p, g in zip(entry.params, grad_list):
            p.grad = g
        try:
            entry.opt.step()
        finally:
            for p in entry.params:
                p.grad = None  # drop the reference into the grads arena

    def _finish(
        self,
        layer: int,
        entry: _Layer,
        step: int,
        out_list: list[torch.Tensor | None],
        on_layer_done: Callable[[int], None] | None,
    ) -> None:
        with torch.no_grad():
            for p, out in zip(entry.params, out_list):
                # Outs the update pass did not write (strided ones, not bf16 on the
                # compiled kernel, or the reference path).
                if out is not None and not self._casts_in_pass(out):
                    out.copy_(p)
        entry.step = step
        if on_layer_done is not None:
            on_layer_done(layer)

    # -- checkpoints --

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "steps": {layer: last step}, "tensors": {key: Tensor}}``.

        Tensor keys are ``"<layer>.<name>.exp_avg"`` / ``".exp_avg_sq"`` (safetensors-
        ready). The tensors are the live buffers, not copies: save them before the next
        step. Masters are not included; they are checkpointed as the model's weights.
        """
        tensors: dict[str, torch.Tensor] = {}
        steps: dict[int, int] = {}
        for layer in self.layers:
            entry = self._layers[layer]
            steps[layer] = entry.step
            for kind, bufs in entry.state.items():
                for name, buf in zip(entry.names, bufs):
                    tensors[f"{layer}.{name}.{kind}"] = buf
        return {"version": _STATE_VERSION, "steps": steps, "tensors": tensors}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy saved moments and step counts into this optimizer's buffers (in place)."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"optimizer state version {state.get('version')!r} is not supported")
        steps = {int(k): int(v) for k, v in state["steps"].items()}
        tensors = state["tensors"]
        if set(steps) != set(self._layers):
            raise ValueError(
                f"optimizer state has layers {sorted(steps)}, this optimizer {self.layers}"
            )
        expected = {
            f"{layer}.{name}.{kind}"
            for layer, entry in self._layers.items()
            for name in entry.names
            for kind in self.kinds
        }
        if set(tensors) != expected:
            missing = sorted(expected - set(tensors))[:5]
            extra = sorted(set(tensors) - expected)[:5]
            raise ValueError(
                f"optimizer state tensors differ: missing {missing}, unexpected {extra}"
            )
        for layer, entry in self._layers.items():
            for i, name in enumerate(entry.names):
                for kind in self.kinds:
                    buf = entry.state[kind][i]
                    src = tensors[f"{layer}.{name}.{kind}"]
                    if src.shape != buf.shape or src.dtype != buf.dtype:
                        raise ValueError(
                            f"optimizer state {layer}.{name}.{kind} is {src.dtype} "
                            f"{tuple(src.shape)}, expected {buf.dtype} {tuple(buf.shape)}"
                        )
                    buf.copy_(src)
                entry.steps[i].fill_(float(steps[layer]))
            entry.step = steps[layer]
