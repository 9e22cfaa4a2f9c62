"""Run the vision tower in every forward on every rank, even when a rank's batch has no images.

On several processes, a rank whose rows are all text-only skips the vision tower while the others
run it. Data that mixes text-only and image rows does this easily, and each strategy then breaks:
- **FSDP** gathers each wrapped vision block's weights when it runs, and **DeepSpeed ZeRO-3** does
  the same through its hooks. The ranks then make different collectives: the run hangs, or on gloo
  fails with "Received data size doesn't match expected size".
- **DDP** all-reduces the gradients of every trainable parameter. The vision tower (with
  ``model.freeze_vision_tower=false``) or a projector outside it (LLaVA's ``multi_modal_projector``)
  gets no gradient on a text-only rank, so that rank never reduces them and the others wait for good.

The fix here: on a forward without images, the vision tower (projector included) runs on one small
blank image, at the point where a rank with images runs it (before the decoder layers; see
``VisionEveryRank`` for before or after the text embeddings). Empty slices of its features (exactly
0, never NaN) are added to the backbone's hidden states. Every rank then runs the vision tower once
per forward, in the same order, and its parameters stay in the autograd graph, so their gradients
are reduced everywhere.

This covers training forwards and the prefill of ``generate`` alike (which encodes the images just
before its first step, so the vision tower still runs before the decoder on every rank). Decode steps
are left alone: no rank runs the vision tower there. Nothing runs on one process, nor under DDP
without gradients (generation, frozen log-probs), nor on a model that neither shards nor trains its
vision weights (a frozen reference copy).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from ..parallel.collectives import world_size
from .encoding import encode_prompts
from .vision_cache import image_features, unique_image_inputs

if TYPE_CHECKING:
    from .vlm import VLM

# Keys that carry visual input to a backbone's forward (precomputed features count as images).
VISUAL_KEYS = ("pixel_values", "pixel_values_videos", "mm_encoder_outputs")
_REUSING = contextvars.ContextVar("reusing_encoded_images", default=False)


@contextlib.contextmanager
def reusing_encoded_images() -> Iterator[None]:
    """Forwards inside take images an earlier forward of the step encoded (``vision_cache.with_encoded_images``):
    no blank pass runs in them. A rank with images runs no tower there either, and a text-only rank ran its
    blank in that earlier forward, so every rank keeps running the tower equally often."""
    token = _REUSING.set(True)
    try:
        yield
    finally:
        _REUSING.reset(token)


def gathers_weights(module: torch.nn.Module) -> bool:
    """Whether running ``module`` makes collectives: it holds FSDP units or ZeRO-3 partitioned weights."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        return True
    return any(hasattr(p, "ds_id") for p in module.parameters())  # DeepSpeed ZeRO-3 tags its partitions


def language_model_of(backbone: torch.nn.Module, language_attrs: Sequence[str]) -> torch.nn.Module:
    """The backbone's language model: its first attribute named in ``language_attrs``."""
    return next(getattr(backbone, a) for a in language_attrs if hasattr(backbone, a))


def trains_vision(backbone: torch.nn.Module, language_attrs: Sequence[str]) -> bool:
    """Whether a parameter of ``backbone`` outside its language model (tower, projector) is trained."""
    text = {id(p) for p in language_model_of(backbone, language_attrs).parameters()}
    return any(p.requires_grad for p in backbone.parameters() if id(p) not in text)


def has_visual_input(kwargs: dict[str, Any]) -> bool:
    """Whether a backbone forward gets images: pixels, or features that ``generate`` (transformers >= 5)
    encoded before its first step (an empty ``mm_encoder_outputs`` when the prompts have none)."""
    for key in VISUAL_KEYS:
        value = kwargs.get(key)
        if isinstance(value, dict):
            value = next((v for v in value.values() if v is not None), None)
        if value is not None:
            return True
    return False


def is_prefill(kwargs: dict[str, Any]) -> bool:
    """A forward over whole sequences (training, or ``generate``'s first step), not a decode step."""
    cache = kwargs.get("past_key_values")
    return cache is None or cache.get_seq_length() == 0


def needs_vision_pass(backbone: torch.nn.Module, language_attrs: Sequence[str]) -> bool:
    """Whether other ranks could wait on this one's vision tower (see the module docstring)."""
    if world_size() == 1:
        return False
    if gathers_weights(backbone):
        return True
    return torch.is_grad_enabled() and trains_vision(backbone, language_attrs)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value or () for t in _tensors(v)]


