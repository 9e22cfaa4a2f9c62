"""The VLM wrapper every method uses: loading, LoRA, freezing, encoding, image-token check, log-probs."""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from ..parallel.collectives import world_size
from . import encoding, vision_every_rank
from .adapter_folder import adapter_chain, merge_adapters, processor_source
from .chat_render import generation_prompt
from .families import family_of
from .family_rules import check_one_row_per_image
from .image_tokens import NUM_IMAGES_KEY, check_image_tokens
from .logprobs import scatter_to_tokens, scored_positions, selective_logps, softcapped
from .model_source import check_model_kwargs, check_model_source, hub_location
from .processor_settings import check_loading_options, check_processor_settings
from .special_tokens import end_of_turn_token, vision_special_ids
from .vision_cache import ENCODED_KEY, IMAGE_GROUPS_KEY, encoded_images, shared_hidden_states

# Keys the encoders add for our own use; the HF model must not see them.
PRIVATE_KEYS = (NUM_IMAGES_KEY, "labels", "completion_mask", IMAGE_GROUPS_KEY, ENCODED_KEY)
VISION_ATTRS = ("visual", "vision_tower", "vision_model")
LANGUAGE_ATTRS = ("language_model", "text_model")
# Encoders no method feeds (Gemma 4 E2B/E4B's audio tower): always frozen, or they would be trainable
# weights without a gradient, which DDP without find_unused_parameters refuses.
UNFED_ATTRS = ("audio_tower", "embed_audio")


def _dtype(name: str):
    return "auto" if name == "auto" else getattr(torch, name)


