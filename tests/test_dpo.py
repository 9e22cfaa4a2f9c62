"""The DPO module: settings errors, a few real steps (DPO, MPO, train.py), precomputed references, LoRA."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from functools import partial

import pytest
import torch
from hydra.utils import instantiate

from helpers import ROOT, base_name, compose_train, trained_by_lora
from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.methods.dpo import DPO
from lightning_vlm.methods.preference_batch import encode_pairs, split_pairs
from lightning_vlm.methods.reference_cache import (
    ReferenceLogpCache,
    model_key,
    processor_fingerprint,
    row_key,
    weights_fingerprint,
)
from lightning_vlm.models.reference import ReferenceModel
from lightning_vlm.models.vlm import VLM
from lightning_vlm.recurring import reset_recurring
from lightning_vlm.training import train

SHORT = [
    "logger=none",
    "callbacks=none",
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
    "trainer.enable_progress_bar=false",
    "data.batch_size=4",
    "data.val_batch_size=4",
    "data.synthetic.num_train=16",
    "data.synthetic.num_val=4",
]
LOGGED = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


@pytest.fixture(scope="module")
def vlm(tiny_path):
    torch.manual_seed(0)
    return VLM(tiny_path("qwen2_5_vl"), freeze_vision_tower=False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "sigmoid"}, "loss_type must be a list"),
        ({"loss_type": ["sigmoid", "dpo"]}, "unknown preference loss type"),
        ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}, "loss_weights has 1 entries"),
        ({"beta": 0.0}, "beta must be > 0"),
        ({"label_smoothing": 0.5}, "label_smoothing must be in"),
        ({"loss_type": ["ipo"], "label_smoothing": 0.1}, "applies only to sigmoid and robust"),
    ],
)
def test_bad_settings_fail_at_construction_naming_the_setting(vlm, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        DPO(vlm, optimizer=partial(torch.optim.AdamW, lr=1e-3), **kwargs)


@pytest.mark.parametrize("method", ["dpo", "mpo"])
def test_method_runs_and_logs_every_metric(method, tmp_path):
    metrics, out = train(compose_train([f"method={method}", *SHORT], tmp_path))
    components = ["sigmoid"] if method == "dpo" else ["sigmoid", "bco_pair", "sft"]
    for prefix in ("train", "val"):
        for name in (*LOGGED, *(f"loss/{c}" for c in components)):
            assert f"{prefix}/{name}" in metrics, (prefix, name, sorted(metrics))
    assert "val/answer_accuracy" in metrics
    module = out["module"]
    assert module.hparams.loss_type == components
    if method == "mpo":
        assert module.hparams.loss_weights == [0.8, 0.2, 1.0]
        assert int(module.bco_delta.count) == 3 * 2 * 4, "δ saw both rewards of every training pair"


@pytest.mark.parametrize("running", [True, False])
def test_bco_running_delta_false_is_trl_1s_bco_pair_with_no_shift(vlm, running):
    from lightning_vlm.losses.preference import bco_pair_loss

    module = DPO(vlm, optimizer=partial(torch.optim.AdamW, lr=1e-3), loss_type=["bco_pair"],
                 bco_running_delta=running)  # fmt: skip
    module.bco_delta.update(torch.tensor([3.0]))  # a δ far from 0, as after many steps
    rows = synthetic_rows("preference", 2, seed=1)
    with torch.no_grad():
        loss, _, _ = module._loss(rows, train=True)
        batch = encode_pairs(vlm, rows)
        logps, _ = vlm.token_logps(batch.inputs, batch.completion_mask)
        chosen, rejected = split_pairs(logps.sum(dim=1))
        ref_chosen, ref_rejected = module._reference_logps(rows, batch)
    delta = module.bco_delta.mean if running else 0.0  # after this step's update, as the loss sees it
    expected = bco_pair_loss(chosen - ref_chosen, rejected - ref_rejected, 0.1, delta).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert int(module.bco_delta.count) == (1 + 4 if running else 1)  # false: δ is not tracked at all


def test_train_py_method_mpo_runs_offline(tmp_path):
    env = {**os.environ, "PROJECT_ROOT": str(tmp_path), "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "method=mpo", *SHORT],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_real_model_mpo_composes(tmp_path):
    cfg = compose_train(["model=qwen2_5_vl", "method=mpo"], tmp_path)
    assert cfg.model.model_name_or_path == "Qwen/Qwen2.5-VL-3B-Instruct"
    assert list(cfg.method.loss_type) == ["sigmoid", "bco_pair", "sft"]
    assert cfg.monitor == "val/rewards/accuracies"


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_precomputed_reference_is_reused_and_releases_the_copy(precision, tmp_path):
    overrides = [
        *SHORT,
        "method=dpo",
        "method.precompute_ref_logps=true",
        f"method.ref_cache_dir={tmp_path / 'c'}",
        f"trainer.precision={precision}",
    ]
    _, out = train(compose_train(overrides, tmp_path))
    module = out["module"]
    assert module.ref is None, "the frozen copy is released once every row is stored"
    cache = module.ref_cache
    assert len(cache) == 16 + 4 and list((tmp_path / "c").glob("ref-logps-*.pt"))
    # The stored values are the reference's: recompute a few rows with a fresh frozen copy of the start.
    fresh = instantiate(out["cfg"].model)  # the run's settings: eager and sdpa attention differ in bf16
    rows = [out["datamodule"].train_dataset[i] for i in range(3)]
    batch = encode_pairs(fresh, rows)
    # Under mixed precision the policy runs in autocast, so its reference must too: values computed in
    # fp32 would shift every step's log-ratio by their rounding difference (~1e-3 nats here).
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed")
    with torch.no_grad(), autocast:
        logps, _ = ReferenceModel(fresh).token_logps(batch.inputs, batch.completion_mask)
    chosen, rejected = split_pairs(logps.sum(dim=1))
    stored = cache.get(rows)
    torch.testing.assert_close(stored[0].float(), chosen, atol=1e-4, rtol=0)
    torch.testing.assert_close(stored[1].float(), rejected, atol=1e-4, rtol=0)
    # The file's key: the start's path and weights, max_length, the processor's settings, the precision
    # and the attention kernel (so the two parametrised runs could not share a cache folder's values)
    settings = {
        "max_length": out["cfg"].method.max_length,
        "processor": processor_fingerprint(fresh.processor),
        "precision": precision,
        "attention": fresh.model.config._attn_implementation,
    }
    assert cache.key == model_key(fresh.model_name_or_path, weights_fingerprint(fresh.model), **settings)


def test_changed_row_or_model_does_not_reuse_stale_values(vlm, tmp_path):
    rows = synthetic_rows("preference", 2, seed=3)
    key = model_key("m", weights_fingerprint(vlm.model), max_length=None)
    cache = ReferenceLogpCache(tmp_path, key)
    cache.put(rows, torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0]))
    cache.save()
    assert ReferenceLogpCache(tmp_path, key).missing(rows) == []
    # One pixel of one image changes: that row misses, the other still hits.
    changed = [dict(rows[0]), rows[1]]
    image = rows[0]["images"][0].copy()
    image.putpixel((0, 0), (1, 2, 3))
    changed[0]["images"] = [image]
    assert row_key(changed[0]) != row_key(rows[0])
    assert ReferenceLogpCache(tmp_path, key).missing(changed) == [0]
    # So does a changed answer.
    other = {**rows[1], "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "blue"}]}]}
    assert ReferenceLogpCache(tmp_path, key).missing([other]) == [0]
    # One changed weight gives another model key: nothing of the old file is read.
    with torch.no_grad():
        p = next(vlm.model.parameters())
        p[0].add_(1e-3)
        new_key = model_key("m", weights_fingerprint(vlm.model), max_length=None)
        p[0].sub_(1e-3)
    assert new_key != key
    assert ReferenceLogpCache(tmp_path, new_key).missing(rows) == [0, 1]
    assert model_key("m", weights_fingerprint(vlm.model), max_length=64) != key
    with pytest.raises(KeyError, match="row 0 of the batch has no precomputed"):
        ReferenceLogpCache(tmp_path, new_key).get(rows)


def test_a_changed_image_resolution_or_template_is_another_reference_key(vlm):
    # The same weights with fewer image tokens (max_pixels) give other reference log-probs: a shared
    # ref_cache_dir must not hand them the values of a run at the old resolution.
    from transformers import AutoProcessor

    path = vlm.model_name_or_path
    same = processor_fingerprint(AutoProcessor.from_pretrained(path))
    assert processor_fingerprint(vlm.processor) == same  # loaded twice: one key
    smaller = AutoProcessor.from_pretrained(path, max_pixels=3136)
    assert processor_fingerprint(smaller) != same
    templated = AutoProcessor.from_pretrained(path)
    templated.chat_template = templated.chat_template.replace("assistant", "model")
    assert processor_fingerprint(templated) != same
    weights = weights_fingerprint(vlm.model)
    keys = {
        model_key(path, weights, max_length=None, processor=f) for f in (same, processor_fingerprint(smaller))
    }
    assert len(keys) == 2


def test_lora_trains_adapters_only_and_its_reference_is_the_base(tmp_path):
    _, out = train(compose_train(["method=dpo", "lora=default", *SHORT], tmp_path))
    module = out["module"]
    vlm = module.vlm
    assert module.ref.shares_weights and module.ref.copy is None
    base = VLM(out["cfg"].model.model_name_or_path)
    base_params = dict(base.model.named_parameters())
    adapters_moved = 0
    for name, p in vlm.model.named_parameters():
        if "lora_B" in name:
            adapters_moved += int(p.detach().abs().max() > 0)  # lora_B starts at zero
        elif not trained_by_lora(name):
            torch.testing.assert_close(p.detach(), base_params[base_name(name)].detach(), atol=0, rtol=0)
    assert adapters_moved > 0
    rows = synthetic_rows("preference", 3, seed=7)
    batch = encode_pairs(vlm, rows)
    ref_logps, _ = module.ref.token_logps(batch.inputs, batch.completion_mask)
    with torch.no_grad():
        base_logps, _ = base.token_logps(batch.inputs, batch.completion_mask)
        policy_logps, _ = vlm.token_logps(batch.inputs, batch.completion_mask)
    torch.testing.assert_close(ref_logps, base_logps, atol=1e-5, rtol=0)
    assert (policy_logps - base_logps).abs().max() > 1e-4


def test_a_prompt_longer_than_max_length_is_named_by_its_question(vlm):
    rows = synthetic_rows("preference", 2, seed=1)
    question = rows[0]["prompt"][0]["content"][-1]["text"]
    with pytest.raises(ValueError, match="row 0 of the batch") as err:
        encode_pairs(vlm, rows, max_length=5)
    assert repr(question[:20])[:-1] in str(err.value) and "with 1 image)" in str(err.value)


def test_a_max_length_that_cuts_a_pair_to_the_same_tokens_warns(vlm, caplog):
    # "The shape in the picture is red" / "... blue" cut to their shared words: the pair's DPO loss is
    # log 2 with no gradient, trained on nothing, without a word (SFT warns for an answer cut away).
    rows = synthetic_rows("preference", 2, seed=1)
    for row in rows:
        for column, colour in (("chosen", "red"), ("rejected", "blue")):
            text = {"type": "text", "text": f"The shape in the picture is {colour}"}
            row[column] = [{"role": "assistant", "content": [text]}]
    prompts = vlm.encode_prompts([r["prompt"] for r in rows], [r["images"] for r in rows])
    longest = int(prompts["attention_mask"].sum(dim=1).max())
    reset_recurring()
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        encode_pairs(vlm, rows, max_length=longest + 20)
        assert "the same tokens" not in caplog.text
        encode_pairs(vlm, rows, max_length=longest + 2)
    cut = f"max_length={longest + 2} cut both answers of 2 pairs of this batch to the same tokens"
    assert cut in caplog.text


def test_a_pair_the_template_renders_alike_warns(tiny_path, caplog):
    # Real Gemma 3's template trims each text: "Yes" and "Yes\n" (different rows, so accepted) became the
    # same tokens, and the pair's loss a constant (log 2), trained on nothing without a word.
    vlm = VLM(tiny_path("gemma3"))
    template = vlm.processor.chat_template
    vlm.processor.chat_template = template.replace("{{ block['text'] }}", "{{ block['text'] | trim }}")
    assert vlm.processor.chat_template != template
    rows = synthetic_rows("preference", 2, seed=1)
    rows[0]["chosen"] = [{"role": "assistant", "content": [{"type": "text", "text": "Yes"}]}]
    rows[0]["rejected"] = [{"role": "assistant", "content": [{"type": "text", "text": "Yes\n"}]}]
    reset_recurring()  # other tests' batches count too
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        encode_pairs(vlm, rows)
    assert "both answers of 1 pair of this batch render to the same tokens" in caplog.text
    assert "What" in caplog.text  # the row, by its question
    # Such a pair comes back every epoch, and many of them at every step: said at batches 1, 2, 4, 8, ...
    for _ in range(7):
        encode_pairs(vlm, rows)
    said = [r.getMessage() for r in caplog.records if "render to the same tokens" in r.getMessage()]
    assert len(said) == 4 and said[-1].endswith(
        "[batch 8 so far with this warning; it is said again at batch 16]"
    )


def test_each_run_counts_its_own_recurring_warnings(tmp_path, caplog):
    # A sweep's next job (train.py or eval.py -m) continued the last job's counts: its first batches unsaid.
    from lightning_vlm.recurring import warn_recurring
    from lightning_vlm.training import build

    log = logging.getLogger("lightning_vlm.test")
    reset_recurring()
    for _ in range(4):  # the 5th would be unsaid
        warn_recurring(log, "kind", "a row trains on nothing")
    build(compose_train(["method=dpo", *SHORT], tmp_path))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        warn_recurring(log, "kind", "a row trains on nothing")
    assert caplog.messages == ["a row trains on nothing"]


def test_two_runs_sharing_a_reference_cache_folder_both_save_and_a_damaged_file_is_skipped(
    tmp_path, monkeypatch, caplog
):
    # A sweep's jobs sharing method.ref_cache_dir wrote one temporary name (ref-logps-<key>-rank0.tmp), so
    # one job's rename could take the other's file, and the last writer's file dropped the other's rows.
    import threading

    rows = synthetic_rows("preference", 6, seed=1)
    a, b, c = (ReferenceLogpCache(tmp_path, "k") for _ in range(3))
    a.put(rows[:2], torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]))
    b.put(rows[2:4], torch.tensor([5.0, 6.0]), torch.tensor([7.0, 8.0]))
    c.put(rows[4:], torch.tensor([9.0, 9.5]), torch.tensor([0.0, 0.5]))
    save, others = torch.save, []

    def meanwhile(obj, path, *args, **kwargs):  # another job saves while a's file is being written
        if not others:
            others.append(threading.Thread(target=b.save))
            others[0].start()
            others[0].join(timeout=1.0)  # it waits for a's write to end
        save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", meanwhile)
    a.save()
    others[0].join()
    c.save()
    assert ReferenceLogpCache(tmp_path, "k").missing(rows) == []
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))
    # A damaged file (a copy cut short) is named and skipped: its rows are computed again
    (tmp_path / "ref-logps-k-rank1.pt").write_bytes(b"PK\x03\x04 cut short")
    with caplog.at_level(logging.WARNING, logger="lightning_vlm"):
        cache = ReferenceLogpCache(tmp_path, "k")
    assert "ref-logps-k-rank1.pt" in caplog.text and "computed again" in caplog.text
    assert cache.missing(rows) == []
