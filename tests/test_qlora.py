"""LoRA on a quantised base (``lora.base_quantization``) through the trainer and workers.

The frozen base is quantised once at load, stored quantised in the params arena,
uploaded quantised and dequantised per layer on the worker (Note [quantised base] in
roundpipe.shared.quantized_base). The oracle is the plain transformers / peft loop over
the same base quantised and dequantised once: the runtime must match it.
"""

from __future__ import annotations

import math

import pytest
import torch
from runtime_helpers import (
    TINY_QWEN3,
    assert_params_match,
    oracle_train,
    tiny_spec,
    trained_in_process,
)

from roundpipe.coordinator.training.memory import host_memory_needed
from roundpipe.shared.quantized_base import PART_SEP
from roundpipe.worker.transfer import EmulatedEngine, Priority


def frozen_bytes(layout) -> tuple[int, int]:
    """(bytes of the quantised weights' parts in the params arena, their parameters)."""
    qb = layout.model.quantized_base
    nbytes = sum(
        layout.view(ref).nbytes
        for per_layer in layout.params.values()
        for name, (ref, _) in per_layer.items()
        if PART_SEP in name
    )
    return nbytes, sum(math.prod(s) for s in qb.shapes.values())


@pytest.mark.parametrize(
    "quant, staleness, per_param",
    [("nf4", 1, 0.6), ("int8", 0, 1.1)],
)
def test_ten_lora_steps_match_the_loop_over_the_dequantised_base(
    tmp_path, arena_dir, quant, staleness, per_param
):
    spec = tiny_spec(
        tmp_path,
        steps=10,
        staleness=staleness,
        lora={"r": 4, "alpha": 8, "base_quantization": quant},
    )
    with trained_in_process(spec, arena_dir, 2) as trainer:
        runtime = {n: t for layer in trainer.final_weights().values() for n, t in layer.items()}
        layout = trainer.layout
        nbytes, params = frozen_bytes(layout)
        assert nbytes / params <= per_param
        # Admission and the trainer count the arena as laid out: quantised.
        assert host_memory_needed(layout).weights == layout.sizes["params"]
        trainer.export(tmp_path / "export")
    oracle = oracle_train(spec, dequantized_base=True)
    lora_only = {n: t for n, t in runtime.items() if ".lora_" in n}
    assert lora_only
    assert_params_match(lora_only, oracle, rtol=1e-4)
    # The frozen base the runtime reports is the dequantised one, exactly.
    frozen = {n: t for n, t in runtime.items() if ".base_layer." in n}
    assert frozen and all(torch.equal(t, oracle[n]) for n, t in frozen.items())
    # The adapter in peft's format, loadable on the unquantised base.
    from peft import AutoPeftModelForCausalLM

    loaded = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    exported = {n: p.detach() for n, p in loaded.named_parameters() if ".lora_" in n}
    assert exported.keys() == lora_only.keys()
    assert_params_match(exported, lora_only, rtol=0)


# Wider and more decoder layers than TINY_QWEN3, so that the embedding and LM head (kept
# in bf16, as QLoRA keeps them) are about the share of the parameters they are in real
# models (2% in Qwen3-30B-A3B: its nf4 upload ratio is ~0.27; 4.5% here).
WIDE = dict(TINY_QWEN3, hidden_size=256, intermediate_size=1024, head_dim=64, num_hidden_layers=8)


def uploaded_weight_bytes(tmp_path, arena_dir, quant: str) -> tuple[int, float]:
    """Weight bytes two emulated-bus workers uploaded in 2 steps, and the last loss."""
    engines: list[EmulatedEngine] = []

    def engine():
        engines.append(EmulatedEngine(20e9, latency_s=0))
        return engines[-1]

    spec = tiny_spec(
        tmp_path / quant,
        steps=2,
        staleness=1,
        dtype="bfloat16",
        config=WIDE,
        seq_len=16,
        num_microbatches=2,
        lora={
            "r": 4,
            "alpha": 8,
            "target_modules": ["q_proj", "v_proj"],
            "base_quantization": quant,
        },
    )
    with trained_in_process(spec, arena_dir, 2, job_id=f"job-{quant}", engine=engine) as trainer:
        loss = trainer.progress[-1].loss
    return sum(e.uploaded_bytes[Priority.WEIGHT] for e in engines), loss


