"""Lightning's FSDP for VLMs: each family's own layer classes wrapped and checkpointed, found on the model.

Lightning's ``FSDPStrategy`` needs the classes to wrap at construction, before any model exists, so a
config would have to name ``Qwen2_5_VLDecoderLayer`` (and every other family's) by hand. The family
registry names each family's decoder layer and vision block (``Family.layer_classes``), and the
models' own ``_no_split_modules`` add those of whatever backbone a checkpoint uses; this strategy
reads both from the module it is given, so ``trainer=fsdp`` fits every model config.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy
from transformers import PretrainedConfig

from lightning_vlm.checkpoint_io import temp_name
from lightning_vlm.models.families import FAMILIES, family_of
from lightning_vlm.parallel.folder_swap import swap_in


def layer_classes(module: torch.nn.Module) -> set[type[torch.nn.Module]]:
    """The classes of the blocks inside ``module`` that FSDP wraps one by one: its family's decoder
    layer and vision block (``Family.layer_classes``) and whatever its transformers models list in
    ``_no_split_modules`` (a checkpoint's text backbone may differ from the tiny one: LLaVA-Next on
    Mistral, InternVL on Qwen3)."""
    configs = [
        sub.config
        for sub in module.modules()
        if isinstance(getattr(sub, "config", None), PretrainedConfig) and sub.config.model_type in FAMILIES
    ]
    if not configs:
        raise ValueError(
            f"{type(module).__name__} holds no model of a registered family; give "
            "trainer.strategy.auto_wrap_policy (a set of layer classes) instead of wrap_layers=true"
        )
    names = set(family_of(configs[0]).layer_classes)
    for sub in module.modules():
        declared = getattr(sub, "_no_split_modules", None)
        if isinstance(declared, (list, tuple, set)):
            names.update(declared)
    classes = {type(sub) for sub in module.modules() if type(sub).__name__ in names}
    decoders = {
        type(layer) for sub in module.modules() if isinstance(sub, torch.nn.ModuleList) for layer in sub
    }
    if not classes & decoders:
        raise ValueError(
            f"none of {sorted(names)} (the {configs[0].model_type} record's layer_classes and the models' "
            f"_no_split_modules) is a layer inside {type(module).__name__}: add its decoder layer to the "
            "record in lightning_vlm/models/families.py"
        )
    return classes


def wrap_policy(module: torch.nn.Module, classes: set[type[torch.nn.Module]]) -> Any:
    """FSDP's auto-wrap policy: each block of ``classes`` one unit; and where PEFT keeps LoRA's factors
    in another dtype than their base layer (fp32 adapters beside a bf16 base, ``model.dtype=bfloat16``: the
    hub LoRA configs'), each ``lora_A``/``lora_B`` linear layer a unit of its own, since FSDP flattens a
    unit's weights into one tensor of one dtype ("Must flatten tensors with uniform dtype" otherwise).
    Only then: PEFT reads some factors outside their own forward (DoRA's ``lora_A.weight.shape``, the
    embedding LoRA's ``lora_embedding_A`` dict), which a unit of their own would leave sharded."""
    from peft.tuners.lora import LoraLayer
    from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

    adapters = {
        id(factor)
        for layer in module.modules() if isinstance(layer, LoraLayer)
        for factor in [*layer.lora_A.values(), *layer.lora_B.values()]
        if isinstance(factor, torch.nn.Linear) and factor.weight.dtype != layer.get_base_layer().weight.dtype
    }  # fmt: skip
    if not adapters:
        return ModuleWrapPolicy(classes)
    return CustomPolicy(lambda sub: type(sub) in classes or id(sub) in adapters)


class VLMFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` whose auto-wrap (``wrap_layers``) and activation checkpointing
    (``checkpoint_layers``) policies are the model family's ``layer_classes``.

    Every other argument is Lightning's (``sharding_strategy``, ``state_dict_type``, ``cpu_offload``,
    ``mixed_precision``, ...); an explicit ``auto_wrap_policy`` / ``activation_checkpointing_policy``
    wins over the derived one. Mixed precision follows ``trainer.precision`` as in Lightning.
    """

    def __init__(self, wrap_layers: bool = True, checkpoint_layers: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.wrap_layers = wrap_layers
        self.checkpoint_layers = checkpoint_layers
        self._root: torch.nn.Module | None = None

    @property
    def mixed_precision_config(self) -> Any:
        """Lightning's for ``trainer.precision`` (an explicit ``mixed_precision`` wins), with buffers and
        gradient reductions in fp32: its half-precision buffers put RoPE's ``inv_freq`` in bf16 (rotary
        angles off by radians at thousands of positions, image prompts reach them), and the policy would
        differ from its fp32 reference copy from step 0. fp32 reductions keep DDP's gradient precision."""
        config = super().mixed_precision_config
        if config is None or self.mixed_precision:
            return config
        return dataclasses.replace(config, buffer_dtype=torch.float32, reduce_dtype=torch.float32)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        if self._root is not None and self._root.module is model:
            # A later stage of the same module (validate after fit): its weights live sharded inside
            # the root wrapper, which Lightning dropped; wrapping again would find them flattened.
            return self._root

        if self.wrap_layers or self.checkpoint_layers:
            classes = layer_classes(model)
            if self.wrap_layers and "auto_wrap_policy" not in self.kwargs:
                self.kwargs["auto_wrap_policy"] = wrap_policy(model, classes)
            if self.checkpoint_layers and not self._activation_checkpointing_kwargs:
                self._activation_checkpointing_kwargs = {"auto_wrap_policy": ModuleWrapPolicy(classes)}
        wrapped = any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
        if self.root_device.type == "cpu" and not wrapped:
            # torch's FSDP runs on CPU (gloo) only when told device_id=cpu; Lightning passes the
            # device index, None on CPU, and refuses. Wrapped here, Lightning takes the wrapper as is.
            # (CPU is for tests: the same code path as a GPU run, on this machine's processes.)
            model = FullyShardedDataParallel(
                module=model, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self.kwargs,
            )  # fmt: skip
            self.kwargs.pop("auto_wrap_policy", None)
        self._root = super()._setup_model(model)
        return self._root

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Lightning's save; a sharded checkpoint (a folder) is written beside ``filepath`` and swapped in
        once every rank has written its shard (``folder_swap.py``): Lightning's wrote into the previous
        checkpoint's folder, and a kill mid-save left neither checkpoint whole."""
        target = Path(str(filepath))
        if self._state_dict_type != "sharded" or "://" in str(filepath):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        temp = Path(self.broadcast(str(temp_name(target))))  # rank 0's name, on every rank
        super().save_checkpoint(checkpoint, temp, storage_options)
        self.barrier("lightning_vlm.sharded_checkpoint_written")
        failed = None
        if self.global_rank == 0:
            try:
                swap_in(temp, target)
            except OSError as err:
                failed = f"{type(err).__name__}: {err}"
        # Every rank learns how the swap went (a collective): a rank-0 failure alone left the others waiting.
        failed = self.broadcast(failed)
        if failed:
            raise OSError(f"the sharded checkpoint written to {temp} could not replace {target}: {failed}")


# Module names FSDP and its activation checkpointing insert between a module and its children.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def clean_name(name: str) -> str:
    """A parameter's name without FSDP's wrapper levels: the name the unwrapped model gives it."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def sharded_root(module: Any) -> torch.nn.Module | None:
    """The root FSDP module when ``module`` (a strategy's model) is sharded by FSDP, else None."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return module if isinstance(module, FullyShardedDataParallel) else None


def check_orig_params(strategy: Any, what: str) -> None:
    """Refuses FSDP without ``use_orig_params`` for ``what`` (the HF export, the vLLM weight sync): its
    units then hold flat parameters (``_flat_param``) instead of the model's, so the weights gathered by
    name would hold none of the model's, and an exported folder would load as random weights."""
    from lightning.pytorch.strategies import FSDPStrategy

    if isinstance(strategy, FSDPStrategy) and not strategy.kwargs.get("use_orig_params", True):
        raise ValueError(
            f"{what} reads the model's weights by name, which FSDP without use_orig_params replaces by flat "
            "parameters: set trainer.strategy.use_orig_params=true (conf/trainer/fsdp.yaml's)"
        )


def unit_state_chunks(root: torch.nn.Module, module: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """``module``'s parameters (and persistent buffers), one FSDP unit at a time, at full size.

    Each dict holds one unit's tensors, named as in the unwrapped ``module.state_dict()``; the unit is
    gathered while its dict is built and resharded before the next, so no rank ever holds more than
    one unit beyond its shards (the tensors are copies: the gathered storage is freed on reshard).
    A collective: every rank must iterate it to the end, in the same order.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    names: dict[int, list[str]] = {}  # tied weights (embeddings = LM head) under each of their names
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(clean_name(n))
    buffers = {}
    for owner_name, owner in module.named_modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if name not in owner._non_persistent_buffers_set:
                buffers[clean_name(f"{owner_name}.{name}" if owner_name else name)] = buffer.detach().clone()
    if buffers:
        yield buffers
    # LoRA factors of another dtype than their base are units of their own (``wrap_policy``): each comes
    # with the unit holding its base layer, so a layer's base weight and factors are gathered together.
    adapters = {id(u) for n, u in root.named_modules() if isinstance(u, FSDP) and ".lora_" in clean_name(n)}
    for unit in FSDP.fsdp_modules(root):
        if id(unit) in adapters:
            continue
        inner = [sub for sub in FSDP.fsdp_modules(unit) if sub is not unit and id(sub) not in adapters]
        nested = {id(p) for sub in inner for p in sub.parameters()}
        own = [p for p in unit.parameters() if id(p) not in nested and id(p) in names]
        if not own:
            continue
        with contextlib.ExitStack() as gathered:
            for sub in [unit, *(a for a in FSDP.fsdp_modules(unit) if id(a) in adapters)]:
                if sub is unit or not any(id(p) in nested for p in sub.parameters()):
                    gathered.enter_context(FSDP.summon_full_params(sub, recurse=False, writeback=False))
            yield {name: p.detach().clone() for p in own for name in names[id(p)]}
