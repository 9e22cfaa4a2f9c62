"""wandb runs offline without an account (no prompt) and falls back to CSV when it cannot start."""

from __future__ import annotations

import builtins

from lightning.pytorch.loggers import CSVLogger, WandbLogger

from lightning_vlm.loggers import wandb_account_configured, wandb_or_csv


def test_no_account_means_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert not wandb_account_configured()
    logger = wandb_or_csv(save_dir=str(tmp_path), name="t")
    assert isinstance(logger, WandbLogger) and logger._offline


def test_netrc_entry_counts_as_account(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    netrc_file.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert wandb_account_configured()


def test_csv_fallback_when_wandb_cannot_import(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    logger = wandb_or_csv(save_dir=str(tmp_path), name="t", offline=True)
    assert isinstance(logger, CSVLogger)
