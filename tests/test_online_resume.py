"""Resume: a checkpoint between generations continues the run exactly (weights, rollouts)."""

from __future__ import annotations

import pytest
import torch

from helpers import compose_train
from lightning_vlm.training import train

# DAPO's dynamic sampling: pools of 4 prompts in 2 rounds (extra rounds draw from their own seeds)
DYNAMIC = ["method.dynamic_sampling={enabled:true,max_num_gen_batches:2}", "data.batch_size=4",
           "data.synthetic.num_train=8"]  # fmt: skip
# Skywork-OR1's adaptive entropy coefficient: controller state that the checkpoint must carry (a target
# above the policy's entropy, so the coefficient moves every step)
ADAPTIVE = ["method.use_adaptive_entropy=true", "method.entropy_target=5.0", "method.entropy_coef_delta=0.01",
            "method.entropy_coef_max=0.1"]  # fmt: skip
EXTRA = {"grpo": (), "dynamic_sampling": tuple(DYNAMIC), "adaptive_entropy": tuple(ADAPTIVE)}


def _run(tmp_path, warm: str, steps: int, ckpt_path: str | None = None, save: str | None = None,
         extra: tuple[str, ...] = ()):  # fmt: skip
    cfg = compose_train(
        [
            "method=grpo",
            f"model.model_name_or_path={warm}",
            "logger=none",
            "callbacks=none",
            f"trainer.max_steps={steps}",
            "trainer.limit_val_batches=0",
            "trainer.enable_progress_bar=false",
            "method.num_generations=4",
            "method.max_completion_length=4",
            "method.steps_per_generation=2",
            "data.batch_size=2",
            # Lightning restarts a plain DataLoader at its epoch's start, so the checkpoint is taken at an
            # epoch boundary (2 batches); mid-epoch data position needs a stateful loader (DataModule's job).
            "data.synthetic.num_train=4",
            "data.shuffle=false",
            *([f"ckpt_path={ckpt_path}"] if ckpt_path else []),
            *extra,
        ],
        tmp_path,
    )
    seen: list[list[int]] = []
    _, out = _train_recording(cfg, seen)
    if save:
        out["trainer"].save_checkpoint(save)
    params = {n: p.detach().clone() for n, p in out["module"].vlm.named_parameters()}
    params["completions_generated"] = torch.tensor(out["module"].completions_generated)
    params["entropy_coef"] = torch.tensor(out["module"].entropy_coef)
    return params, seen


def _train_recording(cfg, seen):
    # Record every generation's completions to compare rollouts, not only the final weights.
    from lightning_vlm.methods.online import OnlineRL

    original = OnlineRL.score

    def score(self, rollouts):
        seen.append([tok for ids in rollouts.completion_ids for tok in ids])
        return original(self, rollouts)

    OnlineRL.score = score
    try:
        return train(cfg)
    finally:
        OnlineRL.score = original


@pytest.mark.parametrize("variant", list(EXTRA))
def test_resume_matches_an_uninterrupted_run(tmp_path, sft_warm_start, variant):
    # train() loads checkpoints with weights_only=True: hparams are plain values (instantiate _convert_="all")
    warm = sft_warm_start()
    ckpt = str(tmp_path / "mid.ckpt")
    extra, dynamic = EXTRA[variant], variant == "dynamic_sampling"
    # Two optimizer steps per generation: 4 steps = 2 generations (one epoch), then one more generation.
    _, first = _run(tmp_path / "a", warm, 4, save=ckpt, extra=extra)
    resumed, second = _run(tmp_path / "b", warm, 6, ckpt_path=ckpt, extra=extra)
    straight, whole = _run(tmp_path / "c", warm, 6, extra=extra)
    if not dynamic:
        assert len(first) == 2 and len(second) == 1 and len(whole) == 3
    else:  # each generation runs one or two rounds
        assert len(first) >= 2 and len(second) >= 1 and len(whole) == len(first) + len(second)
    assert first + second == whole, "a resumed run must draw the same prompts and completions"
    for name, value in straight.items():
        torch.testing.assert_close(resumed[name], value, atol=1e-6, rtol=1e-5, msg=name)
    if variant == "adaptive_entropy":
        # 6 steps of +0.01 from 0: the resumed run carried on from the checkpoint's 0.04
        assert straight["entropy_coef"].item() == pytest.approx(0.06)
