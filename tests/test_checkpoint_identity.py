"""A checkpoint remembers which method wrote it and which reference model it trained against, so that a
resume or an evaluation with other ones is refused instead of silently continuing (another method whose
weight names match: SFT into GRPO) or scoring against another reference (DPO's frozen copy comes from
``model.model_name_or_path``, which the checkpoint does not hold)."""

from __future__ import annotations

import copy
import logging
import shutil

import pytest
import torch

from helpers import compose_train
from lightning_vlm.evaluation import evaluate
from lightning_vlm.models.tiny import tiny_vlm_path
from lightning_vlm.models.vlm import VLM
from lightning_vlm.training import train

RUN = [
    "logger=none", "trainer.enable_progress_bar=false", "callbacks=model_checkpoint", "tiny_start=random",
    "data.batch_size=2", "data.synthetic.num_train=8", "data.synthetic.num_val=4", "data.val_batch_size=4",
    "trainer.limit_val_batches=0", "trainer.max_steps=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def dpo_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("identity")
    train(compose_train([*RUN, "method=dpo"], root / "dpo"))
    return root, root / "dpo" / "checkpoints" / "last.ckpt"


def test_another_methods_checkpoint_is_refused_even_when_its_weights_fit(dpo_ckpt, tmp_path):
    root, _ = dpo_ckpt
    train(compose_train([*RUN, "method=sft"], root / "sft"))
    sft = root / "sft" / "checkpoints" / "last.ckpt"
    # GRPO's weights are SFT's by name: Lightning restored it, SFT's optimizer and step included.
    resume = [*RUN, "method=grpo", "trainer.max_steps=3", f"ckpt_path={sft}"]
    with pytest.raises(
        ValueError, match=rf"ckpt_path='{sft}' was written by SFT, and this run's method is GRPO.*export"
    ):
        train(compose_train(resume, tmp_path / "grpo"))


def test_a_reference_other_than_trainings_is_refused(dpo_ckpt, tmp_path):
    root, ckpt = dpo_ckpt
    tiny = str(tiny_vlm_path("qwen2_5_vl"))
    other = tmp_path / "other_start"
    vlm = VLM(tiny)
    with torch.no_grad():
        for p in vlm.model.parameters():
            p.add_(0.01)
    vlm.save_pretrained(other)
    moved = tmp_path / "moved_start"
    shutil.copytree(tiny, moved)
    message = r"trained against a reference model with other weights .*model.model_name_or_path"
    for run in ("train", "eval"):
        overrides = [*RUN, "method=dpo", f"model.model_name_or_path={other}", f"ckpt_path={ckpt}"]
        with pytest.raises(ValueError, match=message):
            if run == "train":
                train(compose_train([*overrides, "trainer.max_steps=2"], tmp_path / run))
            else:
                evaluate(compose_train([*overrides, "trainer.limit_val_batches=1"], tmp_path / run, "eval"))
    # The same weights in another folder (a run moved to another machine) are the same reference.
    same = [
        *RUN,
        "method=dpo",
        f"model.model_name_or_path={moved}",
        f"ckpt_path={ckpt}",
        "trainer.max_steps=2",
    ]
    _, out = train(compose_train(same, tmp_path / "moved"))
    assert out["trainer"].global_step == 2


def test_a_dtype_cast_is_the_same_reference_and_a_change_is_not(tiny_path):
    # A run trained in float16 (a T4) and resumed in float32 has one reference: a digest of values rounded to
    # bfloat16 refused it (fp16's rounding, then bf16's, lands on other values near a rounding boundary).
    from lightning_vlm.models.reference import same_weights, sampled_weights

    model = VLM(tiny_path("gemma3")).model
    with torch.no_grad():
        model.get_input_embeddings().weight[0, :4] = torch.tensor([1e-6, 3.3e-5, 0.1000061, -2.0004])
    ours = sampled_weights(model)
    for dtype in (torch.float16, torch.bfloat16):
        assert same_weights(ours, sampled_weights(copy.deepcopy(model).to(dtype)))
    with torch.no_grad():
        model.get_input_embeddings().weight[0, 1] += 0.01
    assert not same_weights(ours, sampled_weights(model))


def test_an_optimizer_setting_a_resume_cannot_apply_is_named(dpo_ckpt, tmp_path, caplog):
    # Lightning restores the checkpoint's optimizer state, lr included: method.optimizer.lr on a resume
    # changed nothing, silently
    root, _ = dpo_ckpt
    train(compose_train([*RUN, "method=sft"], root / "sft_lr"))
    ckpt = root / "sft_lr" / "checkpoints" / "last.ckpt"
    resume = [*RUN, "method=sft", "trainer.max_steps=2", f"ckpt_path={ckpt}"]
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        _, out = train(compose_train([*resume, "method.optimizer.lr=1e-5"], tmp_path / "a"))
    (warning,) = [r.getMessage() for r in caplog.records if "not applied" in r.getMessage()]
    assert "method.optimizer.lr=1e-05" in warning and "0.001" in warning
    assert out["trainer"].optimizers[0].param_groups[0]["lr"] == 0.001  # as the warning says
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        train(compose_train(resume, tmp_path / "b"))
    assert not [r for r in caplog.records if "not applied" in r.getMessage()]
    # A scheduler rewrites the stored lr and betas (OneCycleLR: lr 4e-7 after its warm-up starts, beta1
    # cycled): the same settings resumed are no change
    cycle = [
        "method.scheduler={_target_:torch.optim.lr_scheduler.OneCycleLR,_partial_:true,max_lr:0.001,total_steps:4}"
    ]
    train(compose_train([*RUN, "method=sft", *cycle], root / "sft_cycle"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        ckpt = root / "sft_cycle" / "checkpoints" / "last.ckpt"
        train(
            compose_train(
                [*RUN, "method=sft", *cycle, "trainer.max_steps=2", f"ckpt_path={ckpt}"], tmp_path / "c"
            )
        )
    assert not [r for r in caplog.records if "not applied" in r.getMessage()]


def test_a_schedule_a_resume_cannot_apply_is_named(dpo_ckpt, tmp_path, caplog):
    # Lightning restores the scheduler's whole state, its length too: a finished run resumed with a larger
    # max_steps stayed at the end of its old LinearLR decay (lr 0) and trained nothing, silently
    root, _ = dpo_ckpt
    decay = [
        "method.scheduler={_target_:torch.optim.lr_scheduler.LinearLR,_partial_:true,start_factor:1.0,"
        "end_factor:0.0,total_iters:${trainer.max_steps}}"
    ]
    train(compose_train([*RUN, "method=sft", *decay], root / "sft_decay"))
    resume = [*RUN, "method=sft", *decay, f"ckpt_path={root / 'sft_decay' / 'checkpoints' / 'last.ckpt'}"]
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        _, out = train(compose_train([*resume, "trainer.max_steps=3"], tmp_path / "a"))
    (warning,) = [
        r.getMessage() for r in caplog.records if "scheduler settings are not applied" in r.getMessage()
    ]
    assert "total_iters=3 (checkpoint: 1)" in warning and "last learning rate: 0)" in warning, warning
    assert out["trainer"].optimizers[0].param_groups[0]["lr"] == 0.0  # as the warning says
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):  # the same schedule: nothing to say
        train(compose_train([*resume, "trainer.max_steps=1"], tmp_path / "b"))
    assert not [r for r in caplog.records if "not applied" in r.getMessage()]


def test_method_settings_changed_since_the_checkpoint_are_named(dpo_ckpt, tmp_path, caplog):
    # method.beta or loss_type changed on a resume applied from the resumed step on, without a word: the
    # run's results were those of neither setting.
    _, ckpt = dpo_ckpt
    resume = [*RUN, "method=dpo", "trainer.max_steps=2", f"ckpt_path={ckpt}"]
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        train(compose_train([*resume, "method.beta=0.25", "method.loss_type=[sigmoid,sft]"], tmp_path / "a"))
    (warning,) = [
        r.getMessage() for r in caplog.records if "trained with other method settings" in r.getMessage()
    ]
    stored = torch.load(ckpt, map_location="cpu", weights_only=True)["hyper_parameters"]["beta"]
    assert stored != 0.25 and f"method.beta=0.25 (checkpoint: {stored!r})" in warning
    assert "method.loss_type=['sigmoid', 'sft'] (checkpoint: ['sigmoid'])" in warning
    assert "label_smoothing" not in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        train(compose_train(resume, tmp_path / "b"))
    assert "trained with other method settings" not in caplog.text


def test_a_resume_or_an_evaluation_with_another_image_budget_is_named(dpo_ckpt, tmp_path, caplog):
    # data.image_max_pixels changed since the checkpoint: the weights meet other pixels (often other image
    # tokens) than they trained on. The DPO checkpoint was trained with no budget (the default).
    _, ckpt = dpo_ckpt
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        train(compose_train([*RUN, "method=dpo", "trainer.max_steps=2", f"ckpt_path={ckpt}",
                             "data.image_max_pixels=3136"], tmp_path / "a"))  # fmt: skip
        evaluate(compose_train([*RUN, "method=dpo", f"ckpt_path={ckpt}", "data.image_min_pixels=20000",
                                "trainer.limit_val_batches=1"], tmp_path / "eval", "eval"))  # fmt: skip
    warned = [r.getMessage() for r in caplog.records if "another pixel budget" in r.getMessage()]
    assert len(warned) == 2, warned
    assert "data.image_max_pixels=3136 (checkpoint: None)" in warned[0]
    assert "data.image_min_pixels=20000 (checkpoint: None)" in warned[1]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        train(compose_train([*RUN, "method=dpo", "trainer.max_steps=2", f"ckpt_path={ckpt}"], tmp_path / "b"))
    assert "another pixel budget" not in caplog.text