def zero_of(features: Any) -> torch.Tensor:
    """Exactly 0 that depends on what the decoder takes from ``get_image_features``: the features
    (``pooler_output``) and Qwen3-VL's deepstack levels. Not the tower's own last hidden state, which
    some families never use (LLaVA reads an earlier layer): its weights get no gradient on a rank with
    images either, and DDP must see the same parameters used on every rank."""
    used = _tensors(features.pooler_output) + _tensors(getattr(features, "deepstack_features", None))
    return sum(t.flatten()[:0].sum() for t in used)


class VisionEveryRank:
    """The hooks: a forward without images runs the vision tower where other ranks could wait on it,
    at the point where a rank with images runs it, and adds exactly 0 from its features.

    Where is that point? When the images were encoded before the backbone (``generate``, and
    ``vision_cache.shared_hidden_states``: DPO, online RL, KTO), the backbone receives
    ``mm_encoder_outputs`` (``{}`` without images) and the vision tower ran before the text embeddings: the
    blank runs in the backbone's pre-hook. When the backbone gets pixels itself (SFT, KTO with
    ``one_vision_pass=false``), every family looks up the
    text embeddings first and runs the tower next, before its language model: the blank runs in the
    language model's pre-hook. ZeRO-3 gathers the embeddings too, so the order matters there.

    A small picklable object (the processor and config, not the VLM): a deep copy of the model (the
    reference) copies it cheaply, and the hooks check the module they run on.
    """

    def __init__(self, processor: Any, config: Any, language_attrs: Sequence[str]) -> None:
        self.processor, self.config, self.language_attrs = processor, config, tuple(language_attrs)
        self.blank: dict[str, torch.Tensor] = {}
        self.pending: dict[int, torch.Tensor] = {}  # backbone id -> the zero to add to its output
        self.deferred: dict[int, tuple[torch.nn.Module, torch.device]] = {}  # language model id -> backbone

    def image_inputs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """One blank image's extras through the family's own processor (made once)."""
        if not self.blank:
            prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "."}]}]
            image = Image.new("RGB", (56, 56), (255, 255, 255))
            inputs = encode_prompts(self.processor, [prompt], [[image]])
            self.blank.update(unique_image_inputs(inputs, torch.zeros(1, dtype=torch.long), self.config)[0])
        return {k: v.to(device) for k, v in self.blank.items()}

    def language_model(self, backbone: torch.nn.Module) -> torch.nn.Module:
        return language_model_of(backbone, self.language_attrs)

    def run_blank(self, backbone: torch.nn.Module, device: torch.device) -> None:
        self.pending[id(backbone)] = zero_of(image_features(backbone, self.image_inputs(device)))

    def before(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        # Left over only if a forward raised between the hooks: the stale graph would block deepcopy.
        self.pending.pop(id(module), None)
        self.deferred.pop(id(self.language_model(module)), None)
        if has_visual_input(kwargs) or not is_prefill(kwargs) or _REUSING.get():
            return
        if not needs_vision_pass(module, self.language_attrs):
            return
        tokens = kwargs.get("input_ids")
        device = (tokens if tokens is not None else kwargs["inputs_embeds"]).device
        if kwargs.get("mm_encoder_outputs") is not None:  # {}: encoded before the backbone, none found
            self.run_blank(module, device)
        else:
            self.deferred[id(self.language_model(module))] = (module, device)

    def before_language_model(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        deferred = self.deferred.pop(id(module), None)
        if deferred is not None:
            self.run_blank(*deferred)

    def after(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        zero = self.pending.pop(id(module), None)
        if zero is None:
            return None
        if isinstance(output, tuple):  # return_dict=False
            return (output[0] + zero.to(output[0]), *output[1:])
        output.last_hidden_state = output.last_hidden_state + zero.to(output.last_hidden_state)
        return output


def attach(vlm: VLM, language_attrs: Sequence[str]) -> None:
    """Hook ``vlm``'s backbone (and its language model) so that a forward without images still runs the
    vision tower where other ranks could wait on it. ``language_attrs``: the language model's names."""
    hooks = VisionEveryRank(vlm.processor, vlm.config, language_attrs)
    backbone = vlm.backbone
    backbone.register_forward_pre_hook(hooks.before, with_kwargs=True)
    backbone.register_forward_hook(hooks.after, with_kwargs=True)
    hooks.language_model(backbone).register_forward_pre_hook(hooks.before_language_model, with_kwargs=True)
