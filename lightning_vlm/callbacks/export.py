"""Export the trained policy as a Hugging Face folder, so the next method can start from it, and
optionally push it to the Hub with a model card.

The card shows the run's composed config. It is read from the file Hydra saves in the run folder
(``<run>/.hydra/config.yaml``, set as ``config_path`` by conf/callbacks/export.yaml): that file is
the whole config that made the run (model, data, method, trainer) and reruns it, it exists before
training on every rank, and no object has to carry the config to the callback. The module's hparams
(the method's settings only) stand in when the file is missing, e.g. for a run not started by
``hydra.main``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from huggingface_hub import HfApi, ModelCard, ModelCardData, get_token, is_offline_mode
from omegaconf import OmegaConf

from lightning_vlm.parallel.export import save_sharded
from lightning_vlm.parallel.fsdp import check_orig_params, sharded_root
from lightning_vlm.parallel.steps import partitions_weights

log = logging.getLogger(__name__)

DRY_RUN = "dry_run"
CARD_TAGS = ("lightning-vlm", "vision-language-model", "image-text-to-text")


class ExportHFModel(L.Callback):
    """At the end of fit, saves the policy (LoRA merged) and processor with ``save_pretrained``.

    The folder loads with ``model.model_name_or_path=<dir>`` — e.g. an SFT warm start for GRPO.
    ``push_to_hub``: ``False``; ``True`` writes a model card (README.md) into the folder and uploads it
    to ``hub_model_id``; ``"dry_run"`` writes the card and lists what would be uploaded (the log and a
    JSON manifest beside the folder, ``<dirpath>.hub_manifest.json``) without touching the network.
    A real push that cannot happen (offline, no token) fails when fit starts, not after training.
    ``max_shard_size`` (e.g. "5GB"): the weights' shards, as transformers' ``save_pretrained`` (its
    default when None); a LoRA adapter (``merge_lora=false``) is one file.
    """

    def __init__(
        self,
        dirpath: str,
        merge_lora: bool = True,
        push_to_hub: bool | Literal["dry_run"] = False,
        hub_model_id: str | None = None,
        private: bool = True,
        commit_message: str = "Upload model trained with lightning-vlm",
        config_path: str | None = None,
        max_shard_size: int | str | None = None,
    ) -> None:
        # isinstance, not `in`: 1 == True, and push_to_hub=1 would pass here to skip every later `is True`.
        if not (isinstance(push_to_hub, bool) or push_to_hub == DRY_RUN):
            raise ValueError(f"push_to_hub must be false, true or {DRY_RUN!r}, got {push_to_hub!r}")
        if push_to_hub is True and not hub_model_id:
            raise ValueError("push_to_hub=true needs hub_model_id=<user or org>/<name>")
        self.dirpath = Path(dirpath)
        self.merge_lora = merge_lora
        self.push_to_hub = push_to_hub
        self.hub_model_id = hub_model_id
        self.private = private
        self.commit_message = commit_message
        self.config_path = Path(config_path) if config_path else None
        self.max_shard_size = max_shard_size
        # train() validates the final weights after fit when no validation ran during it (a run shorter
        # than val_check_interval): it sets this, then calls publish() after that validation, so the
        # card holds the run's final metrics. Code calling trainer.fit itself publishes at fit's end.
        self.publish_after_fit = False
        self._exported = False  # this fit wrote the folder: a fit stopped early publishes nothing

    @property
    def manifest_path(self) -> Path:
        """Where the upload manifest goes: beside the folder, so it is not uploaded with it."""
        return self.dirpath.with_name(self.dirpath.name + ".hub_manifest.json")

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._exported = False
            check_not_partitioned(trainer.strategy)
            check_orig_params(trainer.strategy, "callbacks.export")
        if stage == "fit" and self.push_to_hub is True:
            # Rank 0 uploads, so its environment decides, and every rank raises its verdict: a rank raising
            # alone (another machine without HF_TOKEN) left the others in Lightning's post-setup barrier.
            problem = None
            if trainer.is_global_zero:
                try:
                    check_can_push()
                except RuntimeError as error:
                    problem = str(error)
            if problem := trainer.strategy.broadcast(problem):
                raise RuntimeError(problem)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        root = sharded_root(trainer.strategy.model)
        if root is not None:
            # Under FSDP the weights are gathered unit by unit by every rank (a collective); rank 0 writes.
            save_sharded(pl_module.vlm, root, self.dirpath, self.merge_lora, trainer.is_global_zero,
                         self.max_shard_size)  # fmt: skip
        if not trainer.is_global_zero:
            return
        if root is None:
            pl_module.vlm.save_pretrained(self.dirpath, self.merge_lora, self.max_shard_size)
        self._exported = True
        if not self.publish_after_fit:
            self.publish(trainer, pl_module)

    def publish(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """With ``push_to_hub``: writes the model card from the trainer's metrics now, then uploads the
        folder (or, for a dry run, lists what would be uploaded). Rank 0 only; the folder exists."""
        if not trainer.is_global_zero or not self.push_to_hub or not self._exported:
            return
        self.write_card(trainer, pl_module)
        dry_run = self.push_to_hub == DRY_RUN
        files = folder_files(self.dirpath)
        total = sum(f["bytes"] for f in files)
        listing = "\n".join(f"  {f['path']}  {f['bytes']} bytes" for f in files)
        log.info("%s %d files (%d bytes) from %s to %s:\n%s", "Would upload" if dry_run else "Uploading",
                 len(files), total, self.dirpath, self.hub_model_id, listing)  # fmt: skip
        manifest: dict[str, Any] = {
            "repo_id": self.hub_model_id, "private": self.private, "commit_message": self.commit_message,
            "folder": str(self.dirpath), "dry_run": dry_run, "files": files, "total_bytes": total,
        }  # fmt: skip
        if not dry_run:
            manifest["commit_url"] = self._upload()
        self.manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")

    def write_card(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Writes README.md (the model card) into the exported folder."""
        metrics = {
            k: float(v) for k, v in trainer.callback_metrics.items() if torch.as_tensor(v).numel() == 1
        }
        config, source = self._config_text(pl_module)
        method = _method_name(config, pl_module)
        name = self.hub_model_id or self.dirpath.name
        adapter = pl_module.vlm.is_lora and not self.merge_lora
        budget = _image_budget(trainer.datamodule)
        card = model_card(
            pl_module.vlm.model_name_or_path, method, config, source, metrics, name, adapter, budget
        )
        card.save(self.dirpath / "README.md")

    def _upload(self) -> str:
        api = HfApi()
        # upload_folder needs the repository; `private` applies when this creates it.
        api.create_repo(self.hub_model_id, private=self.private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            repo_id=self.hub_model_id, folder_path=self.dirpath, commit_message=self.commit_message,
            repo_type="model",
        )  # fmt: skip
        log.info("Pushed %s to %s", self.dirpath, commit.commit_url)
        return str(commit.commit_url)

    def _config_text(self, pl_module: L.LightningModule) -> tuple[str, str]:
        """(YAML, where it came from): Hydra's saved config, else the module's hparams."""
        if self.config_path is not None and self.config_path.is_file():
            return (
                self.config_path.read_text(),
                f"The run's composed config, as Hydra saved it (`{self.config_path.name}`)",
            )
        log.warning("No Hydra config at %s: the model card shows the method's hparams only", self.config_path)
        hparams = OmegaConf.create(dict(pl_module.hparams))
        return OmegaConf.to_yaml(hparams), f"The method's hyperparameters (`{type(pl_module).__name__}`)"