def test_nf4_uploads_under_a_third_of_the_bf16_base(tmp_path, arena_dir):
    bf16, bf16_loss = uploaded_weight_bytes(tmp_path, arena_dir, "none")
    nf4, nf4_loss = uploaded_weight_bytes(tmp_path, arena_dir, "nf4")
    assert bf16 > 0
    assert nf4 / bf16 <= 0.3, nf4 / bf16
    assert abs(nf4_loss - bf16_loss) < 0.05  # the same job, on a 4-bit base


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["nf4", "nf4-plain", "int8", "int8-block"])
def test_cuda_dequantisation_equals_the_cpu_bitwise(fmt):
    """The worker's CUDA path is the same torch dequantisation on the GPU: gathers and
    fp32 multiplies, each rounded once, so it equals the CPU's bit for bit."""
    from roundpipe.shared.quant_format import QuantFormat

    kinds = {
        "nf4": QuantFormat("nf4"),
        "nf4-plain": QuantFormat("nf4", double_quant=False),
        "int8": QuantFormat("int8"),
        "int8-block": QuantFormat("int8", int8_scales="per_block"),
    }
    q = kinds[fmt]
    torch.manual_seed(0)
    shape = (8, 96, 128)  # MoE-shaped
    parts = q.quantize(torch.randn(shape) * 0.02)
    on_gpu = {k: v.cuda() for k, v in parts.items()}
    for dtype in (torch.float32, torch.bfloat16):
        cpu = q.dequantize(parts, shape, dtype)
        gpu = q.dequantize(on_gpu, shape, dtype).cpu()
        assert torch.equal(cpu, gpu)
    # Quantising on the GPU gives the same parts too (load-time work may run there).
    again = q.quantize((torch.randn(shape) * 0.02).cuda())
    assert set(again) == set(parts)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_worker_trains_an_nf4_base_like_the_cpu_worker(tmp_path, arena_dir):
    """Two CUDA-engine workers on an NF4 base end with the CPU workers' adapters (fp32,
    the CUDA kernels' reductions differ only in rounding)."""
    from roundpipe.worker.transfer import CudaEngine

    spec = tiny_spec(
        tmp_path / "gpu", steps=3, lora={"r": 4, "alpha": 8, "base_quantization": "nf4"}
    )
    with trained_in_process(
        spec, arena_dir, 2, job_id="job-gpu", engine=lambda: CudaEngine(torch.device("cuda", 0))
    ) as trainer:
        gpu = {n: t.clone() for layer in trainer.final_weights().values() for n, t in layer.items()}
    spec = tiny_spec(
        tmp_path / "cpu", steps=3, lora={"r": 4, "alpha": 8, "base_quantization": "nf4"}
    )
    with trained_in_process(spec, arena_dir, 2, job_id="job-cpu") as trainer:
        cpu = {n: t.clone() for layer in trainer.final_weights().values() for n, t in layer.items()}
    # 1e-3, as test_cuda.py's GPU-against-CPU worker test: three Adam steps carry the
    # kernels' reduction-order rounding (tiny_spec's own runs drift 2e-5 in two steps)
    assert_params_match({n: t for n, t in gpu.items() if ".lora_" in n}, cpu, rtol=1e-3)


