"""float16 dynamic loss scaling (Note [dynamic loss scaling] in
roundpipe.coordinator.training.loss_scale), against torch's GradScaler.

The oracle is a plain loop: fp32 masters, a float16 copy that takes each microbatch's
backward of the scaled loss (its gradients summed in fp32, as a worker writes them),
``GradScaler`` unscaling, skipping and updating, AdamW on the masters, and the learning
rate stepped only by updates applied (as the Hugging Face Trainer does when GradScaler
skips). The jobs start at a scale far too large, so that the first steps overflow and
are skipped, and grow it every few steps, so that it overflows again later.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from runtime_helpers import assert_params_match, tiny_spec, trained_in_process

from roundpipe.cluster import LocalCluster
from roundpipe.coordinator.spec.checkpoint_format import MANIFEST
from roundpipe.coordinator.spec.data import DataLoader, build_dataset_from_spec
from roundpipe.coordinator.spec.errors import JobSpecError
from roundpipe.coordinator.spec.jobspec import JobSpec, model_config_from_spec
from roundpipe.coordinator.training.checkpoint import CheckpointDir
from roundpipe.coordinator.training.optimizer import LRSchedule, decays
from roundpipe.shared.model import LayeredModel, count_label_tokens

INITIAL = 2**24
GROWTH = 3


def scaled_spec(output: Path, **kw) -> JobSpec:
    train = {"loss_scale_initial": INITIAL, "loss_scale_growth_interval": GROWTH}
    train.update(kw.pop("train", {}))
    return tiny_spec(output, dtype="float16", train=train, **kw)


def grad_scaler_loop(spec: JobSpec) -> tuple[dict[str, torch.Tensor], list[bool], float]:
    """The oracle (module docstring): final masters by name, whether each step was
    applied, and the scale after the last step. Staleness 0."""
    assert spec.train.staleness == 0 and spec.lora is None
    layered = LayeredModel(model_config_from_spec(spec.model), None)
    master = layered.to_hf_model(layered.init_weights(spec.init_seed))
    compute = layered.to_hf_model(layered.init_weights(spec.init_seed)).to(torch.float16)
    params = dict(master.named_parameters())
    compute_params = dict(compute.named_parameters())
    o = spec.optimizer
    groups = [
        {"params": [p for n, p in params.items() if decays(n, o.no_decay)]},
        {
            "params": [p for n, p in params.items() if not decays(n, o.no_decay)],
            "weight_decay": 0.0,
        },
    ]
    opt = torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
        weight_decay=o.weight_decay,
        fused=True,
    )
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=float(spec.train.loss_scale_initial),
        growth_interval=spec.train.loss_scale_growth_interval,
    )
    schedule = LRSchedule.from_spec(o, spec.train.steps)
    loader = DataLoader.from_spec(spec, build_dataset_from_spec(spec))
    applied: list[bool] = []
    for k in range(1, spec.train.steps + 1):
        with torch.no_grad():
            for n, p in compute_params.items():
                p.copy_(params[n])
        batch = loader.batch_for_step(k)
        sums = {n: torch.zeros_like(p) for n, p in params.items()}
        for (ids, labels), pos in zip(batch.microbatches, batch.microbatch_position_ids):
            compute.zero_grad(set_to_none=True)
            out = compute(input_ids=ids, labels=labels, position_ids=pos, use_cache=False)
            loss = out.loss.float() * (count_label_tokens(labels) / batch.num_label_tokens)
            scaler.scale(loss).backward()
            for n, p in compute_params.items():
                if p.grad is not None:
                    sums[n] += p.grad.float()
        for n, p in params.items():
            p.grad = sums[n]
        before = scaler.get_scale()
        scaler.unscale_(opt)
        for group in opt.param_groups:
            group["lr"] = schedule.lr_at(sum(applied) + 1)
        scaler.step(opt)
        scaler.update()
        applied.append(scaler.get_scale() >= before)
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in params.items()}, applied, scaler.get_scale()


def applied_steps(log_text: str, steps: int) -> list[bool]:
    """Which steps a job applied, from its log's skip lines."""
    skipped = {
        int(line.split("step ")[1].split("'s")[0])
        for line in log_text.splitlines()
        if "gradients overflowed at loss scale" in line
    }
    return [k not in skipped for k in range(1, steps + 1)]