def publish_after_fit(trainer: L.Trainer) -> list[ExportHFModel]:
    """Makes every ExportHFModel of ``trainer`` leave its card and push to the caller (see
    ``ExportHFModel.publish_after_fit``), and returns them for :meth:`ExportHFModel.publish`."""
    exports = [c for c in trainer.callbacks if isinstance(c, ExportHFModel)]
    for callback in exports:
        callback.publish_after_fit = True
    return exports


def check_not_partitioned(strategy: Any) -> None:
    """Refuse DeepSpeed ZeRO-3 before training: its weights are partitioned across ranks, and the export
    would write rank 0's empty placeholders (gathering them is not implemented: FSDP's is)."""
    if partitions_weights(strategy):
        raise ValueError(
            "callbacks.export (ExportHFModel) under DeepSpeed ZeRO-3 would save partitioned (empty) weights: "
            "train with trainer=fsdp (the export gathers the shards) or trainer=deepspeed_zero2, or convert "
            "last.ckpt with lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict"
        )


def check_can_push() -> None:
    """Raises ``RuntimeError`` when an upload would fail: offline mode, or no Hugging Face token."""
    if is_offline_mode():
        raise RuntimeError(
            "ExportHFModel push_to_hub=true, but the Hugging Face Hub is offline (HF_HUB_OFFLINE=1 or "
            "TRANSFORMERS_OFFLINE=1): the upload after training would fail. Unset it, or set "
            "push_to_hub=dry_run to write the card and the upload manifest without the network."
        )
    if get_token() is None:
        raise RuntimeError(
            "ExportHFModel push_to_hub=true, but no Hugging Face token was found: run `hf auth login` "
            "or set HF_TOKEN before training, or set push_to_hub=dry_run."
        )


