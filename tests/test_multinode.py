"""Data parallelism across coordinators (coordinator.multinode, docs/multi-node.md).

Two coordinators on loopback form one gloo group, each with its own CPU worker; a job
submitted to rank 0 runs on both, each node training half of every global batch. The
exported model must equal the single-process oracle over the whole global batch (which
is what one coordinator with that batch produces: tests/test_end_to_end.py) within 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multinode_helpers import node_group
from runtime_helpers import assert_params_match, oracle_train, tiny_spec

from roundpipe.coordinator.multinode import node_microbatches, settings_from_args

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def load_output(output_dir: Path, lora: bool) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    if lora:
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(str(output_dir))
        return {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    model = AutoModelForCausalLM.from_pretrained(str(output_dir))
    return {n: p.detach() for n, p in model.named_parameters()}


def oracle(spec, lora: bool) -> dict[str, torch.Tensor]:
    out = oracle_train(spec)
    return {n: t for n, t in out.items() if "lora_" in n} if lora else out


def test_settings_from_flags_and_torchrun_environment() -> None:
    s = settings_from_args("tcp://10.0.0.1:29500", 1, 2, 30.0, environ={})
    assert (s.host, s.port, s.rank, s.world_size, s.timeout_s) == ("10.0.0.1", 29500, 1, 2, 30.0)
    env = {"MASTER_ADDR": "node0", "MASTER_PORT": "29400", "RANK": "0", "WORLD_SIZE": "3"}
    s = settings_from_args(None, None, None, environ=env)
    assert (s.host, s.port, s.rank, s.world_size) == ("node0", 29400, 0, 3)
    assert settings_from_args(None, None, None, environ={}) is None
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        settings_from_args("env://", 0, 2, environ={})
    with pytest.raises(ValueError, match="--rank must be in 0..1"):
        settings_from_args("tcp://h:1", 2, 2, environ={})
    with pytest.raises(ValueError, match="--world-size is required"):
        settings_from_args("tcp://h:1", 0, None, environ={})
    with pytest.raises(ValueError, match="need --dist-init"):
        settings_from_args(None, 0, 2, environ={})


def test_each_node_takes_an_equal_share_of_the_microbatches() -> None:
    assert [node_microbatches(6, r, 3) for r in range(3)] == [range(0, 2), range(2, 4), range(4, 6)]
    with pytest.raises(ValueError, match="multiple of the number of nodes"):
        node_microbatches(3, 0, 2)


@pytest.mark.slow
def test_two_coordinators_equal_one_with_the_global_batch(tmp_path: Path) -> None:
    """Full fine-tuning at staleness 0 and 1 and LoRA, submitted to rank 0 at once; each
    runs on both nodes and equals the oracle of the whole global batch."""
    specs = {
        "exact": tiny_spec(
            tmp_path / "exact", steps=4, num_microbatches=4, plan="F[0:2,2:4] T[4:6] B[2:4,0:2]"
        ),
        "stale": tiny_spec(tmp_path / "stale", steps=4, staleness=1, num_microbatches=4),
        "lora": tiny_spec(tmp_path / "lora", steps=4, num_microbatches=4, lora=LORA),
    }
    with node_group(tmp_path, "mn-exact") as (rank0, rank1):
        handles = {name: rank0.client.submit(spec) for name, spec in specs.items()}
        for name, handle in handles.items():
            events = list(handle.progress(timeout_s=300))
            status = handle.wait(timeout_s=300)
            assert status.state == "succeeded", f"{name}: {status.message}\n{rank0.logs()}"
            assert [e.step for e in events] == [1, 2, 3, 4]
        # The other node ran every job, its half of each batch.
        ran = {j.job_id: j.state for j in rank1.client.jobs()}
        assert ran == {h.job_id: "succeeded" for h in handles.values()}, rank1.logs()
        log = (rank1.state_dir / "jobs" / handles["exact"].job_id / "job.log").read_text()
        assert "plan" in log
    for name, spec in specs.items():
        lora = name == "lora"
        assert_params_match(load_output(Path(spec.output.dir), lora), oracle(spec, lora))
