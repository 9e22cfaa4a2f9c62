"""wandb runs offline without an account (no prompt) and falls back to CSV when it cannot start."""

from __future__ import annotations

import builtins
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from lightning_vlm.loggers import finish_runs, start_runs, wandb_account_configured, wandb_or_csv


@pytest.fixture
def fresh_wandb():
    """wandb keeps its settings process-wide from its first start (wandb.setup): each of these tests
    starts it in another mode, so each gets a fresh one."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


def test_no_account_means_offline(tmp_path, monkeypatch, fresh_wandb, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert not wandb_account_configured()
    logger = wandb_or_csv(save_dir=str(tmp_path), name="t")
    assert isinstance(logger, WandbLogger) and logger._offline
    (started,) = start_runs([logger])  # offline: a folder and no network
    assert started is logger and list((tmp_path / "wandb").glob("offline-run-*"))
    finish_runs([logger])
    # a newcomer's first run printed wandb's deprecation of the anonymous setting Lightning passes
    assert "anonymous" not in capsys.readouterr().err


def test_csv_fallback_when_wandb_cannot_start(tmp_path, monkeypatch, fresh_wandb):
    # Online without a key (as with a stale key and no network): WandbLogger starts wandb when first used,
    # inside training, and the run ended with wandb's UsageError instead of falling back to CSV.
    import wandb

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    logger = wandb_or_csv(save_dir=str(tmp_path), name="t", offline=False)
    (started,) = start_runs([logger])  # what train() and eval do first
    assert isinstance(started, CSVLogger) and wandb.run is None


KEY = "k" * 40  # the shortest key wandb takes


def no_account(tmp_path, monkeypatch) -> Path:
    """No credentials in the environment, no settings file of wandb's; returns the netrc file to write."""
    for key in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)  # no workspace settings (./wandb/settings) of the checkout
    (tmp_path / "config").mkdir()
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    return tmp_path / "netrc"


# `wandb login` writes the key under its cloud's host: api.forge.coreweave.com since wandb 0.31, whose
# cloud still reads the entry older versions wrote. The first was read as no account: such runs went offline.
@pytest.mark.parametrize("host", ["api.wandb.ai", "api.forge.coreweave.com"])
def test_netrc_entry_counts_as_account(host, tmp_path, monkeypatch, fresh_wandb):
    netrc_file = no_account(tmp_path, monkeypatch)
    netrc_file.write_text(f"machine {host}\n  login user\n  password {KEY}\n")
    netrc_file.chmod(0o600)
    assert wandb_account_configured()


def test_the_server_wandb_login_host_chose_counts_as_account(tmp_path, monkeypatch, fresh_wandb):
    # `wandb login --host URL` writes the server to wandb's settings file and the key under its host in
    # ~/.netrc. Only WANDB_BASE_URL was read, so such a run went offline with an account configured.
    netrc_file = no_account(tmp_path, monkeypatch)
    (tmp_path / "config" / "settings").write_text("[default]\nbase_url = https://wandb.example.com\n")
    netrc_file.write_text(f"machine wandb.example.com\n  login user\n  password {KEY}\n")
    netrc_file.chmod(0o600)
    assert wandb_account_configured()
    # a key for W&B's cloud is no account on the server wandb would use
    netrc_file.write_text(f"machine api.wandb.ai\n  login user\n  password {KEY}\n")
    assert not wandb_account_configured()


def test_csv_fallback_when_wandb_cannot_import(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    logger = wandb_or_csv(save_dir=str(tmp_path), name="t", offline=True)
    assert isinstance(logger, CSVLogger)


def test_a_job_that_fails_before_fit_ends_its_wandb_run(tmp_path, monkeypatch, fresh_wandb):
    # The run starts when the logger is built; a trainer that cannot be built left it open, and the next
    # job of a sweep (same process) logged into it.
    import wandb

    from helpers import compose_train
    from lightning_vlm.training import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.raises(Exception, match="no_such_option"):
        train(compose_train(["logger=wandb", "+trainer.no_such_option=1"], tmp_path))
    assert wandb.run is None


def test_the_vllm_server_key_is_not_logged_as_a_hyperparameter(tmp_path, monkeypatch):
    # generation=vllm_server reads its key from $VLLM_API_KEY; the resolved config went to log_hyperparams,
    # so the key was uploaded with the W&B run's config and written to the CSV logger's hparams.yaml.
    from omegaconf import OmegaConf

    from helpers import compose_train
    from lightning_vlm.loggers import HIDDEN, loggable_config

    monkeypatch.setenv("VLLM_API_KEY", "s3cret-demo")
    cfg = compose_train(["method=grpo", "generation=vllm_server"], tmp_path)
    logged, resolved = loggable_config(cfg), OmegaConf.to_container(cfg, resolve=True)
    assert "s3cret-demo" in str(resolved) and "s3cret-demo" not in str(logged)
    resolved["callbacks"]["vllm_generation"]["api_key"] = HIDDEN
    assert logged == resolved  # the rest is logged as resolved
    monkeypatch.delenv("VLLM_API_KEY")  # no key: nothing to hide, the setting logs as null
    logged = loggable_config(compose_train(["method=grpo", "generation=vllm_server"], tmp_path))
    assert logged["callbacks"]["vllm_generation"]["api_key"] is None
