"""The VLM wrapper on every tiny family: encoding, the image-token check, slicing, log-probs, reference."""

from __future__ import annotations

import pytest
import torch

from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.models.image_tokens import TOKEN_KEYS, merge_image_inputs, split_image_inputs
from lightning_vlm.models.logprobs import naive_token_logps
from lightning_vlm.models.reference import ReferenceModel
from lightning_vlm.models.tiny import TINY_FAMILIES
from lightning_vlm.models.vlm import VLM

FAMILIES = TINY_FAMILIES


@pytest.fixture(scope="module")
def vlms(tiny_path):
    cache: dict[str, VLM] = {}

    def get(family: str) -> VLM:
        if family not in cache:
            torch.manual_seed(0)
            cache[family] = VLM(tiny_path(family))
        return cache[family]

    return get


def sft_rows(text_only: bool = False) -> list[dict]:
    """Three SFT rows: different image sizes, and one row with two images; with ``text_only`` a
    fourth row without any image (the mixed batch every trainer gets wrong somewhere)."""
    rows = synthetic_rows("sft", 3, seed=1)
    rows[1]["images"] = [rows[1]["images"][0].resize((84, 140))]
    two = synthetic_rows("sft", 1, seed=2)[0]["images"][0]
    rows[2]["images"] = [rows[2]["images"][0], two]
    rows[2]["messages"][0]["content"].insert(0, {"type": "image"})
    if text_only:
        row = synthetic_rows("sft", 1, seed=5)[0]
        row["images"] = []
        row["messages"][0]["content"] = [b for b in row["messages"][0]["content"] if b["type"] == "text"]
        rows.insert(1, row)
    return rows


def naive(vlm: VLM, inputs: dict, mask: torch.Tensor, temperature: float):
    logits = vlm.model(**vlm.model_inputs(inputs)).logits
    return naive_token_logps(logits, inputs["input_ids"], mask, temperature)


@pytest.mark.parametrize("family", FAMILIES)
def test_token_logps_equal_full_log_softmax(vlms, family):
    vlm = vlms(family)
    inputs = vlm.encode_sft(sft_rows())
    mask = torch.ones_like(inputs["input_ids"], dtype=torch.bool) & inputs["attention_mask"].bool()
    for temperature in (1.0, 0.7):
        with torch.no_grad():
            logps, entropy = vlm.token_logps(inputs, mask, temperature, return_entropy=True, chunk_size=16)
            ref_logps, ref_entropy = naive(vlm, inputs, mask, temperature)
        torch.testing.assert_close(logps, ref_logps, atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=0)
    # With autograd on (chunk checkpointing path) the values are the same and gradients flow.
    logps, _ = vlm.token_logps(inputs, mask, 0.7, chunk_size=16)
    torch.testing.assert_close(logps.detach(), ref_logps, atol=1e-5, rtol=0)
    logps.sum().backward()
    assert vlm.lm_head.weight.grad is not None and vlm.lm_head.weight.grad.abs().sum() > 0
    vlm.model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("family", ["gemma4", "gemma3"])
