"""The reference policy for KL terms and DPO: adapters switched off with LoRA, else a frozen copy.

With LoRA the reference *is* the base model, so no second copy of the weights is made: each
reference forward runs the policy's own model inside PEFT's ``disable_adapter()`` context. Without
LoRA a deep copy is taken once at construction (so it is the policy's initial weights), put in
eval mode and frozen. Either way :meth:`ReferenceModel.token_logps` runs under ``no_grad`` and in
eval mode (no dropout), with the same encoding, image-token check and log-prob maths as the policy.
TR-DPO's syncs (``callbacks/reference_sync.py``) move the frozen copy towards the policy
(:meth:`ReferenceModel.mix_in_policy`); from then on checkpoints hold its weights
(``methods/reference_state.py``), since a resume can no longer rebuild it from the model's folder.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .modes import evaluating
from .vision_cache import encoded_images
from .vlm import VLM


class ReferenceModel:
    """Log-probs under the reference policy of ``vlm`` (adapter-disabled or a frozen initial copy)."""

    def __init__(self, vlm: VLM) -> None:
        self.vlm = vlm
        self.copy: torch.nn.Module | None = None
        if not vlm.is_lora:
            self.copy = copy.deepcopy(vlm.hf_model).eval()
            self.copy.requires_grad_(False)
        # Which weights the frozen copy holds, for checkpoints to record (callbacks/run_identity.py): a
        # checkpoint holds the policy but not the copy, which a resume or an evaluation rebuilds from
        # model.model_name_or_path. None with LoRA: the reference is the checkpoint's own base weights.
        self.fingerprint = sampled_weights(self.copy) if self.copy is not None else None
        # True once a sync has mixed the policy in: the copy then no longer holds the initial weights.
        self.moved = False

    @property
    def shares_weights(self) -> bool:
        """True when the reference is the policy with adapters disabled (no extra memory)."""
        return self.copy is None

    @contextlib.contextmanager
    def _model(self):
        if self.copy is not None:
            yield self.copy
            return
        model = self.vlm.model
        with evaluating(model), model.disable_adapter():
            yield self.vlm.hf_model

    def mix_in_policy(
        self, alpha: float, parts: Iterable[Mapping[str, torch.Tensor]] | None = None
    ) -> set[str]:
        """TR-DPO's update of the frozen copy (Gorbatovski et al. 2024, "Learn Your Reference Model for Real
        Good Alignment"): each weight the policy trains becomes ``alpha`` x the policy's + (1 - ``alpha``) x
        its own; alpha = 1 is the paper's hard update (a copy). ``parts``: the policy's trainable weights in
        parts, at full size and under the unwrapped model's names (FSDP's units, gathered one at a time); by
        default its own trainable parameters. Frozen weights never left the values the copy was taken
        from: mixing equal values would only add rounding. Returns the names of the weights mixed."""
        if self.copy is None:
            raise ValueError(
                "the reference is the policy with its LoRA adapters off: it has no weights of its own to sync"
            )
        if parts is None:
            parts = [{n: p for n, p in self.vlm.hf_model.named_parameters() if p.requires_grad}]
        mixed: set[str] = set()
        for part in parts:
            mix_weights_(self.copy, part, alpha)
            mixed.update(part)
        self.moved = True
        return mixed

    def moved_weights(self) -> dict[str, torch.Tensor] | None:
        """The frozen copy's weights once a sync has moved them (for a checkpoint), else None."""
        if self.copy is None or not self.moved:
            return None
        # On the CPU: FSDP's sharded checkpoints keep it in a metadata file that Lightning loads without a
        # map_location, which would put a whole model on the saving rank's GPU in every process.
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in self.copy.state_dict().items()}

    def load_moved_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Takes a checkpoint's ``moved_weights``: the copy continues from where the synced run left it."""
        if self.copy is None:
            raise ValueError("the reference is the policy with its LoRA adapters off: it takes no weights")
        self.copy.load_state_dict(weights)  # strict: every weight, into the copy's dtype and device
        self.moved = True

    @torch.no_grad()
    def token_logps(
        self,
        inputs: dict,
        target_mask: torch.Tensor,
        temperature: float = 1.0,
        return_entropy: bool = False,
        mask_suppressed: bool = False,
        chunk_size: int = 1024,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Same contract as :meth:`VLM.token_logps`, under the reference policy and without gradients."""
        with self._model() as model:
            out = self.vlm._token_logps(
                model, inputs, target_mask, temperature, return_entropy, mask_suppressed, chunk_size
            )
        return out[:2]

    @torch.no_grad()
    def encoded_images(self, inputs: dict) -> dict:
        """The reference's vision features of ``inputs``' images, for ``vision_cache.with_encoded_images``."""
        with self._model() as model:
            return encoded_images(self.vlm, inputs, model)

    def to(self, device: torch.device | str) -> ReferenceModel:
        """Move the frozen copy to ``device``, each weight in the dtype of the policy's (a no-op for the
        adapter-disabled reference), buffers too. DeepSpeed's bf16 casts the policy's to bf16 and adds no
        autocast: an fp32 copy would score other log-probs than the policy's from step 0 (DPO margins and
        the KL not 0 at the start). Under DDP and FSDP the policy keeps its dtype, and so does the copy."""
        if self.copy is None:
            return self
        self.copy.to(device)
        policy = self.vlm.hf_model
        for theirs, ours in ((policy.named_parameters(), self.copy.named_parameters()),
                             (policy.named_buffers(), self.copy.named_buffers())):  # fmt: skip
            own = dict(theirs)
            for name, tensor in ours:
                match = own.get(name)
                if match is not None and match.is_floating_point() and match.dtype != tensor.dtype:
                    tensor.data = tensor.data.to(match.dtype)
        return self


@torch.no_grad()
def mix_weights_(target: torch.nn.Module, source: Mapping[str, torch.Tensor], alpha: float) -> None:
    """In place: each parameter of ``target`` named in ``source`` becomes ``alpha`` x that tensor + (1 -
    ``alpha``) x itself (in ``target``'s dtype); the others stay. Buffers are not mixed (TRL mixes
    parameters only too)."""
    own = dict(target.named_parameters())
    unknown = [name for name in source if name not in own]
    if unknown:
        raise ValueError(f"the reference has no weights named {unknown[:3]}: it is not a copy of this policy")
    for name, value in source.items():
        weight = own[name]
        weight.mul_(1.0 - alpha).add_(value.detach().to(weight.dtype), alpha=alpha)


def sampled_weights(model: torch.nn.Module, per_end: int = 4) -> dict[str, Any]:
    """A small sample of ``model``'s weights that tells two models apart cheaply (``same_weights``): a digest
    of every tensor's name and shape, and the first and last ``per_end`` values of each floating tensor."""
    names, values = hashlib.sha256(), []
    for name, tensor in sorted(model.state_dict().items()):
        names.update(f"{name}{tuple(tensor.shape)}".encode())
        if tensor.is_floating_point() and tensor.numel() and tensor.device.type != "meta":
            flat = tensor.detach().reshape(-1)
            values.append(torch.cat([flat[:per_end], flat[-per_end:]]).to("cpu", torch.float32))
    return {"names": names.hexdigest(), "values": torch.cat(values) if values else torch.zeros(0)}


def same_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two ``sampled_weights`` are of one model, up to a cast to float16 or bfloat16 (a run resumed in
    another dtype): relative 8e-3 is two of bfloat16's steps, and 1e-6 covers float16's smallest values. A
    model trained further or merged with a LoRA adapter moves its values well past that."""
    return (
        a["names"] == b["names"]
        and a["values"].shape == b["values"].shape
        and torch.allclose(a["values"], b["values"], rtol=8e-3, atol=1e-6)
    )