def test_loss_scaling_skips_the_steps_grad_scaler_skips_and_trains_as_it_does(
    tmp_path: Path, arena_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = scaled_spec(tmp_path / "out", steps=14)
    caplog.set_level("INFO", logger="roundpipe")
    with trained_in_process(spec, arena_dir, 2) as trainer:
        weights = {n: t.clone() for per in trainer.final_weights().values() for n, t in per.items()}
        scaler = trainer.loss_scaler
        assert scaler is not None
        final_scale, updates = 2.0**scaler.exponent, scaler.updates
    oracle, applied, oracle_scale = grad_scaler_loop(spec)
    # The test means something only if steps were skipped, at the start and later on.
    assert not applied[0] and applied[-3:].count(True) >= 1 and False in applied[4:], applied
    assert applied_steps(caplog.text, spec.train.steps) == applied
    assert (final_scale, updates) == (oracle_scale, sum(applied))
    assert_params_match(weights, oracle, rtol=2e-3)
    latest = CheckpointDir(tmp_path / "out" / "checkpoints").find_latest("job-ip")
    manifest = json.loads((latest.path / MANIFEST).read_text())
    assert manifest["loss_scale"]["updates"] == sum(applied)
    assert manifest["optimizer"]["steps"]["0"] == sum(applied)
    assert manifest["loss_scale"]["scale"] == int(oracle_scale)


def test_float16_gradients_are_near_float32_s_only_with_loss_scaling(
    tmp_path: Path, arena_dir: Path
) -> None:
    """What loss scaling is for: at 6,144 tokens a step, a step's float16 gradients lose
    much of their precision unscaled (d loss / d logits is divided by the tokens, and
    the activation gradients behind it fall into float16's subnormal range); scaled,
    they are six times closer to float32's."""
    grads = {}
    for name, dtype, scale in [
        ("fp32", "float32", "auto"),
        ("none", "float16", "none"),
        ("dynamic", "float16", "dynamic"),
    ]:
        spec = tiny_spec(
            tmp_path / name,
            steps=1,
            dtype=dtype,
            seq_len=256,
            microbatch_size=8,
            train={"loss_scale": scale, "loss_scale_initial": 2**10},
            optimizer={"warmup_steps": 0},
        )
        with trained_in_process(spec, arena_dir, 1, job_id=f"job-{name}") as trainer:
            assert trainer.layout is not None
            layout = trainer.layout
            # After the step, the slots hold the gradients as the optimizer took them:
            # a scaled job's multiplied by 1 / S in place.
            grads[name] = torch.cat(
                [
                    layout.view(ref).flatten()
                    for layer in sorted(layout.grads)
                    for ref in layout.grads[layer].values()
                ]
            )
    error = {
        name: float((grads[name] - grads["fp32"]).norm() / grads["fp32"].norm())
        for name in ("none", "dynamic")
    }
    assert error["dynamic"] * 4 < error["none"], error


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_loss_scaled_job_resumes_as_the_uninterrupted_one(
    tmp_path: Path, arena_dir: Path, staleness: int
) -> None:
    """The scale, the steps since it changed and the updates applied are in the
    checkpoint: a job resumed after step 6 (skipped steps before it, a growth pending)
    ends bitwise where the uninterrupted one does."""
    from test_resume import train

    def spec(out: Path, steps: int) -> JobSpec:
        d = scaled_spec(out, steps=steps, staleness=staleness).to_dict()
        d["output"].update(checkpoint_every=3, keep_last=5)
        return JobSpec.from_dict(d)

    whole = train(spec(tmp_path / "whole", 10), arena_dir, job_id="job-whole")
    assert train(spec(tmp_path / "part", 10), arena_dir, job_id="job-part", stop_after=6) is None
    resumed = train(spec(tmp_path / "part", 10), arena_dir, job_id="job-part")
    assert whole is not None and resumed is not None
    assert resumed[1] == whole[1]
    different = [n for n in whole[0] if not torch.equal(whole[0][n], resumed[0][n])]
    assert not different, different


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"loss_scale": "dynamic"}, "train.loss_scale"),
        ({"dtype": "float16", "loss_scale": "always"}, "train.loss_scale"),
        ({"dtype": "float16", "loss_scale_initial": 1000}, "a power of two"),
        ({"dtype": "float16", "loss_scale_initial": 2**33}, "a power of two"),
        ({"dtype": "float16", "loss_scale_growth_interval": 0}, "loss_scale_growth_interval"),
    ],
)
def test_bad_loss_scale_settings_are_refused(tmp_path: Path, train: dict, message: str) -> None:
    with pytest.raises(JobSpecError, match=message):
        tiny_spec(tmp_path, train=train)


