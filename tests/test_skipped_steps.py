"""fp16 steps the gradient scaler skips for overflow do not advance the learning-rate schedule (HF Trainer's
rule; Lightning steps the scheduler after every step), for a method Lightning optimises (SFT) and for one
that steps by hand (GRPO). CPU autocast takes float16 with a scaler given as a plugin; a huge initial scale
makes every step overflow, a scale of 1 none."""

from __future__ import annotations

import functools

import pytest
import torch

from helpers import compose_train
from lightning_vlm.training import train

STEPS = 3
RUN = ["logger=none", "callbacks=none", "validate_before_fit=false", "trainer.enable_progress_bar=false",
       f"trainer.max_steps={STEPS}", "trainer.limit_val_batches=0", "data.batch_size=2",
       "tiny_start=random", "trainer.precision=null",
       "method.scheduler={_target_:torch.optim.lr_scheduler.LinearLR,_partial_:true,start_factor:1.0,"
       "end_factor:0.0,total_iters:10}"]  # fmt: skip
# An entropy bonus: a random policy's rewards tie, and a zero loss overflows at no scale.
ONLINE = ["method.num_generations=2", "method.max_completion_length=4", "method.entropy_coef=0.1"]


def _fp16(init_scale: float) -> str:
    return (
        "trainer.plugins=[{_target_: lightning_vlm.checkpoint_io.AtomicCheckpointIO}, "
        "{_target_: lightning.pytorch.plugins.MixedPrecision, precision: 16-mixed, device: cpu, "
        f"scaler: {{_target_: torch.amp.GradScaler, device: cpu, init_scale: {init_scale}}}}}]"
    )


@pytest.mark.parametrize("method", ["sft", "grpo"])
def test_steps_skipped_for_overflow_leave_the_schedule_where_it_was(method, tmp_path):
    extra = ONLINE if method == "grpo" else []
    counted = {}
    for init_scale in (1.0e30, 1.0):
        cfg = compose_train([f"method={method}", *RUN, *extra, _fp16(init_scale)], tmp_path / str(init_scale))
        _, objects = train(cfg)
        trainer = objects["trainer"]
        scale = trainer.precision_plugin.scaler.get_scale()
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        assert trainer.global_step == STEPS  # Lightning counts skipped steps, as HF's Trainer does
        counted[init_scale] = (scale, scheduler.last_epoch)
    (huge, huge_steps), (one, one_steps) = counted[1.0e30], counted[1.0]
    assert huge == pytest.approx(1.0e30 * 0.5**STEPS)  # every step overflowed and backed off...
    assert huge_steps == 0  # ...and none moved the schedule
    assert one == 1.0 and one_steps == STEPS  # no overflow: every step counts


class _NotAScheduler:
    def __init__(self, optimizer):
        self.optimizer = optimizer


@pytest.mark.parametrize("scheduler", [torch.optim.lr_scheduler.ReduceLROnPlateau, _NotAScheduler])
def test_a_scheduler_that_is_not_stepped_per_optimizer_step_is_refused(scheduler, tiny_path):
    # Lightning's own check of this is off where lr_scheduler_step is overridden, as here.
    from lightning_vlm.methods.sft import SFT
    from lightning_vlm.models.vlm import VLM

    optimizer = functools.partial(torch.optim.SGD, lr=0.1)
    module = SFT(VLM(tiny_path()), optimizer=optimizer, scheduler=functools.partial(scheduler))
    with pytest.raises(ValueError, match="method.scheduler built a .*, not a torch.optim.lr_scheduler"):
        module.configure_optimizers()
