"""Pushing the policy's weights into vLLM: merged LoRA, vLLM's names, and the cache resets it needs.

Every path ends in vLLM's in-place ``reload_weights`` (the only update that measured to take effect
on the CPU backend, which pre-packs its linear weights), followed by resetting the encoder and prefix
caches: cached image embeddings and KV blocks were computed with the old weights, and a stale encoder
cache kills the next image request ("Encoder cache miss").
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_vlm.models.weight_names import WEIGHTS_NAME, hf_to_vllm_names
from lightning_vlm.parallel.fsdp import clean_name

log = logging.getLogger(__name__)
_PEFT_PREFIX = "base_model.model."


def _lora_merged_weights(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``<module>.base_layer.weight`` -> base weight (from ``state``) + the active adapters' delta, for
    every LoRA layer whose base weight is in ``state``.

    Computed beside the model (the training weights are never touched): merge/unmerge in place
    would leave float rounding in the base weights after each sync.
    """
    from peft.tuners.lora import LoraLayer

    merged: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        key = f"{clean_name(name)}.base_layer.weight"
        if key not in state:
            continue
        if getattr(module, "lora_magnitude_vector", None):
            raise NotImplementedError(f"DoRA layer {name!r}: weight sync supports plain LoRA only")
        weight = state[key].detach()
        bias_key = f"{clean_name(name)}.base_layer.bias"
        bias = state[bias_key].detach() if bias_key in state else None
        if not module.merged and not module.disable_adapters:
            # Linear and conv adapters live in lora_A, embedding ones in lora_embedding_A.
            adapters = [
                a for a in module.active_adapters if a in module.lora_A or a in module.lora_embedding_A
            ]
            for adapter in adapters:
                weight = weight + module.get_delta_weight(adapter)
                if module.lora_bias.get(adapter) and bias is not None:  # PEFT's lora_bias: lora_B has one
                    bias = bias + module.lora_B[adapter].bias.detach() * module.scaling[adapter]
        merged[key] = weight
        if bias is not None:
            merged[bias_key] = bias
    return merged


def _base_weight(module: torch.nn.Module) -> torch.Tensor:
    """A layer's own weight, through PEFT's wrappers (a LoRA layer, a modules_to_save copy)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    if isinstance(module, ModulesToSaveWrapper):
        return module.original_module.weight
    if isinstance(module, LoraLayer):
        return module.get_base_layer().weight
    return module.weight


def check_tied_head(vlm: Any) -> None:
    """Refuse a policy whose output head can leave its input embeddings while the checkpoint ties them.

    vLLM builds such a model tied (one matrix) and skips a pushed ``lm_head.weight`` as an alias, so a
    trained copy of the head (``modules_to_save: [lm_head]``) or a LoRA on either side would never reach
    it: vLLM would sample from other weights than those trained, silently.
    """
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    model = vlm.hf_model
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embed is None or _base_weight(head) is not _base_weight(embed):
        return  # untied: both are pushed, each under its own name
    apart = [
        f"{side} ({type(module).__name__})"
        for side, module in (("the output head", head), ("the input embeddings", embed))
        if isinstance(module, ModulesToSaveWrapper | LoraLayer)
    ]
    if apart:
        raise ValueError(
            f"vLLM generation: {vlm.model_type} ties its output head to its input embeddings, but "
            f"model.lora trains {' and '.join(apart)} apart from the other, and vLLM keeps them tied: it "
            "would sample from the untrained matrix. Keep lm_head out of model.lora.modules_to_save and "
            "embed_tokens/lm_head out of model.lora.target_modules, or generate with generation=hf"
        )


# PEFT inits that rewrite the base weight (W - BA): only the merged sync carries that rewrite to vLLM.
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")


def check_syncable(vlm: Any, merged: bool = True) -> None:
    """Refuse, before any engine starts, a policy vLLM would hold other weights of than those trained:
    a head trained apart from tied embeddings (``check_tied_head``), and for the merged sync (``merged``)
    LoRA parts a merge into vLLM's model cannot express. Each would leave vLLM sampling another policy,
    silently, or fail at the first sync."""
    check_tied_head(vlm)
    if not merged or not vlm.is_lora:
        return
    from peft.tuners.lora import LoraLayer
    from peft.tuners.trainable_tokens import TrainableTokensLayer

    for name, module in vlm.model.named_modules():
        if isinstance(module, TrainableTokensLayer):
            raise ValueError(
                f"vLLM generation: model.lora.trainable_token_indices trains rows of {clean_name(name)!r}, which "
                "the weight sync does not merge into vLLM's embeddings; drop it, or generate with generation=hf"
            )
        if not isinstance(module, LoraLayer):
            continue
        if getattr(module, "lora_magnitude_vector", None):
            raise ValueError(
                f"vLLM generation: {clean_name(name)!r} is a DoRA layer (model.lora.use_dora), which the weight "
                "sync does not merge; use plain LoRA, or generate with generation=hf"
            )
        if (
            any(module.lora_bias.get(a) for a in module.active_adapters)
            and module.get_base_layer().bias is None
        ):
            # vLLM's layer has no bias parameter to take it (PEFT refuses this merge too).
            raise ValueError(
                f"vLLM generation: model.lora.lora_bias trains a bias for {clean_name(name)!r}, whose layer has "
                "none in vLLM's model; drop lora_bias, target only layers with a bias, or generate with "
                "generation=hf"
            )


def policy_weights(
    vlm: Any, chunks: Iterable[dict[str, torch.Tensor]] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's full weights under the checkpoint's names, LoRA adapters merged in (not in place).

    Names are those ``save_pretrained`` writes (transformers 5 reverts its load-time renames, e.g.
    Qwen2.5-VL's ``model.language_model.*`` back to ``model.*``): vLLM's own model classes accept
    either form, but the transformers backend (``model_impl="transformers"``) only the checkpoint's.
    ``chunks``: the model's state in parts, each consumed while it is the only part gathered (FSDP
    units, ``parallel.fsdp.unit_state_chunks``); by default the whole ``state_dict()`` at once.
    """
    model = vlm.model
    for part in [model.state_dict()] if chunks is None else chunks:
        # A LoRA layer's base weight and factors live in one FSDP unit, gathered while it is merged.
        merged = _lora_merged_weights(model, part) if vlm.is_lora else {}
        state: dict[str, torch.Tensor] = {}
        for name, tensor in part.items():
            if ".lora_" in name or ".original_module." in name:
                continue  # adapter factors are merged above; PEFT's untouched copy is not the policy
            tensor = merged.get(name, tensor).detach()
            name = name.replace(".modules_to_save.default.", ".").replace(".base_layer.", ".")
            state[name.removeprefix(_PEFT_PREFIX)] = tensor
        # Renames are per tensor (checked per family: a state in parts converts as the whole does).
        yield from hf_to_vllm_names(vlm.model_type, _checkpoint_names(vlm.hf_model, state).items())