def folder_files(folder: Path) -> list[dict[str, Any]]:
    """Every file under ``folder`` (relative POSIX path and size in bytes), as upload_folder sends them."""
    return [
        {"path": p.relative_to(folder).as_posix(), "bytes": p.stat().st_size}
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    ]


def _method_name(config: str, pl_module: L.LightningModule) -> str:
    # task_name (sft, dpo, mpo, grpo...) names the method as the configs do; MPO is the DPO class.
    task = OmegaConf.create(config).get("task_name") if config.strip() else None
    return str(task) if task else type(pl_module).__name__.lower()


def _is_hub_id(name: str) -> bool:
    # A local folder (a tiny model, an earlier export) is no Hub id; the Hub rejects it as base_model.
    return not os.path.exists(name) and name.count("/") == 1 and not name.startswith((".", "/"))


def _image_budget(datamodule: object) -> str | None:
    """What the card says of the pixel budget the training images were scaled into; None: none was set."""
    from lightning_vlm.data.datamodule import VLMDataModule

    if not isinstance(datamodule, VLMDataModule):
        return None
    budget = datamodule.row_format.image_budget  # the one the rows were decoded with
    bounds = [f"at {side} {pixels} pixels" for side, pixels in (("most", budget.max_pixels),
              ("least", budget.min_pixels)) if pixels is not None]  # fmt: skip
    if not bounds:
        return None
    return (
        f"Its training images were scaled, aspect kept, to {' and '.join(bounds)} (width x height; lightning-vlm's "
        "`data.image_max_pixels` / `data.image_min_pixels`): scale yours the same way before the processor."
    )


def model_card(
    base_model: str,
    method: str,
    config: str,
    config_source: str,
    metrics: dict[str, float],
    name: str,
    adapter: bool = False,
    image_budget: str | None = None,
) -> ModelCard:
    """A model card: Hub metadata (library, tags, base model) and a body with the method, the final
    metrics, how to load it (with ``image_budget``'s sentence, if the training images were scaled) and the
    config. ``adapter``: a LoRA adapter (``merge_lora=false``), which the
    Hub lists under peft and which loads onto its base model."""
    data = ModelCardData(
        library_name="peft" if adapter else "transformers",
        pipeline_tag="image-text-to-text",
        tags=[*CARD_TAGS, method],
        base_model=base_model if _is_hub_id(base_model) else None,
    )
    origin = f"[`{base_model}`](https://huggingface.co/{base_model})" if _is_hub_id(base_model) else (
        f"a local model (`{base_model}`)"
    )  # fmt: skip
    rows = "\n".join(f"| `{k}` | {v:.6g} |" for k, v in sorted(metrics.items())) or "| (none logged) | |"
    body = f"""
# {name}

A vision-language model trained with **{method}** by lightning-vlm, starting from {origin}.

## Final metrics

| metric | value |
| --- | --- |
{rows}

## Usage

{_usage(name, base_model, adapter)}{"" if image_budget is None else chr(10) * 2 + image_budget}

## Training configuration

{config_source}:

```yaml
{config.rstrip()}
```
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")


def _usage(name: str, base_model: str, adapter: bool) -> str:
    if not adapter:
        return f"""```python
from transformers import AutoModelForImageTextToText, AutoProcessor

model = AutoModelForImageTextToText.from_pretrained("{name}")
processor = AutoProcessor.from_pretrained("{name}")
```"""
    where = "" if _is_hub_id(base_model) else f"\n\nIts base is a local model: load it from `{base_model}`."
    return f"""A LoRA adapter: load its base model, then the adapter onto it.{where}

```python
from peft import PeftModel
from transformers import AutoModelForImageTextToText, AutoProcessor

base = AutoModelForImageTextToText.from_pretrained("{base_model}")
model = PeftModel.from_pretrained(base, "{name}")
processor = AutoProcessor.from_pretrained("{name}")
```"""