class VLM(torch.nn.Module):
    """A Hugging Face image-text-to-text model with its processor, and the per-token maths methods need."""

    def __init__(
        self,
        model_name_or_path: str,
        dtype: str = "float32",
        attn_implementation: str | None = None,
        lora: dict | None = None,
        freeze_vision_tower: bool = True,
        gradient_checkpointing: bool = False,
        processor_kwargs: dict | None = None,
        model_kwargs: dict | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        self.model_name_or_path = model_name_or_path
        # Kept for engines that build their own processor (vLLM): they must encode images alike.
        self.processor_kwargs: dict = dict(processor_kwargs or {})
        # A missing folder or an uncached hub id offline: say so, naming the setting.
        where = hub_location(model_kwargs)
        check_model_source(model_name_or_path, **where)
        check_model_kwargs(model_kwargs)
        # An adapter folder loads as its base model with the adapter merged in; vLLM, which needs a full
        # model on disk, loads that base, and the first weight sync brings the merged weights.
        self.full_model_path, adapters = adapter_chain(model_name_or_path, **where)
        base_kwargs = dict(model_kwargs or {})
        if adapters:
            # model.model_kwargs' revision is the adapter repo's; its base is named without one.
            base_kwargs.pop("revision", None)
            check_model_source(self.full_model_path, f"base_model_name_or_path in {adapters[0]}",
                               **hub_location(base_kwargs))  # fmt: skip
        # The processor (tokenizer, chat template, image settings) from the same revision and cache; an
        # adapter without one of its own takes its base model's.
        check_loading_options(processor_kwargs)
        source = processor_source(model_name_or_path, self.full_model_path, adapters, **where)
        self.processor = AutoProcessor.from_pretrained(
            source,
            trust_remote_code=trust_remote_code,
            **(where if source == model_name_or_path else hub_location(base_kwargs)),
            **(processor_kwargs or {}),
        )
        check_processor_settings(self.processor, processor_kwargs)  # before the weights load
        check_one_row_per_image(self.processor)
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        # Rewards get it (``generation_prompt``): a prefilled "<think>" is part of every completion's text.
        self.generation_prompt = generation_prompt(self.processor)
        model = AutoModelForImageTextToText.from_pretrained(
            self.full_model_path,
            dtype=_dtype(dtype),
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
            **base_kwargs,
        )
        model = merge_adapters(model, adapters, **where)
        if not adapters and Path(self.full_model_path).is_dir():
            # An unmerged export names this as its base: by absolute path, not as typed ("sft_model"),
            # which a later load would read against its own folder or take for a hub id.
            model.name_or_path = str(Path(self.full_model_path).resolve())
        self.model_type: str = model.config.model_type
        # Refuse an unregistered family here, before any batch is sliced by a guessed layout.
        self.family = family_of(model.config)
        if self.family.input_modalities is not None:
            model.input_modalities = self.family.input_modalities
        frozen = self.frozen_modules(model, freeze_vision_tower)
        for module in frozen:
            module.requires_grad_(False)
        if gradient_checkpointing:
            # Non-reentrant: works with frozen embeddings and LoRA without enable_input_require_grads.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            kwargs = dict(lora)
            if kwargs.get("target_modules") is None:
                kwargs["target_modules"] = self.language_lora_targets(model)
            elif kwargs.get("exclude_modules") is None and frozen:
                # The usual targets ("all-linear", [q_proj, v_proj]) name the vision tower's layers too:
                # a frozen tower (or an unfed encoder) must get no trainable adapter.
                kwargs["exclude_modules"] = self.lora_exclusion(model, frozen)
            kwargs.setdefault("task_type", "CAUSAL_LM")
            model = get_peft_model(model, LoraConfig(**kwargs))
            tower = self._find(model.get_base_model(), VISION_ATTRS)
            trained = [n for n, p in tower.named_parameters() if p.requires_grad]
            if freeze_vision_tower and trained:
                raise ValueError(
                    f"model.freeze_vision_tower=true, but model.lora makes {len(trained)} vision-tower tensors "
                    f"trainable ({', '.join(trained[:3])}, ...) through model.lora.modules_to_save or "
                    "model.lora.exclude_modules. Set model.freeze_vision_tower=false to train the tower, or "
                    "keep vision modules out of model.lora"
                )
            if not freeze_vision_tower and not trained:
                # PEFT freezes everything but the adapters and modules_to_save: the flag would be ignored.
                raise ValueError(
                    "model.freeze_vision_tower=false with LoRA: PEFT trains only the adapters and "
                    "model.lora.modules_to_save, none of them in the vision tower, so it would stay frozen. "
                    "Set model.freeze_vision_tower=true (lora=default does), or name vision modules in "
                    "model.lora.target_modules or model.lora.modules_to_save"
                )
        # from_pretrained returns eval mode; Lightning keeps modes as it finds them, so without this
        # dropout would silently stay off in training. A frozen vision tower stays in eval mode.
        model.train()
        self.model = model
        if freeze_vision_tower:
            self.vision_tower.eval()  # found through the PEFT wrapper
        self.pad_token_id: int = (
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else (self.tokenizer.eos_token_id)
        )
        self.end_of_turn: str = end_of_turn_token(self.processor, self.tokenizer)
        self.end_of_turn_id: int = self.tokenizer.convert_tokens_to_ids(self.end_of_turn)
        keep = {self.end_of_turn_id, self.pad_token_id, self.tokenizer.eos_token_id}
        self.suppressed_token_ids: list[int] = [
            i
            for i in vision_special_ids(self.processor, self.tokenizer, self.config, self.family)
            if i not in keep and i < self.lm_head.out_features
        ]
        # On several processes a text-only forward still runs the vision tower, as other ranks do.
        vision_every_rank.attach(self, LANGUAGE_ATTRS)

    # ---- structure, across families and through PEFT -------------------------------------------------
    @property
    def from_adapter_folder(self) -> bool:
        """Whether ``model_name_or_path`` is an adapter folder, merged into its base when loaded."""
        return self.full_model_path != self.model_name_or_path

    @property
    def is_lora(self) -> bool:
        """Whether the model carries PEFT adapters (the reference is then the adapter-disabled model)."""
        return hasattr(self.model, "disable_adapter") and hasattr(self.model, "peft_config")

    @property
    def hf_model(self) -> torch.nn.Module:
        """The underlying ``*ForConditionalGeneration`` (PEFT unwrapped; adapters stay injected)."""
        return self.model.get_base_model() if self.is_lora else self.model

    @property
    def config(self):
        """The HF model config."""
        return self.hf_model.config

    @staticmethod
    def _find(model: torch.nn.Module, attrs: Sequence[str]) -> torch.nn.Module:
        inner = model.model
        for attr in attrs:
            if hasattr(inner, attr):
                return getattr(inner, attr)
        raise AttributeError(f"{type(inner).__name__} has none of {attrs}")

    @property
    def vision_tower(self) -> torch.nn.Module:
        """The vision encoder (``visual`` / ``vision_tower`` / ``vision_model``)."""
        return self._find(self.hf_model, VISION_ATTRS)

    @property
    def language_model(self) -> torch.nn.Module:
        """The text decoder, without the LM head."""
        return self._find(self.hf_model, LANGUAGE_ATTRS)

    @property
    def backbone(self) -> torch.nn.Module:
        """Vision tower + projector + decoder: returns last hidden states, never logits."""
        return self.hf_model.model

    @property
    def lm_head(self) -> torch.nn.Module:
        """The output projection to the vocabulary."""
        return self.hf_model.get_output_embeddings()

    @classmethod
    def language_lora_targets(cls, model: torch.nn.Module) -> str:
        """A PEFT regex matching the decoder's linear layers only (vision tower and projector excluded)."""
        language = cls._find(model, LANGUAGE_ATTRS)
        prefix = next(name for name, module in model.named_modules() if module is language)
        leaves = sorted(
            {n.rsplit(".", 1)[-1] for n, m in language.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        return rf"{re.escape(prefix)}\..*\.({'|'.join(map(re.escape, leaves))})"

    @classmethod
    def frozen_modules(cls, model: torch.nn.Module, freeze_vision_tower: bool) -> list[torch.nn.Module]:
        """The modules kept frozen: the vision tower when ``freeze_vision_tower``, and unfed encoders."""
        unfed = [getattr(model.model, a) for a in UNFED_ATTRS if getattr(model.model, a, None) is not None]
        return [cls._find(model, VISION_ATTRS)] * freeze_vision_tower + unfed

    @staticmethod
    def lora_exclusion(model: torch.nn.Module, frozen: list[torch.nn.Module]) -> str:
        """A PEFT ``exclude_modules`` regex matching every module inside ``frozen`` (``frozen_modules``)."""
        ids = {id(m) for m in frozen}
        prefixes = [re.escape(name) for name, module in model.named_modules() if id(module) in ids]
        return rf"({'|'.join(prefixes)})(\..*)?"

    def save_pretrained(
        self, dirpath: str | os.PathLike, merge_lora: bool = True, max_shard_size: int | str | None = None
    ) -> None:
        """Saves model and processor into one folder that transformers and vLLM load (LoRA merged;
        weights in shards of at most ``max_shard_size``, transformers' default when None)."""
        from .weight_names import save_for_hf_and_vllm

        model = self.model
        if self.is_lora and merge_lora:
            # Merge into a copy: the training model keeps its adapters.
            model = copy.deepcopy(model).merge_and_unload()
        save_for_hf_and_vllm(model, dirpath, max_shard_size)
        self.processor.save_pretrained(dirpath)

    # ---- encoding ----------------------------------------------------------------------------------------
    def encode_sft(self, rows: list[dict], max_length: int | None = None) -> dict:
        """SFT rows -> right-padded tensors with assistant-only ``labels`` (see ``encoding.encode_sft``)."""
        inputs = encoding.encode_sft(self.processor, self.config, rows, self.end_of_turn, max_length)
        # An image inside an assistant turn: its placeholder and marker tokens are no answer text (the
        # image's features replace them, and generation never samples them), so they are not trained on.
        labels = inputs["labels"]
        labels[torch.isin(labels, torch.tensor(self.suppressed_token_ids, dtype=labels.dtype))] = (
            encoding.IGNORE_INDEX
        )
        return inputs

    def encode_prompts(
        self, prompts: list[list[dict]], images: Sequence[Sequence[Image.Image]] | None = None
    ) -> dict:
        """Prompts (message lists) and their images -> left-padded tensors for generation."""
        return encoding.encode_prompts(self.processor, prompts, images or [[] for _ in prompts])

    def encode_prompt_completion(
        self,
        prompts: dict | list[dict],
        completion_ids: torch.Tensor | Sequence[Sequence[int]],
        completion_mask: torch.Tensor | None = None,
    ) -> dict:
        """Prompt rows (or encoded prompts) + completions -> RL training tensors with ``completion_mask``."""
        if isinstance(prompts, list):
            prompts = self.encode_prompts(
                [r["prompt"] for r in prompts], [r.get("images", []) for r in prompts]
            )
        return encoding.encode_prompt_completion(prompts, completion_ids, completion_mask, self.pad_token_id)

    # ---- forward -----------------------------------------------------------------------------------------
    def model_inputs(self, inputs: dict) -> dict:
        """What the HF model receives: private keys dropped, padding-aware ``position_ids`` added."""
        out = {k: v for k, v in inputs.items() if k not in PRIVATE_KEYS}
        if "attention_mask" in out and "position_ids" not in out and not self.family.model_positions:
            # generate() numbers positions over real tokens; do the same so left padding gives equal logps.
            # (M-RoPE families compute their 3-D positions from the attention mask themselves.)
            mask = out["attention_mask"]
            out["position_ids"] = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        return out

    def check_image_tokens(self, inputs: dict) -> None:
        """Raise ``ValueError`` naming the sample whose image tokens and image tensors disagree."""
        check_image_tokens(inputs, self.config)

    def forward(self, inputs: dict, **kwargs):
        """The HF model's forward (full logits) after the image-token check."""
        self.check_image_tokens(inputs)
        return self.model(**self.model_inputs(inputs), **kwargs)

    def hidden_states(self, inputs: dict, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Last hidden states [B, L, H] from the backbone (no LM head, so no [B, L, V] logits)."""
        self.check_image_tokens(inputs)
        if IMAGE_GROUPS_KEY in inputs or ENCODED_KEY in inputs:
            # Rows sharing images run the vision tower once (see vision_cache.with_image_groups), or not at
            # all when an earlier forward encoded them (vision_cache.with_encoded_images).
            return shared_hidden_states(self, inputs, model or self.hf_model)
        backbone = (model or self.hf_model).model
        return backbone(**self.model_inputs(inputs), use_cache=False).last_hidden_state

    def encoded_images(self, inputs: dict) -> dict:
        """The policy's vision features of ``inputs``' images, for ``vision_cache.with_encoded_images``."""
        return encoded_images(self, inputs, self.hf_model)

    def token_logps(
        self,
        inputs: dict,
        target_mask: torch.Tensor,
        temperature: float = 1.0,
        return_entropy: bool = False,
        mask_suppressed: bool = False,
        chunk_size: int = 1024,
        return_argmax: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """Per-token log-probs [B, L] of the tokens in ``target_mask`` (token t scored from state t-1).

        Returns ``(logps, entropy or None)``, plus the argmax token ids [B, L] (for token accuracy)
        when ``return_argmax``. Zeros (argmax: -100) where ``target_mask`` is False.
        ``temperature`` divides the logits (as TRL). ``mask_suppressed`` renormalises over the vocabulary
        without ``suppressed_token_ids``, i.e. the distribution the generators sample from.
        """
        out = self._token_logps(self.hf_model, inputs, target_mask, temperature, return_entropy,
                                mask_suppressed, chunk_size)  # fmt: skip
        return out if return_argmax else out[:2]

    @property
    def logit_softcap(self) -> float | None:
        """The cap the model's forward puts on its logits (``Family.final_logit_softcap``), else None."""
        if not self.family.final_logit_softcap:
            return None
        return getattr(self.config.get_text_config(), "final_logit_softcapping", None)

    def _token_logps(
        self, model, inputs, target_mask, temperature, return_entropy, mask_suppressed, chunk_size
    ):
        ids = inputs["input_ids"]
        # Checked before the forward: a completion-only [B, T] mask or a labels tensor (-100 is True) would
        # otherwise score other tokens without an error.
        if target_mask.shape != ids.shape:
            raise ValueError(f"target_mask has shape {tuple(target_mask.shape)} but input_ids {tuple(ids.shape)}: "
                             "it marks the scored tokens of input_ids, position for position")  # fmt: skip
        if target_mask.dtype != torch.bool and not bool(((target_mask == 0) | (target_mask == 1)).all()):
            raise ValueError(
                "target_mask holds values other than 0 and 1: pass a mask, not labels (-100 ...)"
            )
        hidden = self.hidden_states(inputs, model)
        batch_idx, token_idx = scored_positions(target_mask.to(hidden.device))
        targets = ids[batch_idx, token_idx]
        head = model.get_output_embeddings()
        logps, entropy, argmax = selective_logps(
            hidden[batch_idx, token_idx - 1],
            targets,
            softcapped(head, self.logit_softcap),
            temperature=temperature,
            return_entropy=return_entropy,
            suppressed_ids=self.suppressed_token_ids if mask_suppressed else None,
            chunk_size=chunk_size,
            agree_chunks=world_size() > 1 and vision_every_rank.gathers_weights(head),
        )
        shape = target_mask.shape
        logps = scatter_to_tokens(logps, batch_idx, token_idx, shape)
        if entropy is not None:
            entropy = scatter_to_tokens(entropy, batch_idx, token_idx, shape)
        argmax = torch.full(shape, -100, dtype=torch.long, device=argmax.device).index_put(
            (batch_idx, token_idx), argmax
        )
        return logps, entropy, argmax
