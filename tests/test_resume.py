"""Resuming from a mid-epoch checkpoint continues the same run: same data position, same weights."""

from __future__ import annotations

import torch

from helpers import compose_train
from lightning_vlm.data.resumable import ResumableDataLoader
from lightning_vlm.training import train

COMMON = [
    "logger=none",
    "callbacks=none",
    "trainer.limit_val_batches=0",
    "trainer.enable_progress_bar=false",
    "data.batch_size=4",
    "data.synthetic.num_train=64",  # 16 batches an epoch: step 5 is mid-epoch
]


def _weights(out) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in out["module"].vlm.model.named_parameters()}


def test_resume_mid_epoch_matches_an_uninterrupted_run(tmp_path):
    _, straight = train(compose_train([*COMMON, "trainer.max_steps=10"], tmp_path / "a"))
    ckpt_dir = tmp_path / "b" / "ckpt"
    first = [
        *COMMON,
        # A checkpoint taken mid-run (step 5 of 7), as a crash would leave it.
        "trainer.max_steps=7",
        "+callbacks.ckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint",
        f"+callbacks.ckpt.dirpath={ckpt_dir}",
        "+callbacks.ckpt.every_n_train_steps=5",
        "+callbacks.ckpt.filename=mid",
    ]
    train(compose_train(first, tmp_path / "b"))
    state = torch.load(ckpt_dir / "mid.ckpt", weights_only=True)  # plain containers only
    assert state["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["batches"] == 5
    _, resumed = train(
        compose_train([*COMMON, "trainer.max_steps=10", f"ckpt_path={ckpt_dir / 'mid.ckpt'}"], tmp_path / "c")
    )
    a, b = _weights(straight), _weights(resumed)
    assert resumed["trainer"].global_step == 10
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def test_epoch_order_depends_on_seed_and_epoch_only():
    loader = ResumableDataLoader(list(range(10)), batch_size=3, seed=7, collate_fn=list)
    loader.sampler.set_epoch(2)
    full = list(loader)
    loader.load_state_dict({"epoch": 2, "batches": 2})
    assert list(loader) == full[2:]
    loader.sampler.set_epoch(3)
    assert list(loader) != full
