"""TR-DPO's reference syncs (callbacks/reference_sync.py, TRL's sync_ref_model): the update by hand, the
steps it runs at (accumulated and online runs), the checkpoint that carries the moved reference, and the
settings it refuses. Two processes (DDP and FSDP) are in test_ddp_equivalence.py ("dpo_ref_sync"), learning
in test_dpo_learns.py."""

from __future__ import annotations

import inspect

import hydra
import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

from helpers import CONF, SYNC_REF, compose_train
from lightning_vlm.callbacks.reference_sync import ReferenceSync
from lightning_vlm.methods.reference_state import KEY
from lightning_vlm.models.reference import mix_weights_
from lightning_vlm.training import train

QUIET = ["logger=none", "callbacks=none", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false"]
RECORD = "+callbacks.record._target_=test_reference_sync.RecordSteps"
SGD = ["method.optimizer._target_=torch.optim.SGD", "method.optimizer.lr=0.5"]


def test_the_mix_is_tr_dpo_soft_update_by_hand():
    policy, reference = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with torch.no_grad():
        policy.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        reference.weight.copy_(torch.tensor([[0.0, 2.0], [-1.0, 8.0]]))
    bias = reference.bias.detach().clone()
    mix_weights_(reference, {"weight": policy.weight}, 0.25)  # the bias not named: it stays
    # 0.25 * policy + 0.75 * reference
    expected = torch.tensor([[0.25, 2.0], [0.0, 7.0]])
    torch.testing.assert_close(reference.weight.detach(), expected, rtol=0, atol=0)
    assert torch.equal(reference.bias, bias)
    mix_weights_(reference, {"weight": policy.weight}, 1.0)  # the hard update: a copy
    assert torch.equal(reference.weight, policy.weight)
    with pytest.raises(ValueError, match="no weights named"):
        mix_weights_(reference, {"0.weight": policy.weight}, 0.5)


def test_a_sync_mixes_the_weights_the_policy_trains_only(tmp_path):
    module = _module(["method=dpo", "model.freeze_vision_tower=true"], tmp_path)
    frozen = {n for n, p in module.vlm.hf_model.named_parameters() if not p.requires_grad}
    assert frozen and len(frozen) < len(dict(module.vlm.hf_model.named_parameters()))
    with torch.no_grad():
        for p in module.vlm.hf_model.parameters():
            p.add_(1.0)  # the policy moved everywhere, even where it cannot train
    before = {n: p.detach().clone() for n, p in module.ref.copy.named_parameters()}
    module.ref.mix_in_policy(0.5)
    policy = dict(module.vlm.hf_model.named_parameters())
    for name, value in module.ref.copy.named_parameters():
        expected = before[name] if name in frozen else 0.5 * before[name] + 0.5 * policy[name]
        torch.testing.assert_close(value.detach(), expected, rtol=0, atol=1e-7, msg=name)
    assert module.ref.moved and module.ref.moved_weights() is not None


@pytest.mark.parametrize(("alpha", "steps"), [(0.0, 1), (1.5, 1), (0.5, 0), (0.5, 2.5), (0.5, True)])
def test_bad_settings_are_refused_naming_them(alpha, steps):
    with pytest.raises(ValueError, match="callbacks.sync_ref"):
        ReferenceSync(mixup_alpha=alpha, sync_steps=steps)


def test_the_config_holds_trl_defaults_and_builds_the_callback(tmp_path):
    node = yaml.safe_load((CONF / "callbacks" / "sync_ref.yaml").read_text())["sync_ref"]
    signature = inspect.signature(ReferenceSync).parameters
    assert (
        {k: v for k, v in node.items() if k != "_target_"}
        == {"mixup_alpha": signature["mixup_alpha"].default, "sync_steps": signature["sync_steps"].default}
        == {"mixup_alpha": 0.6, "sync_steps": 512}
    )  # TRL's ref_model_mixup_alpha and ref_model_sync_steps
    cfg = compose_train(
        ["method=dpo", "callbacks=[default,sync_ref]", "callbacks.sync_ref.sync_steps=64"], tmp_path
    )
    sync = hydra.utils.instantiate(cfg.callbacks.sync_ref)
    assert isinstance(sync, ReferenceSync) and (sync.mixup_alpha, sync.sync_steps) == (0.6, 64)


class RecordSteps(L.Callback):
    """After every optimizer step (a hook registered after ReferenceSync's, so it runs after the mix): the
    step, the policy's trainable weights and the reference copy's weights of the same names."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, dict, dict]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        policy = pl_module.vlm.hf_model
        names = [n for n, p in policy.named_parameters() if p.requires_grad]
        self.start = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}

        def record(*_) -> None:
            ours, ref = dict(policy.named_parameters()), dict(pl_module.ref.copy.named_parameters())
            self.steps.append((trainer.global_step + 1, {n: ours[n].detach().clone() for n in names},
                               {n: ref[n].detach().clone() for n in names}))  # fmt: skip

        for optimizer in trainer.optimizers:
            optimizer.register_step_post_hook(record)


def _check_syncs(overrides: list[str], alpha: float, every: int, steps: int, tmp_path) -> None:
    """Trains ``steps`` optimizer steps with a sync every ``every`` at ``alpha``; after each step the reference
    must be the hand-computed mix of the policies recorded at the sync steps."""
    cfg = compose_train([*QUIET, *SGD, *overrides, "data.batch_size=2", f"trainer.max_steps={steps}", SYNC_REF,
                         f"+callbacks.sync_ref.sync_steps={every}", f"+callbacks.sync_ref.mixup_alpha={alpha}",
                         RECORD], tmp_path)  # fmt: skip
    _, out = train(cfg)
    record = next(c for c in out["trainer"].callbacks if isinstance(c, RecordSteps))
    assert [s for s, _, _ in record.steps] == list(range(1, steps + 1))
    expected = record.start  # the reference starts as the initial policy
    for step, policy, reference in record.steps:
        if step % every == 0:
            expected = {n: alpha * policy[n] + (1 - alpha) * expected[n] for n in expected}
        for name, value in expected.items():
            torch.testing.assert_close(reference[name], value, msg=f"step {step}: {name}")
    moved = max((record.steps[-1][1][n] - record.start[n]).abs().max().item() for n in record.start)
    assert moved > 1e-3, f"the policy hardly moved ({moved:.1e}): the check would be vacuous"


def test_dpo_syncs_after_every_second_whole_step_of_accumulated_batches(tmp_path):
    _check_syncs(
        ["method=dpo", "trainer.accumulate_grad_batches=2"], 0.5, every=2, steps=4, tmp_path=tmp_path
    )


def test_grpo_syncs_between_the_optimizer_steps_of_one_generation(tmp_path):
    # 2 optimizer steps per generation: step 3's sync falls inside the second training_step.
    grpo = ["method=grpo", "method.beta=0.1", "method.num_generations=4", "method.max_completion_length=4",
            "method.steps_per_generation=2", "method.reward_funcs=[online_helpers.token_reward_fn]"]  # fmt: skip
    _check_syncs(grpo, 0.7, every=3, steps=4, tmp_path=tmp_path)


def test_a_resumed_run_continues_from_the_synced_reference(tmp_path):
    common = [*QUIET, *SGD, "method=dpo", "data.batch_size=2", "data.synthetic.num_train=32", SYNC_REF,
              "+callbacks.sync_ref.sync_steps=2", "+callbacks.sync_ref.mixup_alpha=0.5"]  # fmt: skip
    _, straight = train(compose_train([*common, "trainer.max_steps=6"], tmp_path / "a"))
    ckpt = tmp_path / "b" / "ckpt"
    train(compose_train([*common, "trainer.max_steps=3", "+callbacks.ckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint",
                         f"+callbacks.ckpt.dirpath={ckpt}", "+callbacks.ckpt.every_n_train_steps=3",
                         "+callbacks.ckpt.filename=mid"], tmp_path / "b"))  # fmt: skip
    saved = torch.load(ckpt / "mid.ckpt", weights_only=True)
    assert KEY in saved  # synced at step 2: the checkpoint of step 3 holds the moved copy
    start = dict(_module(["method=dpo"], tmp_path / "start").ref.copy.named_parameters())
    moved = max((saved[KEY][n] - p).abs().max().item() for n, p in start.items())
    assert moved > 1e-3, f"the saved reference hardly moved ({moved:.1e}): the comparison would be vacuous"
    _, resumed = train(
        compose_train([*common, "trainer.max_steps=6", f"ckpt_path={ckpt / 'mid.ckpt'}"], tmp_path / "c")
    )
    for part in ("policy", "reference"):
        a, b = (
            dict(
                run["module"].vlm.hf_model.named_parameters()
                if part == "policy"
                else run["module"].ref.copy.named_parameters()
            )
            for run in (straight, resumed)
        )
        for name, value in a.items():
            torch.testing.assert_close(b[name], value, rtol=1e-5, atol=1e-6, msg=f"{part}: {name}")


def _module(overrides: list[str], tmp_path) -> L.LightningModule:
    cfg = compose_train([*QUIET, *overrides], tmp_path)
    return hydra.utils.instantiate(cfg.method, vlm=hydra.utils.instantiate(cfg.model))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["method=sft"], "SFT trains without one"),
        (["method=grpo", "method.beta=0.0"], "GRPO trains without one"),
        (["method=dpo", "method.precompute_ref_logps=true"], "precompute_ref_logps"),
        (["method=dpo", "lora=default"], "LoRA"),
    ],
    ids=["sft", "grpo_beta_0", "dpo_precomputed", "dpo_lora"],
)
def test_methods_without_a_frozen_reference_are_refused(overrides, match, tmp_path):
    module = _module(overrides, tmp_path)
    with pytest.raises(ValueError, match=match):
        ReferenceSync().check(DDPStrategy(), module)


@pytest.mark.parametrize(
    "overrides",
    [
        ["method=dpo"],
        ["method=mpo"],
        ["method=kto"],
        ["method=grpo", "method.beta=0.1"],
        ["method=rloo"],
        ["method=online_dpo"],
    ],  # fmt: skip
    ids=["dpo", "mpo", "kto", "grpo", "rloo", "online_dpo"],
)
def test_every_method_with_a_frozen_reference_is_synced(overrides, tmp_path):
    module = _module(overrides, tmp_path)
    assert ReferenceSync().check(DDPStrategy(), module) is module.ref


def test_deepspeed_is_refused(tmp_path):
    module = _module(["method=dpo"], tmp_path)
    assert ReferenceSync().check(FSDPStrategy(), module) is module.ref  # FSDP gathers for the mix
    with pytest.raises(ValueError, match="not DeepSpeed"):
        ReferenceSync().check(DeepSpeedStrategy(), module)


@pytest.mark.parametrize(
    "overrides", [["lora=default"], ["method.precompute_ref_logps=true"]], ids=["lora", "precomputed"]
)
def test_a_synced_checkpoint_is_refused_by_a_run_without_a_frozen_copy(overrides, tmp_path):
    module = _module(["method=dpo", *overrides], tmp_path)
    with pytest.raises(ValueError, match="synced with the policy"):
        module.on_load_checkpoint({KEY: {"weight": torch.zeros(1)}})


@pytest.mark.parametrize(
    "overrides",
    [
        ["method=kto"],
        [
            "method=online_dpo",
            "method.num_candidates=2",
            "method.max_completion_length=4",
            "method.reward_funcs=[online_helpers.token_reward_fn]",
        ],
    ],  # fmt: skip
    ids=["kto", "online_dpo"],
)
def test_kto_and_online_dpo_sync_at_their_steps(overrides, tmp_path):
    _check_syncs(overrides, 0.5, every=2, steps=3, tmp_path=tmp_path)


def test_a_refused_run_stops_before_its_first_step(tmp_path):
    cfg = compose_train([*QUIET, "method=dpo", "lora=default", "trainer.max_steps=2", SYNC_REF], tmp_path)
    with pytest.raises(ValueError, match="LoRA"):
        train(cfg)
