"""An adapter folder (``ExportHFModel(merge_lora=false)``) as ``model.model_name_or_path``: it loads as
the merged export of the same run, trains all its weights (or a new LoRA on the merged model, whose
reference is the loaded policy), and a second unmerged export chains back onto the first."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lightning_vlm.data.synthetic import synthetic_rows
from lightning_vlm.models.adapter_folder import adapter_chain
from lightning_vlm.models.model_source import check_model_source
from lightning_vlm.models.reference import ReferenceModel
from lightning_vlm.models.scale_guard import check_model_scale
from lightning_vlm.models.vlm import VLM

LORA = {"r": 8, "lora_alpha": 16}


def _logits(vlm: VLM) -> torch.Tensor:
    inputs = vlm.encode_sft(synthetic_rows("sft", 2, seed=3))
    inputs.pop("labels")
    with torch.no_grad():
        return vlm.model(**vlm.model_inputs(inputs)).logits


def _trainable(vlm: VLM) -> list[str]:
    return sorted(n.removeprefix("base_model.model.") for n, p in vlm.named_parameters() if p.requires_grad)


@pytest.fixture(scope="module")
def exports(tiny_path, tmp_path_factory):
    """A LoRA policy with random adapters (so it differs from its base), exported both ways."""
    root = tmp_path_factory.mktemp("adapter_folder")
    torch.manual_seed(0)
    policy = VLM(tiny_path(), lora={**LORA, "init_lora_weights": False}).eval()
    policy.save_pretrained(root / "adapter", merge_lora=False)
    policy.save_pretrained(root / "merged")
    assert not (root / "adapter" / "config.json").exists()
    return root, _logits(policy)


def test_an_adapter_folder_loads_and_trains_as_the_merged_export(exports):
    root, policy = exports
    merged, adapter = VLM(str(root / "merged")), VLM(str(root / "adapter"))
    torch.testing.assert_close(_logits(adapter.eval()), policy, atol=1e-5, rtol=1e-5)
    # transformers' own loading froze every weight (the adapter injected for inference): full
    # fine-tuning from the folder trained nothing, silently.
    assert not adapter.is_lora and _trainable(adapter) == _trainable(merged) != []
    assert adapter.full_model_path == adapter_chain(str(root / "adapter"))[0] != str(root / "adapter")


@pytest.mark.parametrize("kept", [(), ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")])
def test_a_bare_peft_adapter_folder_takes_its_processor_from_its_base(exports, tmp_path, kept):
    # PEFT's own save_pretrained writes the adapter alone (a hub LoRA repo often adds the tokenizer only):
    # the processor was loaded from the folder, and transformers' "Unrecognized processing class" or "Can't
    # load image processor" said nothing of the base model that has one.
    root, policy = exports
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors", *kept):
        shutil.copy(root / "adapter" / name, bare / name)
    vlm = VLM(str(bare))
    torch.testing.assert_close(_logits(vlm.eval()), policy, atol=1e-5, rtol=1e-5)


def test_a_new_lora_on_an_adapter_folder_adapts_the_loaded_policy(exports, tmp_path):
    root, policy = exports
    torch.manual_seed(1)
    vlm = VLM(str(root / "adapter"), lora=LORA)  # PEFT's NoMatchingPeftModuleError before
    assert vlm.is_lora and _trainable(vlm) and all(".lora_" in n for n in _trainable(vlm))
    # The reference (adapters off) is the loaded policy, not the base under the folder's adapter.
    torch.testing.assert_close(_logits(vlm.eval()), policy, atol=1e-5, rtol=1e-5)
    inputs = vlm.encode_sft(synthetic_rows("sft", 2, seed=3))
    mask = inputs.pop("labels") != -100
    reference = ReferenceModel(vlm)
    assert reference.shares_weights
    with torch.no_grad():
        ref_logps = reference.token_logps(inputs, mask)[0]
        torch.testing.assert_close(ref_logps, vlm.token_logps(inputs, mask)[0], atol=1e-5, rtol=1e-5)

    # One real step on the new adapter, exported unmerged again: it names the first folder as its
    # base, and loads back as the trained policy (both adapters merged, in order).
    opt = torch.optim.SGD([p for p in vlm.parameters() if p.requires_grad], lr=0.5)
    vlm.train()
    logps, _ = vlm.token_logps(inputs, mask)
    (-logps[mask].mean()).backward()
    opt.step()
    trained = _logits(vlm.eval())
    assert (trained - policy).abs().max() > 1e-3
    vlm.save_pretrained(tmp_path / "second", merge_lora=False)
    config = json.loads((tmp_path / "second" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((root / "adapter").resolve())
    chained = VLM(str(tmp_path / "second")).eval()
    torch.testing.assert_close(_logits(chained), trained, atol=1e-5, rtol=1e-5)
    check_model_scale("tiny", str(tmp_path / "second"))  # the chain's base is the tiny model


def test_an_adapter_folder_without_a_base_or_in_a_loop_names_its_config(exports, tmp_path):
    root, _ = exports
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    for name, base in (("nobase", None), ("a", str(tmp_path / "b")), ("b", str(tmp_path / "a"))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(
            json.dumps({**config, "base_model_name_or_path": base})
        )
    with pytest.raises(ValueError, match=r"nobase/adapter_config.json names no base_model_name_or_path"):
        adapter_chain(tmp_path / "nobase")
    with pytest.raises(ValueError, match="name each other as base"):
        adapter_chain(tmp_path / "a")


def test_an_adapter_repo_on_the_hub_loads_as_an_adapter_folder(exports, tmp_path):
    # The unmerged export pushed to the hub (push_to_hub=true, merge_lora=false), read by its repo id from
    # the hub cache: transformers alone would inject its adapter frozen, as for a local folder.
    root, policy = exports
    snapshot = tmp_path / "models--me--lora" / "snapshots" / ("0" * 40)
    shutil.copytree(root / "adapter", snapshot)
    (tmp_path / "models--me--lora" / "refs").mkdir()
    (tmp_path / "models--me--lora" / "refs" / "main").write_text("0" * 40)
    # What a download records for the files the repo lacks (offline lookups then know they are absent).
    absent = tmp_path / "models--me--lora" / ".no_exist" / ("0" * 40)
    absent.mkdir(parents=True)
    (absent / "config.json").touch()
    where = {"cache_dir": str(tmp_path)}
    assert adapter_chain("me/lora", **where) == (adapter_chain(str(root / "adapter"))[0], ["me/lora"])
    check_model_source("me/lora", cache_dir=str(tmp_path))  # offline: an adapter repo has no config.json
    vlm = VLM("me/lora", model_kwargs=where)
    torch.testing.assert_close(_logits(vlm.eval()), policy, atol=1e-5, rtol=1e-5)
    assert not vlm.is_lora and _trainable(vlm) == _trainable(VLM(str(root / "merged")))
    # A new LoRA on it, exported unmerged, names the hub repo as its base (not a local path).
    lora = VLM("me/lora", lora=LORA, model_kwargs=where)
    lora.save_pretrained(tmp_path / "second", merge_lora=False)
    config = json.loads((tmp_path / "second" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "me/lora"


def test_an_unmerged_export_names_its_local_base_by_absolute_path(tiny_path, tmp_path, monkeypatch):
    # "model.model_name_or_path=sft_model" then merge_lora=false: a relative base would be read against
    # whatever folder the adapter is later loaded from (or taken for a hub id).
    monkeypatch.chdir(Path(tiny_path()).parent)
    vlm = VLM(Path(tiny_path()).name, lora=LORA)
    vlm.save_pretrained(tmp_path / "adapter", merge_lora=False)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(Path(tiny_path()).resolve())


def test_the_server_launcher_serves_an_adapter_folder_merged(exports, monkeypatch):
    # vLLM needs a full model on disk: `python -m lightning_vlm.serve <adapter folder>` failed in transformers
    # with "Unrecognized model ... Should have a model_type key"
    from lightning_vlm.serve import parse_args

    for name in ("VLLM_PLUGINS", "VLLM_SERVER_DEV_MODE", "VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)
    root, policy = exports
    args = parse_args([str(root / "adapter")])
    assert Path(args.model, "config.json").is_file() and args.served_model_name == [str(root / "adapter")]
    torch.testing.assert_close(_logits(VLM(args.model).eval()), policy, atol=1e-5, rtol=1e-5)
    assert parse_args([str(root / "merged")]).model == str(root / "merged")  # a full model is served as it is