def _checkpoint_names(hf_model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5 keeps checkpoint names in the model
        return state
    return revert_weight_conversion(hf_model, state)


def save_adapter(model: Any, dirpath: str | os.PathLike, lora_state: Mapping[str, torch.Tensor]) -> Path:
    """Write a PEFT model's active LoRA adapter from ``lora_state`` (its ``.lora_`` entries, as the
    model's state dict names them) in PEFT's format: ``adapter_model.safetensors`` and its config.

    PEFT's ``save_pretrained`` cannot be used under FSDP: it reads the factors from the (sharded)
    modules, or matches a given state dict against module names FSDP has prefixed, and writes none.
    """
    from safetensors.torch import save_file

    name = model.active_adapter
    dirpath = Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)
    # PEFT stores the factors without the adapter's name: "...lora_A.default.weight" -> "...lora_A.weight".
    tensors = {k.replace(f".{name}.", "."): v.detach().to("cpu").contiguous() for k, v in lora_state.items()}
    if not tensors:
        raise ValueError("no LoRA weights to save: is the model a LoRA (PEFT) model?")
    save_file(tensors, dirpath / "adapter_model.safetensors", metadata={"format": "pt"})
    config = copy.deepcopy(model.peft_config[name])
    config.inference_mode = True  # as PEFT saves it: a saved adapter loads for inference
    config.save_pretrained(dirpath)
    return dirpath


def reset_vllm_caches(llm: Any) -> None:
    """Drop every cache computed with the old weights (mandatory after each update)."""
    llm.llm_engine.reset_encoder_cache()
    llm.reset_prefix_cache()


def load_into_engine(llm: Any, weights: Any = None, weights_path: str | None = None) -> float:
    """``reload_weights`` in place from (name, tensor) pairs or a folder; caches reset; seconds taken."""
    if (weights is None) == (weights_path is None):
        raise ValueError("give exactly one of weights or weights_path")
    start = time.perf_counter()
    if weights is None and _engine_in_process():
        # reload_weights(weights_path=...) repoints the engine's model_config at that folder, and
        # an in-process frontend shares that config: its next image request would look for the
        # processor files there. Stream the folder's tensors instead.
        weights = read_weights(weights_path)
    # An iterator crosses no process boundary: callers with workers in other processes (tensor
    # parallel) pass a list, and a folder is read by the engine process itself.
    kwargs = (
        {"weights_iterator": weights} if weights is not None else {"weights_path": os.fspath(weights_path)}
    )
    llm.collective_rpc("reload_weights", kwargs=kwargs)
    reset_vllm_caches(llm)
    return time.perf_counter() - start


def _engine_in_process() -> bool:
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"


def read_weights(dirpath: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) from every ``*.safetensors`` file of a folder."""
    from safetensors import safe_open

    files = sorted(Path(dirpath).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {os.fspath(dirpath)!r}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def sync_colocated(
    llm: Any, vlm: Any, in_process: bool = True, chunks: Iterable[dict[str, torch.Tensor]] | None = None
) -> float:
    """Push the policy into an engine in this process (from ``chunks``, see ``policy_weights``); seconds."""
    weights = policy_weights(vlm, chunks)
    return load_into_engine(llm, weights if in_process else list(weights))


def write_weights(weights: Any, dirpath: str | os.PathLike, name: str = WEIGHTS_NAME) -> Path:
    """Write (name, tensor) pairs as ``dirpath/<name>``, atomically (a reader never sees half a file)."""
    from safetensors.torch import save_file

    dirpath = Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)
    tensors = _cpu_tensors(weights)
    fd, tmp = tempfile.mkstemp(dir=dirpath, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    save_file(tensors, tmp, metadata={"format": "pt"})
    target = dirpath / name
    os.replace(tmp, target)
    return target


def weights_to_bytes(weights: Any) -> bytes:
    """(name, tensor) pairs as one safetensors blob (the server's request-body transfer)."""
    from safetensors.torch import save

    return save(_cpu_tensors(weights), metadata={"format": "pt"})


def _cpu_tensors(weights: Any) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in weights:
        tensor = tensor.detach().to("cpu").contiguous()
        # safetensors refuses shared storage (tied embeddings): copy the second view.
        ptr = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    return tensors
