"""A run that needs the hub, on a machine that cannot reach it, goes offline and names what is missing at
once (huggingface_hub's retries took 2.5 minutes before an error naming no setting); a run that needs
nothing from the hub never asks the network."""

from __future__ import annotations

import logging
import socket

import pytest
from hydra.errors import InstantiationException

from helpers import compose_train
from lightning_vlm.data.loaded import SourceError
from lightning_vlm.hub_reach import hub_names, hub_unreachable
from lightning_vlm.training import train

SMALL = ["logger=none", "callbacks=none", "++tiny_start=random", "trainer.max_steps=1",
         "trainer.enable_progress_bar=false"]  # fmt: skip


@pytest.fixture
def online_but_unreachable(monkeypatch):
    """Online mode, with the hub's endpoint a local port nothing listens on (connections refused at once)."""
    import datasets.config
    import huggingface_hub.constants as constants

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # restored after the test, as the run sets it
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    return endpoint


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        # a pretrained model's config: the VLM's own check, offline
        (["model=qwen2_5_vl", "model.model_name_or_path=nobody-lvlm/no-such-model"], InstantiationException,
         r"model\.model_name_or_path='nobody-lvlm/no-such-model' .* not in the hub cache"),
        # the tiny settings with a hub id: the scale guard names the family configs
        (["model.model_name_or_path=Qwen/Qwen2.5-VL-3B-Instruct"], ValueError, r"model=qwen2_5_vl"),
        # a hub dataset
        (["data.train=nobody-lvlm/no-such-dataset"], SourceError, r"HF_HUB_OFFLINE=1 is set"),
        # a reward model: transformers' "We couldn't connect to 'https://huggingface.co'" named no setting
        (["method=grpo", "method.reward_funcs=[{_target_:lightning_vlm.rewards.RewardModel,"
          "model_name_or_path:nobody-lvlm/no-such-rm}]"], InstantiationException,
         r"RewardModel model_name_or_path='nobody-lvlm/no-such-rm' .* not in the hub cache"),
    ],
    ids=["model", "scale-guard", "dataset", "reward-model"],
)  # fmt: skip
def test_an_unreachable_hub_is_tried_once_then_the_run_goes_offline(
    overrides, error, message, online_but_unreachable, tmp_path, caplog
):
    cfg = compose_train([*SMALL, *overrides], tmp_path)
    with (
        caplog.at_level(logging.WARNING, logger="lightning_vlm.hub_reach"),
        pytest.raises(error, match=message),
    ):
        train(cfg)
    assert f"cannot be reached ({online_but_unreachable}" in caplog.text
    assert "running offline" in caplog.text


def test_only_names_the_hub_resolves_make_a_run_ask_for_it(tmp_path, tiny_path):
    local = tmp_path / "rows.jsonl"
    local.write_text("")
    cases = {
        (): [],  # the default job: a tiny model built here, synthetic rows
        (f"data.train={local}", "data.val=./missing.jsonl"): [],  # local, or a missing local path (refused)
        (f"model.model_name_or_path={tiny_path()}",): [],
        ("model.model_name_or_path=org/vlm", "data.train=org/rows", "data.val={path:org/val}"): [
            "org/vlm", "org/rows", "org/val",
        ],
        # a reward model from the hub, and one from a local folder
        ("method=grpo", "method.reward_funcs=[{_target_:lightning_vlm.rewards.RewardModel,model_name_or_path:org/rm},"
         f"{{_target_:lightning_vlm.rewards.RewardModel,model_name_or_path:{tiny_path()}}}]"): ["org/rm"],
    }  # fmt: skip
    for overrides, names in cases.items():
        assert hub_names(compose_train([*SMALL, *overrides], tmp_path)) == names, overrides


def test_the_probe_reports_why(online_but_unreachable):
    reason = hub_unreachable(timeout=2.0)
    assert reason is not None and reason.startswith(online_but_unreachable)