@pytest.mark.slow
def test_a_float16_job_on_real_daemons_skips_its_overflowing_steps(
    tmp_path: Path, arena_dir: Path
) -> None:
    """A user's float16 job through the coordinator and two CPU worker processes: its
    metrics show the scale and the steps skipped while it runs (held before step 6), it
    succeeds, its job log names the skipped steps, and its checkpoint holds the scale."""
    from test_observability import metrics_url, one, scrape

    from roundpipe.coordinator.training.hold_point import hold_env

    spec = scaled_spec(tmp_path / "out", steps=8)
    release = tmp_path / "go"
    cluster = LocalCluster(
        tmp_path / "c",
        arena_dir,
        coordinator_args=["--metrics-address", "127.0.0.1:0"],
        env=hold_env(6, release),
    )
    try:
        cluster.add_worker("w1")
        cluster.add_worker("w2")
        job = cluster.client.submit(spec)
        deadline = time.monotonic() + 240
        while job.status().step < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        held = scrape(metrics_url(cluster))
        release.touch()
        status = job.wait(timeout_s=240)
        assert status.state == "succeeded", cluster.logs()
        log_text = cluster.client.job_log(job.job_id).text
    finally:
        cluster.stop()
    assert "step 1's gradients overflowed at loss scale 1.67772e+07" in log_text, log_text
    applied = applied_steps(log_text, 8)
    # Held before step 6: steps 1-5 are decided (the optimizer of step 5 may still run).
    skipped_by_5 = applied[:5].count(False)
    assert one(held, "roundpipe_job_skipped_steps_total", job=job.job_id) in (
        skipped_by_5 - 1,
        skipped_by_5,
    )
    assert one(held, "roundpipe_job_loss_scale", job=job.job_id) < INITIAL
    latest = CheckpointDir(tmp_path / "out" / "checkpoints").find_latest(job.job_id)
    manifest = json.loads((latest.path / MANIFEST).read_text())
    assert manifest["loss_scale"]["updates"] == sum(applied) < 8


@pytest.mark.slow
def test_a_task_rerun_after_its_step_was_decided_runs_on(tmp_path: Path, arena_dir: Path) -> None:
    """At staleness 1 a step's scale counter names a later step as soon as the step is
    decided. A backward task that writes no gradient (B[0:1]: LoRA's frozen embedding)
    can be rerun after that, its worker lost: the rerun refused that scale and failed
    the job three times over; its results are read by nothing, so any scale does."""
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    spec = tiny_spec(
        tmp_path / "out",
        steps=6,
        dtype="float16",
        staleness=1,
        lora=lora,
        plan="F[0:2] T[2:6] B[1:2,0:1]",
    )
    fault = "kill@iteration=3,kind=backward,layer=0,when=end"
    cluster = LocalCluster(tmp_path / "c", arena_dir)
    try:
        cluster.add_worker("w1", fault=fault)
        cluster.add_worker("w2", fault=fault)
        job = cluster.client.submit(spec)
        status = job.wait(timeout_s=240)
        log_text = cluster.client.job_log(job.job_id).text
    finally:
        cluster.stop()
    assert status.state == "succeeded", status.message
    assert "re-dispatching" in log_text, log_text


def test_tensorboard_s_gradient_norm_is_the_unscaled_one(tmp_path: Path, arena_dir: Path) -> None:
    """train/grad_norm was S times the true norm (65536 times at the default scale)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    norms = {}
    for name, dtype in (("fp32", "float32"), ("fp16", "float16")):
        raw = tiny_spec(
            tmp_path / name, steps=3, dtype=dtype, train={"loss_scale_initial": 2**10}
        ).to_dict()
        raw["output"]["tensorboard"] = True
        with trained_in_process(JobSpec.from_dict(raw), arena_dir, 1, job_id=f"job-{name}"):
            pass
        events = EventAccumulator(str(tmp_path / name / "tensorboard"))
        events.Reload()
        norms[name] = [s.value for s in events.Scalars("train/grad_norm")]
    assert len(norms["fp16"]) == 3
    assert norms["fp16"] == pytest.approx(norms["fp32"], rel=1e-2), norms