@pytest.mark.parametrize("from_directory", [True, False], ids=["model-path", "random-base"])
def test_checkpoints_and_export_write_the_adapter_without_dequantising_the_base(
    tmp_path, arena_dir, monkeypatch, from_directory
):
    """Each checkpoint of a quantised-base LoRA job dequantised the whole base to fp32
    (8x its arena) to write an adapter of a few hundred KB. Now the base is dequantised
    only to write ``<output>/base_model`` once (a random base), never for a model read
    from a directory; the checkpoints and the export still hold the adapter."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Qwen3Config

    from roundpipe.coordinator.spec.jobspec import JobSpec
    from roundpipe.shared.quantized_base import QuantizedBase

    calls = []
    real = QuantizedBase.dequantize_weights
    monkeypatch.setattr(
        QuantizedBase, "dequantize_weights", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    d = tiny_spec(tmp_path / "out", steps=3, lora={"r": 4, "alpha": 8, "base_quantization": "nf4"})
    d = d.to_dict()
    d["output"].update(checkpoint_every=1, keep_last=0, checkpoint_staging=0)
    if from_directory:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(Qwen3Config(**TINY_QWEN3)).save_pretrained(tmp_path / "m")
        d["model"] = {"path": str(tmp_path / "m"), "tokenizer": d["model"]["tokenizer"]}
    with trained_in_process(JobSpec.from_dict(d), arena_dir, 2) as trainer:
        trainer.export()
        adapter = load_file(tmp_path / "out" / "adapter_model.safetensors")
        assert adapter and all("lora_" in k for k in adapter)
        final = {n: t for per in trainer.final_weights().values() for n, t in per.items()}
    assert len(calls) == (0 if from_directory else 1) + 1  # + final_weights() just above
    for step in (1, 2, 3):
        files = tmp_path / "out" / "checkpoints" / f"step-{step:08d}"
        assert (files / "adapter_model.safetensors").is_file()
    lora_b = [n for n in final if ".lora_B." in n]
    assert lora_b and any(final[n].abs().sum() > 0 for n in lora_b)  # it trained


@pytest.mark.parametrize("quant", ["nf4", "none"])
def test_a_base_goes_into_the_arena_as_it_is_read(tmp_path, arena_dir, monkeypatch, quant):
    """A job on a model directory read the whole base in fp32 (4 bytes a parameter)
    before anything was checked: a QLoRA job admitted for its NF4 base (about 0.9 bytes
    a parameter in all) ran out of host memory while it started, and a LoRA job on a
    bf16 base peaked at ~6 bytes a parameter for a prediction of ~2 (Note [loading into
    the arena] in roundpipe.coordinator.training.trainer). Each weight now goes into
    the arena (quantised first) as it is read: no two of the base's fp32 weights are
    alive at once, and the arena holds what reading the whole base gave."""
    import gc
    import weakref

    from roundpipe.coordinator.spec.jobspec import JobSpec
    from roundpipe.shared import model as model_module
    from roundpipe.shared.model import LayeredModel

    layered = LayeredModel.from_config(dict(TINY_QWEN3, model_type="qwen3"))
    layered.to_hf_model(layered.init_weights(0)).save_pretrained(str(tmp_path / "model"))
    raw = tiny_spec(tmp_path / "out", steps=2, lora={"r": 4, "base_quantization": quant})
    spec_dict = raw.to_dict()
    spec_dict["model"] = {"path": str(tmp_path / "model"), "tokenizer": raw.model.tokenizer}
    spec = JobSpec.from_dict(spec_dict)

    read = model_module._SafetensorsDir.get
    alive: list[weakref.ref] = []
    most = 0

    def get(self, key):
        nonlocal most
        t = read(self, key)
        if t is not None and t.dim() == 2 and "proj" in key:  # a decoder matrix: the base
            gc.collect()
            alive[:] = [r for r in alive if r() is not None]
            most = max(most, len(alive) + 1)
            alive.append(weakref.ref(t))
        return t

    monkeypatch.setattr(model_module._SafetensorsDir, "get", get)
    with trained_in_process(spec, arena_dir, 2) as trainer:
        assert most <= 2  # the one read now, and the one before it at most
        # What reading the whole base, then quantising it, gives.
        monkeypatch.setattr(model_module._SafetensorsDir, "get", read)
        whole = trainer.model.load_weights(dtype=torch.float32, seed=spec.init_seed)
        qb = trainer.model.quantized_base
        if quant == "nf4":
            assert qb is not None and len(qb.shapes) > 8
            qb.quantize_weights(whole)
        checked = 0
        for layer, names in trainer.layout.params.items():
            for name, (even, _odd) in names.items():
                if ".lora_" not in name:  # the frozen base: as loaded, never trained
                    view = trainer.layout.view(even)
                    assert torch.equal(view, whole[layer][name].to(view.dtype)), name
                    checked += 1
        assert checked > 8
