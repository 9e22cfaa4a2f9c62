"""Switch an online method's sampling from HF ``generate`` to vLLM (colocated or server), with weight sync.

Selected by ``generation=vllm_colocate`` or ``generation=vllm_server``. The method keeps computing
the same loss; only ``pl_module.generator`` is replaced, and since vLLM holds a *copy* of the policy
the rollouts are flagged ``is_policy=False`` so the method applies the importance-sampling correction
with vLLM's log-probs. The weights are pushed before each generation whenever they changed, i.e.
whenever ``trainer.global_step`` moved (every optimizer step moves it, manual optimisation included).

On several training processes: colocated, every rank builds its own engine (seeded ``seed + rank``),
samples its own prompts and syncs it from its own weights (identical on every rank after a DDP
step). Server: one server for all ranks; every rank sends its own prompts, rank 0 alone starts it
(``start_server``) and pushes the weights, once per optimizer step, while the others wait for it.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.strategies import ParallelStrategy

from lightning_vlm.generation.base import Generator
from lightning_vlm.generation.engine_options import EngineOptions
from lightning_vlm.generation.vllm_server import TRANSFERS, VLLMServerGenerator
from lightning_vlm.generation.vllm_server_client import VLLMServerError
from lightning_vlm.generation.weight_sync import check_syncable
from lightning_vlm.methods.online import OnlineRL
from lightning_vlm.parallel.fsdp import check_orig_params, sharded_root, unit_state_chunks
from lightning_vlm.parallel.steps import partitions_weights
from lightning_vlm.serving.server_gpus import gpus_needed, server_gpus, visible_gpus

log = logging.getLogger(__name__)
# Engine settings conf/generation/vllm_server.yaml gives for a server the callback starts: set by every
# server config, so not the user's doing when the server is started by hand.
_SERVER_SET = ("gpu_memory_utilization", "seed")
MODES = ("colocate", "server")


def trainer_gpus(trainer: L.Trainer) -> list[int]:
    """The CUDA indices this machine's ranks train on ([] on CPU). Not ``trainer.device_ids``: it gives a
    device listed out of order (``trainer.devices=[2,0]``) its list position, not its index."""
    strategy = trainer.strategy
    devices = strategy.parallel_devices if isinstance(strategy, ParallelStrategy) else [strategy.root_device]
    return [d.index or 0 for d in devices or [] if d.type == "cuda"]


class VLLMGeneration(L.Callback):
    """Builds (colocate) or connects to (server) a vLLM engine at setup and hands the module a generator.

    ``engine``: the engine's settings (``EngineOptions``; colocated, or the server it starts). Server:
    ``server_url`` of a running vLLM server (``python -m lightning_vlm.serve``, or ``vllm serve`` with
    ``VLLM_SERVER_DEV_MODE=1``; not stopped by this callback), or ``start_server=True`` to spawn
    ``lightning_vlm.serve`` on a free loopback port that this callback owns and stops. ``api_key``: the
    server's key (default $VLLM_API_KEY; a started server gets it, or a fresh one, as VLLM_API_KEY).
    ``weight_transfer``: "folder" (safetensors written to ``sync_dir``, read by the server: a shared
    filesystem) or "body" (sent over HTTP). ``server_devices``: the GPUs a started server runs on (indices
    among those this process sees, as ``trainer.devices``); None: the first ones the trainer leaves free
    (``serving.server_gpus``).
    """

    def __init__(
        self,
        mode: str = "colocate",
        engine: EngineOptions | Mapping[str, Any] | None = None,
        weight_sync: str = "merged",
        server_url: str = "http://127.0.0.1:8000",
        start_server: bool = False,
        server_args: list[str] | None = None,
        server_timeout: float = 300.0,
        connect_timeout: float = 5.0,
        retries: int = 1,
        reconnect_timeout: float = 300.0,
        api_key: str | None = None,
        wait_for_server: float = 240.0,
        weight_transfer: str = "folder",
        sync_dir: str | None = None,
        server_devices: list[int] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        from lightning_vlm.generation.vllm_colocate import WEIGHT_SYNCS

        self.engine = EngineOptions.build(engine)  # checks the engine settings, naming the bad one
        if weight_sync not in WEIGHT_SYNCS or (weight_sync == "adapter" and mode == "server"):
            raise ValueError(
                f"weight_sync must be one of {WEIGHT_SYNCS} ('adapter': colocate only), got {weight_sync!r}"
            )
        if weight_transfer not in TRANSFERS:
            raise ValueError(f"weight_transfer must be one of {TRANSFERS}, got {weight_transfer!r}")
        self.mode = mode
        self.weight_sync = weight_sync
        self.server = dict(url=server_url, timeout=server_timeout, connect_timeout=connect_timeout,
                           retries=retries, reconnect_timeout=reconnect_timeout, api_key=api_key)  # fmt: skip
        self.start_server = start_server
        self.server_args = list(server_args or [])
        # Set by the callback itself: the server's own copy (argparse keeps the last) would move it to an
        # address or key the callback never polls with.
        owned = _owned_options(self.server_args) if start_server else []
        if owned:
            raise ValueError(
                f"callbacks.vllm_generation.server_args cannot set {owned}: the callback starts the server on "
                "127.0.0.1 at a free port with a key of its own, and polls that address"
            )
        if server_devices is not None and not start_server:
            raise ValueError(
                "callbacks.vllm_generation.server_devices places the server this callback starts "
                "(start_server=true); a server started by hand takes its GPUs from its own CUDA_VISIBLE_DEVICES"
            )
        if server_args and not start_server:
            raise ValueError(
                f"callbacks.vllm_generation.server_args={list(server_args)} are options of the server this "
                "callback starts (start_server=true); give a server started by hand its options on its own "
                "command line"
            )
        if mode == "server" and not start_server and (unread := self.engine.overrides(_SERVER_SET)):
            # Not an error: generation=vllm_server sets some itself, and a colocate config switched to a
            # server by `mode=server` brings its own. The server's own command line decides them.
            log.warning(
                "callbacks.vllm_generation.engine.%s configure the engine this callback builds or starts; a server "
                "started by hand (start_server=false) never reads them: give that server its options on its own "
                "command line",
                ", engine.".join(unread),
            )
        self.server_devices = None if server_devices is None else [int(i) for i in server_devices]
        self.wait_for_server = wait_for_server
        self.weight_transfer = weight_transfer
        self.sync_dir = sync_dir
        self.generator: Generator | None = None
        self._previous: Generator | None = None
        self._server_process: Any = None
        self._synced_step: int | None = None
        self.sync_seconds: list[float] = []

    # ---- building and tearing down ---------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.generator is not None:
            return
        if partitions_weights(trainer.strategy):
            raise ValueError(
                "callbacks.vllm_generation under DeepSpeed ZeRO-3 would push partitioned (empty) weights into "
                "vLLM: train with trainer=fsdp (the sync gathers one unit at a time) or "
                "trainer=deepspeed_zero2, or generate with generation=hf"
            )
        check_orig_params(trainer.strategy, "callbacks.vllm_generation's weight sync")
        if not isinstance(pl_module, OnlineRL):
            raise TypeError(
                f"VLLMGeneration needs a module with `vlm` and a replaceable `generator` (an online "
                f"method); {type(pl_module).__name__} has not"
            )
        # The engine (colocated, or the server started here) encodes images as the trainer's processor.
        self.engine = self.engine.for_policy(pl_module.vlm.processor_kwargs)
        if self.mode == "colocate" and trainer.world_size > 1 and self.engine.tensor_parallel_size > 1:
            raise NotImplementedError(
                "tensor_parallel_size > 1 with several training processes is not supported: each rank runs its "
                "own engine (tensor_parallel_size=1), or use generation=vllm_server with a tensor-parallel server"
            )
        start = time.perf_counter()
        self.generator = self._build(trainer, pl_module.vlm)
        if self.mode == "colocate" and self.engine.model_impl == "transformers":
            self._shield(pl_module)
        self._previous, pl_module.generator = pl_module.generator, self.generator
        self._synced_step = None
        log.info("vLLM %s generator ready in %.1f s", self.mode, time.perf_counter() - start)

    def _build(self, trainer: L.Trainer, vlm: Any) -> Generator:
        if self.mode == "colocate":
            from lightning_vlm.generation.vllm_colocate import VLLMColocateGenerator

            # One engine per rank; different seeds, so the ranks' unseeded draws are independent.
            engine = EngineOptions.build(self.engine, seed=self.engine.seed + trainer.global_rank)
            return VLLMColocateGenerator(vlm, engine=engine, weight_sync=self.weight_sync)
        from lightning_vlm.generation.vllm_server_client import VLLMServerClient

        if self.start_server:
            check_syncable(vlm)  # the generator checks too, but only once the server has started
            started = None
            if trainer.is_global_zero:
                started = self._launch(vlm.full_model_path, Path(trainer.default_root_dir), trainer)
            # Every rank learns the outcome, so a failed start raises everywhere instead of leaving the
            # other ranks waiting in a collective.
            self.server["url"], self.server["api_key"], error = trainer.strategy.broadcast(started)
            if error is not None:
                raise VLLMServerError(error)
        try:
            client = VLLMServerClient(**self.server)
            client.wait_until_ready(self.wait_for_server)
            return VLLMServerGenerator(vlm, client, transfer=self.weight_transfer, sync_dir=self.sync_dir)
        except Exception:
            self._stop_owned_server()
            raise

    def _launch(
        self, model: str, run_dir: Path, trainer: L.Trainer
    ) -> tuple[str | None, str | None, str | None]:
        """Rank 0 starts the server it owns and waits for it: (url, api key, None), or (None, None, why)."""
        from lightning_vlm.generation.vllm_server_client import VLLMServerClient
        from lightning_vlm.serving.process import ServerStartError, launch_server

        # Loopback: the other ranks of this machine reach it; several machines need a server started
        # by hand on an address they all reach (server_url). A fresh key: on a shared machine other
        # users must not reach its weight and dev routes.
        key = self.server["api_key"] = self.server["api_key"] or secrets.token_hex(24)
        clients: dict[str, VLLMServerClient] = {}  # one session per url polled

        def healthy(url: str) -> bool:
            if url not in clients:
                clients[url] = VLLMServerClient(url, connect_timeout=self.server["connect_timeout"])
            return clients[url].health()

        # The other ranks wait in the broadcast meanwhile: wait_for_server must stay under the process
        # group's timeout (Lightning's default: 30 min). Any failure is returned, so that they learn it.
        try:
            gpus = None
            if trainer.strategy.root_device.type == "cuda" or self.server_devices is not None:
                used = trainer_gpus(trainer)
                gpus = server_gpus(
                    used, visible_gpus(), gpus_needed(self._server_cli_args()), self.server_devices
                )
                log.info("vLLM server on GPU(s) %s (CUDA_VISIBLE_DEVICES), the trainer on %s", gpus, used)
            self._server_process, url = launch_server(
                model,
                self._server_cli_args(),
                run_dir / "vllm_server.log",
                self.wait_for_server,
                healthy,
                env=self.server_env(gpus),
            )
        except ServerStartError as e:
            return None, None, f"{e}\n(callbacks.vllm_generation.wait_for_server={self.wait_for_server:g} s)"
        except Exception as e:  # noqa: BLE001 (re-raised on every rank after the broadcast)
            return None, None, f"starting the vLLM server failed: {type(e).__name__}: {e}"
        log.info("vLLM server log: %s", run_dir / "vllm_server.log")
        return url, key, None

    @staticmethod
    def _shield(pl_module: OnlineRL) -> None:
        # vLLM's transformers backend patched the decoder class process-wide: every HF instance built
        # before (policy, frozen reference copy) must be told to skip vLLM's compile wrapper.
        from lightning_vlm.generation.vllm_colocate import shield_from_vllm_compile

        shield_from_vllm_compile(pl_module)
        if pl_module.ref is not None and pl_module.ref.copy is not None:
            shield_from_vllm_compile(pl_module.ref.copy)

    def _server_cli_args(self) -> list[str]:
        return self.engine.server_args() + self.server_args

    def server_env(self, gpus: str | None = None) -> dict[str, str]:
        """The environment of the server this callback starts: its key as ``VLLM_API_KEY``, and its ``gpus``
        as ``CUDA_VISIBLE_DEVICES``."""
        # Not ``--api-key KEY``: a command line is readable by every user of the machine (ps), and a key
        # starting with "-" read as an option there (1 in 64 of token_urlsafe's; a CI run failed so).
        env = {"VLLM_API_KEY": self.server["api_key"]} if self.start_server and self.server["api_key"] else {}
        return env | ({"CUDA_VISIBLE_DEVICES": gpus} if gpus is not None else {})

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._close(pl_module)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._close(pl_module)

    def _close(self, pl_module: L.LightningModule) -> None:
        generator, self.generator = self.generator, None
        if generator is None:
            self._stop_owned_server()
            return
        if isinstance(pl_module, OnlineRL) and pl_module.generator is generator:
            pl_module.generator = self._previous
        self._previous = None
        try:
            generator.close()
        finally:
            self._stop_owned_server()

    def _stop_owned_server(self) -> None:
        if self._server_process is not None:
            from lightning_vlm.serving.process import stop_server

            stop_server(self._server_process)
            self._server_process = None

    # ---- weight sync and sleep -------------------------------------------------------------------------
    def _sync_if_changed(self, trainer: L.Trainer, pl_module: L.LightningModule) -> float | None:
        # The first generation always syncs too: the engine loaded the checkpoint from disk, while the
        # policy may come from a resumed Lightning checkpoint or carry adapters.
        if self.generator is None or trainer.global_step == self._synced_step:
            return None
        self._synced_step = trainer.global_step
        # Under FSDP the weights are gathered one unit at a time, by every rank (a collective).
        root = sharded_root(trainer.strategy.model)
        chunks = None if root is None else unit_state_chunks(root, pl_module.vlm.model)
        if not isinstance(self.generator, VLLMServerGenerator):
            seconds = self.generator.sync_weights(chunks)
        else:
            # One push per optimizer step, by rank 0 (every rank holds the same weights after the
            # step); the others wait so that nobody samples from the weights of the step before.
            # The label is the step: every rank knows it, and can tell a restarted server from it.
            seconds, version, failed = 0.0, f"step-{trainer.global_step}", None
            if trainer.is_global_zero:
                try:
                    seconds = self.generator.sync_weights(chunks, version=version)
                except Exception as exc:  # refused, timed out, unreachable: every rank must hear of it
                    failed = f"{type(exc).__name__}: {exc}"
            for _ in chunks or ():  # take part in each (remaining) unit's gather
                pass
            # Every rank learns how rank 0's push went: a failed one raises everywhere, instead of
            # leaving the other ranks waiting for a version that never comes, then in a collective.
            failed = trainer.strategy.broadcast(failed)
            if failed is not None:
                raise VLLMServerError(
                    f"the weight push of step {trainer.global_step} (rank 0) failed: {failed}"
                )
            if not trainer.is_global_zero:
                self.generator.expect_version(version, sharded=chunks is not None)
            trainer.strategy.barrier("vllm_server_weight_sync")
        self.sync_seconds.append(seconds)
        return seconds

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:  # fmt: skip
        seconds = self._sync_if_changed(trainer, pl_module)
        if seconds is not None:
            pl_module.log("train/vllm_sync_seconds", seconds, batch_size=1)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._sync_if_changed(trainer, pl_module)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        # Generation is over for this step: give the engine's GPU memory to the backward pass.
        if self.generator is not None:
            self.generator.sleep()


_OWNED = ("--host", "--port", "--uds", "--api-key")


def _owned_options(args: list[str]) -> list[str]:
    """The options in ``args`` that set what the callback sets itself, as vLLM's parser reads them:
    ``--api_key`` for ``--api-key``, and any prefix argparse completes (``--por``)."""
    names = {str(a).split("=")[0].replace("_", "-") for a in args if str(a).startswith("--")}
    return sorted(n for n in names if len(n) > 2 and any(o.startswith(n) for o in _OWNED))
