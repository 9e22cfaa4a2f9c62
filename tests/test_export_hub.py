"""ExportHFModel's push_to_hub: the model card, the dry-run manifest, and the early offline failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import huggingface_hub
import pytest
from huggingface_hub import ModelCard
from transformers import AutoModelForImageTextToText, AutoProcessor

from helpers import ROOT, compose_train
from lightning_vlm.callbacks.export import ExportHFModel, model_card
from lightning_vlm.training import train

SHORT = [
    "logger=none",
    "callbacks=[none,export]",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.enable_progress_bar=false",
    "data.batch_size=4",
    "data.synthetic.num_val=8",
    "data.val_batch_size=8",
]


@pytest.mark.slow  # a real train.py process
def test_dry_run_writes_the_card_and_manifest_without_the_network(tmp_path):
    # train.py itself, so Hydra saves the run's config (.hydra/config.yaml) that the card shows.
    run = tmp_path / "run"
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    args = [*SHORT, "callbacks.export.push_to_hub=dry_run", "callbacks.export.hub_model_id=me/tiny-sft",
            f"hydra.run.dir={run}", "data.image_max_pixels=6272"]  # fmt: skip
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    folder = run / "hf_model"
    AutoModelForImageTextToText.from_pretrained(folder)
    AutoProcessor.from_pretrained(folder)

    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "image-text-to-text"
    assert {"lightning-vlm", "sft"} <= set(card.data.tags)
    assert card.data.base_model is None  # the tiny model is a local folder, not a Hub id
    assert (run / ".hydra" / "config.yaml").read_text().strip() in card.text  # the composed config
    assert "| `val/answer_accuracy` |" in card.text and "push_to_hub: dry_run" in card.text
    # the images it trained on were scaled (112x112 -> 79x79): a user of the model scales theirs alike
    assert "training images were scaled, aspect kept, to at most 6272 pixels" in card.text

    manifest = json.loads((run / "hf_model.hub_manifest.json").read_text())
    assert manifest["dry_run"] is True and manifest["repo_id"] == "me/tiny-sft"
    sizes = {f["path"]: f["bytes"] for f in manifest["files"]}
    assert sizes["model.safetensors"] == (folder / "model.safetensors").stat().st_size
    assert {"config.json", "README.md", "tokenizer.json"} <= set(sizes)
    assert manifest["total_bytes"] == sum(sizes.values())
    assert "Would upload" in (run / "sft.log").read_text()


def test_push_while_offline_fails_before_training(tmp_path, monkeypatch):
    # HF_HUB_OFFLINE as huggingface_hub read it at import (what makes its uploads refuse).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    overrides = [*SHORT, "callbacks.export.push_to_hub=true", "callbacks.export.hub_model_id=me/tiny-sft",
                 "+callbacks.ckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint",
                 f"+callbacks.ckpt.dirpath={tmp_path / 'ckpt'}"]  # fmt: skip
    with pytest.raises(RuntimeError, match="HF_HUB_OFFLINE=1") as failure:
        train(compose_train(overrides, tmp_path))
    assert any(entry.name == "setup" for entry in failure.traceback)  # raised from the setup hook
    assert not (tmp_path / "hf_model").exists() and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    ("rank", "offline_here", "rank_0_verdict"),
    [(1, True, None), (1, False, "the Hugging Face Hub is offline"), (0, True, "<its own>")],
)
def test_every_rank_raises_rank_0_s_verdict_on_the_push(
    rank, offline_here, rank_0_verdict, tmp_path, monkeypatch
):
    # Each rank checked its own environment: one that could not push (another machine without HF_TOKEN)
    # raised in setup alone, and the others waited in Lightning's post-setup barrier. Rank 0 uploads, so
    # its verdict, broadcast, is what every rank raises.
    from types import SimpleNamespace

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline_here)
    monkeypatch.setenv("HF_TOKEN", "hf_" + "x" * 34)
    received = (lambda own: own) if rank == 0 else (lambda own: rank_0_verdict)
    trainer = SimpleNamespace(
        is_global_zero=rank == 0, strategy=SimpleNamespace(broadcast=received, model=None)
    )
    export = ExportHFModel(str(tmp_path), push_to_hub=True, hub_model_id="me/tiny")
    if rank_0_verdict is None:
        export.setup(trainer, None, "fit")
    else:
        with pytest.raises(RuntimeError, match="Hub is offline"):
            export.setup(trainer, None, "fit")


def test_push_settings_are_checked_when_built(tmp_path):
    with pytest.raises(ValueError, match="hub_model_id"):
        ExportHFModel(str(tmp_path), push_to_hub=True)
    with pytest.raises(ValueError, match="dry_run"):
        ExportHFModel(str(tmp_path), push_to_hub="yes")
    # Hydra reads push_to_hub=1 as an integer: equal to True, yet no `is True` check would see it.
    for value in (1, 0, 1.0):
        with pytest.raises(ValueError, match=f"push_to_hub must be false, true or 'dry_run', got {value}"):
            ExportHFModel(str(tmp_path), push_to_hub=value)


def test_a_hub_base_model_goes_into_the_card_metadata():
    card = model_card("Qwen/Qwen2.5-VL-3B-Instruct", "grpo", "task_name: grpo\n", "the config",
                      {"val/reward": 0.5}, "me/tiny-grpo")  # fmt: skip
    assert card.data.base_model == "Qwen/Qwen2.5-VL-3B-Instruct"
    assert "grpo" in card.data.tags and "| `val/reward` | 0.5 |" in card.text
    assert "images were scaled" not in card.text  # no budget set: nothing said


@pytest.mark.parametrize("base", ["Qwen/Qwen2.5-VL-3B-Instruct", "/models/local-base"])
def test_an_adapter_s_card_says_peft_and_loads_it_onto_its_base(base):
    card = model_card(base, "grpo", "task_name: grpo\n", "the config", {}, "me/tiny-grpo-lora", adapter=True)
    assert card.data.library_name == "peft"
    assert 'PeftModel.from_pretrained(base, "me/tiny-grpo-lora")' in card.text
    assert f'AutoModelForImageTextToText.from_pretrained("{base}")' in card.text
    assert ("load it from `/models/local-base`" in card.text) == base.startswith("/")


def _card_metrics(folder) -> dict[str, float]:
    rows = [line.split("|") for line in ModelCard.load(folder / "README.md").text.splitlines()]
    return {
        r[1].strip().strip("`"): float(r[2]) for r in rows if len(r) == 4 and r[1].strip().startswith("`")
    }


def test_the_card_of_a_run_shorter_than_its_validation_interval_has_the_final_validation(tmp_path):
    # No validation during fit (val_check_interval > max_steps): train() validates after fit, and the
    # card, written at the end of fit, had no val/* metric of the exported weights.
    overrides = [*SHORT, "trainer.val_check_interval=50", "callbacks.export.push_to_hub=dry_run",
                 "callbacks.export.hub_model_id=me/tiny-sft"]  # fmt: skip
    metrics, _ = train(compose_train(overrides, tmp_path))
    card = _card_metrics(tmp_path / "hf_model")
    assert card["val/answer_accuracy"] == pytest.approx(metrics["val/answer_accuracy"], abs=1e-4)
    assert json.loads((tmp_path / "hf_model.hub_manifest.json").read_text())["dry_run"] is True


def test_a_plain_trainer_fit_still_publishes_at_the_end_of_fit(tmp_path):
    import hydra

    from lightning_vlm.training import build

    cfg = compose_train([*SHORT, "callbacks.export.push_to_hub=dry_run",
                         "callbacks.export.hub_model_id=me/tiny-sft"], tmp_path)  # fmt: skip
    datamodule, module = build(cfg)
    export = hydra.utils.instantiate(cfg.callbacks.export)
    trainer = hydra.utils.instantiate(cfg.trainer, callbacks=[export], logger=False)
    trainer.fit(module, datamodule=datamodule)
    assert "| `val/answer_accuracy` |" in ModelCard.load(tmp_path / "hf_model" / "README.md").text
    assert (tmp_path / "hf_model.hub_manifest.json").is_file()
