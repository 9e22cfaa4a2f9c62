"""KTO: the loss against hand-computed values (TRL's form of the paper's), the reference point, the
ranking accuracy, unpaired rows and their errors, and one vision pass per row."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from PIL import Image

from lightning_vlm.data.row_error import RowError
from lightning_vlm.data.rows import normalize_row
from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.losses.kto import (
    kto_losses,
    kto_metrics,
    kto_reference_point,
    kto_weight_advice,
    ranking_accuracy,
)


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_kto_loss_matches_hand_computation():
    r, desirable = t(1.0, -1.0), torch.tensor([True, False])
    losses = kto_losses(r, desirable, z0=0.5, beta=1.0)
    # desirable: 1 - σ(β(r - z0)) = σ(-0.5); undesirable: 1 - σ(β(z0 - r)) = σ(-1.5)
    torch.testing.assert_close(losses, t(sig(-0.5), sig(-1.5)))
    weighted = kto_losses(r, desirable, z0=0.5, beta=2.0, desirable_weight=0.5, undesirable_weight=3.0)
    torch.testing.assert_close(weighted, t(0.5 * sig(-1.0), 3.0 * sig(-3.0)))


def test_apo_zero_unpaired_has_no_reference_point():
    r, desirable = t(1.0, -1.0), torch.tensor([True, False])
    losses = kto_losses(r, desirable, z0=123.0, beta=0.5, loss_type="apo_zero_unpaired")
    torch.testing.assert_close(losses, t(1 - sig(0.5), sig(-0.5)))
    torch.testing.assert_close(kto_losses(r, desirable, None, 0.5, loss_type="apo_zero_unpaired"), losses)
    with pytest.raises(ValueError, match="needs the reference point z0"):
        kto_losses(r, desirable, None, 0.5)
    # No z0, no kl metric (TRL logs 0 there, which would read as a measured KL).
    assert "kl" not in kto_metrics(r, desirable, None, beta=0.5, logps=t(-1.0, -2.0))


def test_the_gradient_raises_desirable_and_lowers_undesirable_rewards():
    r = t(0.2, 0.2).requires_grad_()
    kto_losses(r, torch.tensor([True, False]), z0=0.0, beta=0.1).sum().backward()
    assert r.grad[0] < 0 < r.grad[1]


def test_reference_point_is_the_detached_mean_clamped_at_zero():
    kl = t(0.3, 0.9).requires_grad_()
    z0 = kto_reference_point(kl)
    assert z0.item() == pytest.approx(0.6) and not z0.requires_grad
    assert kto_reference_point(t(-1.0, 0.2)).item() == 0.0  # a KL estimate below 0 is noise: clamp
    assert kto_reference_point(t()).item() == 0.0


def test_ranking_accuracy_is_the_share_of_desirable_over_undesirable_pairs():
    rewards = t(1.0, 0.0, 0.5, 0.5)
    desirable = torch.tensor([True, False, True, False])
    # (1 > 0), (1 > 0.5), (0.5 > 0), (0.5 = 0.5) -> 3.5 / 4
    assert ranking_accuracy(rewards, desirable).item() == pytest.approx(0.875)
    assert torch.isnan(ranking_accuracy(rewards, torch.ones(4, dtype=torch.bool)))


def test_metrics_follow_trls_names():
    r, desirable = t(1.0, -1.0, 3.0), torch.tensor([True, False, True])
    m = kto_metrics(r, desirable, torch.tensor(0.25), beta=0.1, logps=t(-1.0, -2.0, -3.0))
    assert m["rewards/chosen"].item() == pytest.approx(0.2)  # β · mean(1, 3)
    assert m["rewards/rejected"].item() == pytest.approx(-0.1)
    assert m["rewards/margins"].item() == pytest.approx(0.3)
    assert m["logps/chosen"].item() == pytest.approx(-2.0) and m["kl"].item() == 0.25


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"loss_type": "sigmoid"}, "KTO loss_type must be one of"), ({"beta": 0.0}, "beta must be > 0")],
)
def test_bad_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kto_losses(t(1.0), torch.tensor([True]), 0.0, **kwargs)


@pytest.mark.parametrize(
    ("counts", "weights", "ranges"),
    [
        ((100, 100), (1.0, 1.0), None),  # ratio 1: the range's low end
        ((4, 3), (1.0, 1.0), None),  # 4/3: its high end
        ((100, 100), (1.0, 0.8), None),  # 1.25
        # ratio 3: λ_D in [1·1/3, 4/3·1/3], or λ_U in [3·3/4, 3] (rounded inwards)
        ((300, 100), (1.0, 1.0), ("0.334, 0.444", "2.25, 3")),
        # ratio 1.5: λ_D in [0.667, 0.888], λ_U in [1.13, 1.5]: 1.12 would give 1.34, still out
        ((3, 2), (1.0, 1.0), ("0.667, 0.888", "1.13, 1.5")),
        # balanced data, λ_D = 2 (TRL says nothing): λ_D in [1, 1.33] or λ_U in [1.5, 2]
        ((100, 100), (2.0, 1.0), ("1, 1.33", "1.5, 2")),
        # TRL's docs' 1:10 example: λ_D in [10, 13.3] or λ_U in [0.075, 0.1]
        ((100, 1000), (1.0, 1.0), ("10, 13.3", "0.075, 0.1")),
    ],
)
def test_weight_advice_keeps_the_papers_ratio_range(counts, weights, ranges):
    advice = kto_weight_advice(*counts, *weights)
    if ranges is None:
        assert advice is None
    else:
        assert (
            f"method.desirable_weight in [{ranges[0]}]" in advice
            and f"method.undesirable_weight in [{ranges[1]}]" in advice
        )


@pytest.mark.parametrize("counts", [(3, 2), (2, 3), (7, 1000), (1000, 7), (13, 9)])
def test_every_advised_bound_is_inside_the_range(counts):
    import re

    advice = kto_weight_advice(*counts, 1.0, 1.0)
    (d_low, d_high), (u_low, u_high) = [
        map(float, m) for m in re.findall(r"in \[([\d.e+-]+), ([\d.e+-]+)\]", advice)
    ]
    n_d, n_u = counts
    for weight_d, weight_u in ((d_low, 1.0), (d_high, 1.0), (1.0, u_low), (1.0, u_high)):
        assert kto_weight_advice(n_d, n_u, weight_d, weight_u) is None, (weight_d, weight_u)


def test_weight_advice_names_a_missing_label():
    assert "no undesirable rows (5 desirable, 0 undesirable)" in kto_weight_advice(5, 0, 1.0, 1.0)
    assert "no desirable rows" in kto_weight_advice(0, 5, 1.0, 1.0)
    assert "method.undesirable_weight is 0" in kto_weight_advice(5, 5, 1.0, 0.0)  # not a division by 0
    assert "method.desirable_weight is 0" in kto_weight_advice(5, 5, 0.0, 1.0)


def test_unpaired_rows_normalise_and_bad_labels_name_row_and_column():
    row = {"prompt": "What color?", "completion": "red", "label": 1, "images": []}
    out = normalize_row(row, "unpaired")
    assert out["label"] is True and out["completion"][0]["role"] == "assistant"
    with pytest.raises(RowError, match=r"row 7.*'label'.*'yes'"):
        normalize_row({**row, "label": "yes"}, "unpaired", index=7)
    with pytest.raises(RowError, match="label"):
        normalize_row({"prompt": "p", "completion": "c"}, "unpaired", index=0)


def test_synthetic_unpaired_rows_alternate_labels_one_per_prompt():
    rows = synthetic_rows("unpaired", 6)
    assert [r["label"] for r in rows] == [True, False] * 3
    for r in rows:
        answer = r["completion"][0]["content"][0]["text"]
        assert (answer == r["solution"]) == r["label"]


def test_one_vision_pass_per_row_gives_the_naive_log_probs(tiny_path):
    # Each row is encoded with the previous row's answer as its mismatched completion: same images.
    from lightning_vlm.methods.preference_batch import encode_pairs
    from lightning_vlm.models.vlm import VLM

    rows = synthetic_rows("unpaired", 3)
    pairs = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": rows[i - 1]["completion"],
              "images": r["images"]} for i, r in enumerate(rows)]  # fmt: skip
    vlm = VLM(tiny_path())
    once = encode_pairs(vlm, pairs, one_vision_pass=True)
    naive = encode_pairs(vlm, pairs, one_vision_pass=False)
    a, _ = vlm.token_logps(once.inputs, once.completion_mask)
    b, _ = vlm.token_logps(naive.inputs, naive.completion_mask)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_apo_zero_unpaired_encodes_each_answer_once_with_kto_s_log_probs(tiny_path, caplog, monkeypatch):
    # Without a reference point, no mismatched answers: B sequences instead of 2B, the same log-probs of
    # the matched answers, and a batch of one row is no special case.
    from lightning_vlm.methods.kto import KTO
    from lightning_vlm.methods.preference_batch import encode_columns, encode_pairs, split_pairs
    from lightning_vlm.models.vlm import VLM

    vlm = VLM(tiny_path())
    apo = KTO(vlm, optimizer=lambda params: torch.optim.SGD(params, lr=0.0), loss_type="apo_zero_unpaired")
    with torch.no_grad():  # move the policy off its frozen reference, so the implicit rewards are not 0
        rng = torch.Generator().manual_seed(0)
        for p in vlm.parameters():
            p.add_(torch.randn(p.shape, generator=rng) * 0.02)
    rows = synthetic_rows("unpaired", 3)
    pairs = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": rows[i - 1]["completion"],
              "images": r["images"]} for i, r in enumerate(rows)]  # fmt: skip
    single, both = encode_columns(vlm, pairs, None, ("chosen",))[0], encode_pairs(vlm, pairs)
    caplog.clear()  # these made-up pairs may repeat an answer (encode_pairs says so); KTO's loss must say nothing
    assert single.inputs["input_ids"].shape[0] == 3 and both.inputs["input_ids"].shape[0] == 6
    with torch.no_grad():
        one = vlm.token_logps(single.inputs, single.completion_mask)[0].sum(dim=1)
        chosen, _ = split_pairs(vlm.token_logps(both.inputs, both.completion_mask)[0].sum(dim=1))
        ref = apo.ref.token_logps(single.inputs, single.completion_mask)[0].sum(dim=1)
    torch.testing.assert_close(one, chosen, atol=1e-5, rtol=1e-5)

    forward, sizes = vlm.token_logps, []

    def recording(inputs, *args, **kwargs):
        sizes.append(inputs["input_ids"].shape[0])
        return forward(inputs, *args, **kwargs)

    monkeypatch.setattr(vlm, "token_logps", recording)
    loss, metrics, _ = apo._loss(rows, train=False)
    assert sizes and set(sizes) == {3}, sizes  # each of the 3 rows once, in every pass
    desirable = torch.tensor([bool(r["label"]) for r in rows])
    expected = kto_losses(one - ref, desirable, None, 0.1, loss_type="apo_zero_unpaired").mean()
    assert (one - ref).abs().min() > 1e-3  # the check below is not the trivial r = 0 case
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-5)
    assert "kl" not in metrics
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.methods.kto"):
        loss, _, _ = apo._loss(rows[:1], train=False)
    assert torch.isfinite(loss) and not caplog.records


def test_a_one_row_batch_adds_nothing_to_the_reference_point(tiny_path, caplog):
    # An epoch's last batch may hold one row: no mismatched answer, so z0 = 0 here, and no error (under
    # DDP a raising rank would leave the others waiting in the gather).
    from lightning_vlm.methods.kto import KTO
    from lightning_vlm.models.vlm import VLM

    module = KTO(VLM(tiny_path()), optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
    # at_level on the module's logger: a train() run earlier in the session may have set propagation
    with caplog.at_level(logging.WARNING, logger="lightning_vlm.methods.kto"):
        loss, metrics, _ = module._loss(synthetic_rows("unpaired", 1), train=False)
    assert torch.isfinite(loss) and metrics["kl"].item() == 0.0
    assert any("adds nothing to the reference point" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("sizes", [(2, 2), (3, 2), (1, 1), (1, 0)])
def test_mismatched_answers_over_ranks_are_the_one_process_rotation(monkeypatch, sizes):
    # The global batch in the data's order, dealt round-robin to ranks as the sharding does (rank r gets
    # positions r, r + N, ...); each rank's pairs must be the one-process rotation's pairs of its rows.
    import lightning_vlm.methods.kto as kto

    total = sum(sizes)
    shards = [[{"prompt": f"q{p}", "completion": f"c{p}"} for p in range(r, total, len(sizes))]
              for r in range(len(sizes))]  # fmt: skip
    assert [len(s) for s in shards] == list(sizes)
    one = [f"c{p - 1 if p else total - 1}" for p in range(total)]  # one process: row p with row p - 1
    gathered = [[(kto.prompt_key(r), r["completion"]) for r in s] for s in shards]
    monkeypatch.setattr(kto, "all_gather_object", lambda obj: gathered)
    for rank, shard in enumerate(shards):
        monkeypatch.setattr(kto, "rank", lambda rank=rank: rank)
        got = kto.mismatched_completions(shard)
        if total < 2:
            assert got is None  # a single row over all ranks has no mismatched answer
        else:
            assert got == [one[int(r["completion"][1:])] for r in shard]


def test_mismatched_answers_come_from_other_prompts():
    # Paired data read as unpaired rows: each pair's two answers are neighbours. A plain rotation gave
    # every rejected row its own prompt's chosen answer, biasing z0 (always, unshuffled).
    import lightning_vlm.methods.kto as kto

    def row(q: str, answer: str, image=None) -> dict:
        return {"prompt": q, "completion": answer, "images": [] if image is None else [image]}

    rows = [row("q0", "good0"), row("q0", "bad0"), row("q1", "good1"), row("q1", "bad1"), row("q2", "good2")]
    assert kto.mismatched_completions(rows) == ["good2", "good2", "bad0", "bad0", "bad1"]
    # the same words about another image are another question
    red, blue = Image.new("RGB", (4, 4), "red"), Image.new("RGB", (4, 4), "blue")
    assert kto.mismatched_completions([row("q", "a", red), row("q", "b", blue)]) == ["b", "a"]
    # one prompt in the whole batch: no other answer exists, the rotation stays
    assert kto.mismatched_completions([row("q", "a"), row("q", "b"), row("q", "c")]) == ["c", "a", "b"]


def test_validation_means_are_over_the_rows_each_metric_describes(tiny_path):
    # Two batches with 2 + 1 and 1 + 2 desirable + undesirable rows: the epoch's rewards/chosen is the mean
    # over its 3 desirable rows (weights 2 and 1), not over batches or all rows; margins = chosen - rejected.
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_vlm.data.datamodule import collate_rows
    from lightning_vlm.methods.kto import KTO
    from lightning_vlm.models.vlm import VLM

    module = KTO(VLM(tiny_path()), optimizer=torch.optim.SGD, val_max_new_tokens=2)
    with torch.no_grad():  # move the policy off its reference, so the implicit rewards are not all 0
        rng = torch.Generator().manual_seed(0)
        for p in module.vlm.parameters():
            p.add_(torch.randn(p.shape, generator=rng) * 0.02)
    r = synthetic_rows("unpaired", 6)  # labels alternate: desirable rows 0, 2, 4
    batches = [[r[0], r[2], r[1]], [r[3], r[5], r[4]]]
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.validate(module, DataLoader([*batches[0], *batches[1]], batch_size=3, collate_fn=collate_rows))
    got = {k: v.item() for k, v in trainer.callback_metrics.items()}
    each = [module._loss(b, train=False)[1] for b in batches]
    for kind, weights in (("chosen", (2, 1)), ("rejected", (1, 2))):
        for name in (f"rewards/{kind}", f"logps/{kind}"):
            expected = sum(w * m[name].item() for w, m in zip(weights, each, strict=True)) / 3
            assert got[f"val/{name}"] == pytest.approx(expected, rel=1e-5), name
    assert got["val/rewards/margins"] == pytest.approx(
        got["val/rewards/chosen"] - got["val/rewards/rejected"]
    )
    assert got["val/loss"] == pytest.approx((each[0]["loss"].item() + each[1]["loss"].item()) / 2, rel=1e-5)


def test_a_batch_of_one_row_a_step_is_refused_before_training(tmp_path):
    # data.batch_size=1 on one process (a large VLM's usual setup): every step's z0 was 0, with a warning
    # each step. TRL refuses it; apo_zero_unpaired has no z0 and runs.
    from helpers import compose_train
    from lightning_vlm.training import train

    small = ["method=kto", "data.batch_size=1", "trainer.max_steps=1", "logger=none", "callbacks=none",
             "data.synthetic.num_train=4", "data.synthetic.num_val=2"]  # fmt: skip
    with pytest.raises(ValueError, match=r"needs at least 2 rows a step .* data.batch_size=1 on 1 process"):
        train(compose_train(small, tmp_path / "kto"))
    _, out = train(compose_train([*small, "method.loss_type=apo_zero_unpaired"], tmp_path / "apo"))
    assert out["trainer"].global_step == 1