def test_token_logps_apply_the_final_logit_softcap_the_model_forward_applies(tiny_path, family):
    # Gemma 4's logits are soft-capped (cap · tanh(logits / cap)) after the LM head; the log-probs taken
    # from the hidden states skipped it, unlike generate and vLLM. Gemma 3's image-text class does not
    # cap (only its text-only one does), whatever its config says: the log-probs follow each forward.
    torch.manual_seed(0)
    vlm = VLM(tiny_path(family))
    vlm.config.get_text_config().final_logit_softcapping = 1.0
    inputs = vlm.encode_sft(sft_rows())
    mask = inputs["attention_mask"].bool()
    with torch.no_grad():
        logps, _ = vlm.token_logps(inputs, mask, 0.7, chunk_size=16)
        ref_logps, _ = naive(vlm, inputs, mask, 0.7)
        logits = vlm.lm_head(vlm.hidden_states(inputs))
        uncapped, _ = naive_token_logps(logits, inputs["input_ids"], mask, 0.7)
    capped = bool((uncapped - ref_logps).abs().max() > 1e-3)
    assert capped == (family == "gemma4"), (
        "the cap must change Gemma 4's values for the test to mean anything"
    )
    torch.testing.assert_close(logps, ref_logps, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_labels_cover_assistant_turn_and_end_of_turn(vlms, family):
    vlm = vlms(family)
    rows = sft_rows()
    inputs = vlm.encode_sft(rows)
    for b, row in enumerate(rows):
        labelled = inputs["labels"][b][inputs["labels"][b] != -100].tolist()
        answer = row["messages"][-1]["content"][0]["text"]
        assert labelled[-1] == vlm.end_of_turn_id
        assert vlm.tokenizer.decode(labelled[:-1]).strip() == answer
    assert (inputs["attention_mask"][:, 0] == 1).all(), "SFT batches are right-padded"


@pytest.mark.parametrize("family", FAMILIES)
def test_per_sample_slicing_round_trips_and_matches_solo_forward(vlms, family):
    vlm = vlms(family)
    inputs = vlm.encode_sft(sft_rows(text_only=True))
    samples = split_image_inputs(inputs, vlm.config)
    merged = merge_image_inputs(samples, vlm.config)
    for key, value in merged.items():
        assert torch.equal(value, inputs[key]), key
    mask = inputs["labels"] != -100
    with torch.no_grad():
        batched, _ = vlm.token_logps(inputs, mask)
        for b, extras in enumerate(samples):
            n = int(inputs["attention_mask"][b].sum())
            solo = {k: inputs[k][b : b + 1, :n] for k in TOKEN_KEYS if k in inputs}
            solo |= {k: v for k, v in extras.items()} | {"num_images": inputs["num_images"][b : b + 1]}
            alone, _ = vlm.token_logps(solo, mask[b : b + 1, :n])
            torch.testing.assert_close(alone[0], batched[b, :n], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_cut_image_tokens_raise_naming_the_sample(vlms, family):
    vlm = vlms(family)
    rows = sft_rows()
    inputs = vlm.encode_sft(rows)
    image_id = vlm.config.image_token_id
    # Keeps all of row 0's image tokens but cuts through row 2's second image.
    last_image_row0 = int((inputs["input_ids"][0] == image_id).nonzero()[-1])
    with pytest.raises(ValueError, match="sample 1: .* would cut its image tokens") as err:
        vlm.encode_sft([rows[0], rows[2]], max_length=last_image_row0 + 1)
    # rows carry no dataset index: the message quotes the row's question and counts its images
    question = rows[2]["messages"][0]["content"][-1]["text"]
    assert f"(the row {question[:20]!r}"[:-1] in str(err.value) and "with 2 images)" in str(err.value)
    broken = dict(inputs)
    broken["input_ids"] = inputs["input_ids"].clone()
    broken["input_ids"][2, (inputs["input_ids"][2] == image_id).nonzero()[0]] = vlm.pad_token_id
    for key in ("token_type_ids", "mm_token_type_ids"):
        broken.pop(key, None)
    with pytest.raises(ValueError, match=r"sample 2: \d+ image tokens in input_ids but its images need \d+"):
        vlm.token_logps(broken, broken["labels"] != -100)
    # Text after the last image may be truncated; labels and masks are cut together.
    short = vlm.encode_sft(rows, max_length=int(inputs["attention_mask"].sum(1).max()) - 1)
    assert short["input_ids"].shape == short["labels"].shape == short["attention_mask"].shape
    vlm.check_image_tokens(short)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_type_ids_padded_apart_from_input_ids_raise(vlms, family):
    vlm = vlms(family)
    inputs = vlm.encode_sft(sft_rows())
    key = "mm_token_type_ids" if "mm_token_type_ids" in inputs else "token_type_ids"
    inputs[key] = inputs[key].roll(1, dims=1)
    with pytest.raises(ValueError, match=f"sample 0: {key}"):
        vlm.check_image_tokens(inputs)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_completion_left_padding_gives_the_same_logps(vlms, family):
    vlm = vlms(family)
    rows = synthetic_rows("prompt", 4, seed=3)
    rows[0]["images"] = [rows[0]["images"][0].resize((140, 84))]
    # A text-only row and a row with three images of different sizes, left-padded together.
    rows[1]["images"] = []
    rows[1]["prompt"][0]["content"] = [b for b in rows[1]["prompt"][0]["content"] if b["type"] == "text"]
    image = rows[3]["images"][0]
    rows[3]["images"] = [image.resize((64, 64)), image, image.resize((96, 160))]
    rows[3]["prompt"][0]["content"][:0] = [{"type": "image"}, {"type": "image"}]
    completions = [[5 + 7, 40, vlm.end_of_turn_id], [41, vlm.end_of_turn_id], [42, 43, 44, 45], [46, 47]]
    completions = [[t if t not in vlm.suppressed_token_ids else 60 for t in c] for c in completions]
    inputs = vlm.encode_prompt_completion(rows, completions)
    assert (inputs["attention_mask"][:, -1] == torch.tensor([0, 0, 1, 0])).all()
    assert inputs["completion_mask"].sum(1).tolist() == [3, 2, 4, 2]
    assert inputs["num_images"].tolist() == [1, 0, 1, 3]
    with torch.no_grad():
        batched, _ = vlm.token_logps(inputs, inputs["completion_mask"].bool())
        for b in range(4):
            alone = vlm.encode_prompt_completion(rows[b : b + 1], completions[b : b + 1])
            solo, _ = vlm.token_logps(alone, alone["completion_mask"].bool())
            got = batched[b][inputs["completion_mask"][b].bool()]
            torch.testing.assert_close(got, solo[0][alone["completion_mask"][0].bool()], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_targets_language_model_only_and_reference_is_the_base(tiny_path, family, tmp_path):
    path = tiny_path(family)
    torch.manual_seed(0)
    base = VLM(path)
    vlm = VLM(path, lora={"r": 4, "lora_alpha": 8})
    lora_names = [n for n, _ in vlm.model.named_parameters() if "lora_" in n]
    assert lora_names and all(".language_model." in n or ".text_model." in n for n in lora_names)
    assert all(not p.requires_grad for p in vlm.vision_tower.parameters())
    with torch.no_grad():  # make the adapters matter
        for name, p in vlm.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    ref = ReferenceModel(vlm)
    assert ref.shares_weights
    n_params = sum(p.numel() for p in vlm.model.parameters())
    inputs = vlm.encode_sft(sft_rows())
    mask = inputs["labels"] != -100
    vlm.model.train()
    ref_logps, _ = ref.token_logps(inputs, mask)
    assert vlm.model.training, "the policy's mode is restored"
    with torch.no_grad():
        base_logps, _ = base.token_logps(inputs, mask)
        policy_logps, _ = vlm.token_logps(inputs, mask)
    torch.testing.assert_close(ref_logps, base_logps, atol=1e-5, rtol=0)
    assert (policy_logps - base_logps).abs().max() > 1e-3
    assert sum(p.numel() for p in vlm.model.parameters()) == n_params
    # Gradients reach the adapters only; the merged save loads as a plain model with the same log-probs.
    vlm.token_logps(inputs, mask)[0].sum().backward()
    grads = {n: p.grad for n, p in vlm.model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    vlm.model.eval()
    vlm.save_pretrained(tmp_path / "merged")
    with torch.no_grad():
        merged, _ = VLM(str(tmp_path / "merged")).eval().token_logps(inputs, mask)
        policy_logps, _ = vlm.token_logps(inputs, mask)
    torch.testing.assert_close(merged, policy_logps, atol=1e-4, rtol=0)


def test_frozen_copy_reference_keeps_initial_weights(tiny_path):
    vlm = VLM(tiny_path("gemma3"), gradient_checkpointing=True)
    ref = ReferenceModel(vlm)
    assert not ref.shares_weights and all(not p.requires_grad for p in ref.copy.parameters())
    inputs = vlm.encode_sft(sft_rows())
    mask = inputs["labels"] != -100
    before, _ = ref.token_logps(inputs, mask)
    vlm.model.train()
    logps, _ = vlm.token_logps(inputs, mask)  # gradient checkpointing path
    (-logps.sum()).backward()
    with torch.no_grad():
        for p in vlm.model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    after, _ = ref.token_logps(inputs, mask)
    torch.testing.assert_close(before, after)
    with torch.no_grad():
        moved, _ = vlm.token_logps(inputs, mask)
    assert (moved - before).abs().max() > 1e-3


def test_the_processor_comes_from_the_model_kwargs_cache_too(tiny_path, tmp_path, monkeypatch):
    # A hub id in a cache of its own (model.model_kwargs.cache_dir), offline: the weights were read from
    # there, the processor (tokenizer, chat template, image settings) from the default cache, where it
    # is not, so the model failed to load after the source check had passed.
    import shutil

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny--qwen" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_path(), snapshot)
    (cache / "models--tiny--qwen" / "refs").mkdir()
    (cache / "models--tiny--qwen" / "refs" / "main").write_text("0" * 40)
    vlm = VLM("tiny/qwen", model_kwargs={"cache_dir": str(cache)})
    assert vlm.tokenizer("red")["input_ids"]


def test_lora_refuses_an_unfrozen_vision_tower_it_would_not_train(tiny_path, tmp_path):
    # PEFT froze the tower whatever model.freeze_vision_tower said (and left it in train mode).
    from helpers import compose_train

    with pytest.raises(ValueError, match="freeze_vision_tower=false with LoRA"):
        VLM(tiny_path(), lora={"r": 4}, freeze_vision_tower=False)
    # adapters that reach into the tower train it: accepted
    vlm = VLM(tiny_path(), lora={"r": 4, "target_modules": "all-linear"}, freeze_vision_tower=False)
    assert any(p.requires_grad for p in vlm.vision_tower.parameters())
    # lora=default freezes it, also on the tiny models (which train it without LoRA)
    assert compose_train(["lora=default"], tmp_path).model.freeze_vision_tower is True
    assert compose_train([], tmp_path).model.freeze_vision_tower is False


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_user_lora_targets_leave_a_frozen_vision_tower_frozen(tiny_path, family, targets):
    # "all-linear" and [q_proj, v_proj] name the tower's layers too: PEFT put trainable adapters there, so
    # the "frozen" tower trained (in eval mode, its LoRA dropout off).
    vlm = VLM(tiny_path(family), lora={"r": 4, "target_modules": targets}, freeze_vision_tower=True)
    assert not [n for n, p in vlm.vision_tower.named_parameters() if p.requires_grad]
    assert [n for n, p in vlm.language_model.named_parameters() if p.requires_grad]


def test_lora_settings_that_train_a_frozen_vision_tower_are_refused(tiny_path):
    # a user's own exclude_modules replaces the tower's exclusion: adapters in the tower are named, not trained
    with pytest.raises(ValueError, match="freeze_vision_tower=true, but model.lora makes"):
        VLM(tiny_path(), lora={"r": 4, "target_modules": "all-linear", "exclude_modules": ["lm_head"]},
            freeze_vision_tower=True)  # fmt: skip


def test_inputs_that_would_score_other_tokens_are_refused(vlms):
    vlm = vlms("qwen2_5_vl")
    rows = synthetic_rows("prompt", 2, seed=1)
    eot = vlm.end_of_turn_id
    # generate's padded output without a mask: the padding after the end of turn was scored
    with pytest.raises(ValueError, match="need completion_mask"):
        vlm.encode_prompt_completion(rows, torch.tensor([[40, 41, eot], [42, eot, vlm.pad_token_id]]))
    inputs = vlm.encode_prompt_completion(rows, [[40, 41, eot], [42, eot]])
    completion_only = inputs["completion_mask"][:, -3:].bool()  # TRL's [B, T] completion mask
    with pytest.raises(ValueError, match=r"target_mask has shape \(2, 3\) but input_ids"):
        vlm.token_logps(inputs, completion_only)
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    with pytest.raises(ValueError, match="not labels"):
        vlm.token_logps(inputs, labels)


def test_llava_with_a_siglip_tower_counts_its_image_tokens(tiny_path, tmp_path):
    # A SigLIP tower has no CLS token (llava-interleave, strategy "full"): 16 tokens an image here, where
    # the count assumed CLIP's extra token and refused the processor's valid batch (17 expected).
    import json
    import shutil

    folder = tmp_path / "llava_siglip"
    shutil.copytree(tiny_path("llava"), folder)
    config = json.loads((folder / "config.json").read_text())
    vision = config["vision_config"]
    config["vision_config"] = {"model_type": "siglip_vision_model", "image_size": 56, "patch_size": 14,
                               **{k: vision[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                         "num_attention_heads")}}  # fmt: skip
    config["vision_feature_select_strategy"] = "full"
    (folder / "config.json").write_text(json.dumps(config))
    processor = json.loads((folder / "processor_config.json").read_text())
    processor.update(num_additional_image_tokens=0, vision_feature_select_strategy="full")
    (folder / "processor_config.json").write_text(json.dumps(processor))
    vlm = VLM(str(folder), model_kwargs={"ignore_mismatched_sizes": True})
    inputs = vlm.encode_sft(sft_rows())
    assert (inputs["input_ids"] == vlm.config.image_token_id).sum(1).tolist() == [16, 16, 32]
    mask = inputs["labels"] != -100
    with torch.no_grad():
        logps, _ = vlm.token_logps(inputs, mask)
        torch.testing.assert_close(logps, naive(vlm, inputs, mask, 1.0)[0], atol=1e-5, rtol=0)


def test_an_audio_tower_no_method_feeds_is_frozen(tiny_path, tmp_path):
    # Gemma 4 E2B/E4B carry an audio tower: trainable, it got no gradient (DDP without
    # find_unused_parameters refuses that), and "all-linear" LoRA put adapters in it.
    import json
    import shutil

    folder = tmp_path / "gemma4_audio"
    shutil.copytree(tiny_path("gemma4"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["audio_config"] = {"model_type": "gemma4_audio", "hidden_size": 32, "num_hidden_layers": 1,
                              "num_attention_heads": 2, "subsampling_conv_channels": [8, 4], "output_proj_dims": 32}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    for lora in (None, {"r": 4, "target_modules": "all-linear"}):
        vlm = VLM(str(folder), lora=lora, freeze_vision_tower=False)
        audio = [n for n, _ in vlm.hf_model.named_parameters() if "audio" in n]
        assert audio and not [
            n for n, p in vlm.hf_model.named_parameters() if "audio" in n and p.requires_grad
        ]
    assert any(p.requires_grad for p in vlm.vision_tower.parameters())  # the tower itself still trains


def test_gemma3_pan_and_scan_is_refused_naming_the_setting(tiny_path):
    # Its crops give an image several pixel rows; the batch was refused later, blaming sliced tensors.
    with pytest.raises(ValueError, match=r"model.processor_kwargs.do_pan_and_scan=true"):
        VLM(tiny_path("gemma3"), processor_kwargs={"do_pan_and_scan": True})


def test_the_frozen_copy_follows_the_policys_weight_dtype(tiny_path):
    # DeepSpeed's bf16 casts the policy's weights to bf16 with no autocast; the copy stayed fp32, so the
    # reference scored other log-probs than the policy from step 0.
    vlm = VLM(tiny_path())
    ref = ReferenceModel(vlm)
    vlm.hf_model.to(torch.bfloat16)  # what the DeepSpeed engine does to the module it wraps
    ref.to("cpu")
    assert {p.dtype for p in ref.copy.parameters()} == {torch.bfloat16}
    inputs = vlm.encode_sft(sft_rows())
    mask = inputs["labels"] != -100
    with torch.no_grad():
        torch.testing.assert_close(ref.token_logps(inputs, mask)[0], vlm.token_logps(inputs, mask)[0])
