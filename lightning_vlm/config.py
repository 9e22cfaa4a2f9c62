"""Hydra/OmegaConf glue: the resolvers and the dataclass-built config nodes our configs use, registered
once on import.

Config nodes built from dataclasses (Hydra's ConfigStore, group ``schema``) keep a default in one
place: the YAML that includes one (``- /schema/sampling@method.sampling``) gets every field, typed and
overridable from the command line, without repeating them.
"""

from __future__ import annotations

import inspect
import itertools
import os
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from lightning_vlm.defaults import config_value, init_defaults


def _tiny_vlm(family: str, start: str = "random") -> str:
    # Imported lazily: composing a config must not build a model; resolving this value does (once
    # per recipe, cached on disk: < 1 s for the random model, ~30 s for the SFT warm start).
    if start == "random":
        from lightning_vlm.models.tiny import tiny_vlm_path

        return str(tiny_vlm_path(family))
    from lightning_vlm.models.warm_start import tiny_sft_path

    # "sft" (the colour task), "sft_grounding", "sft_choice", ...: SFT warm starts, built once
    # (warm_start.WARM_STARTS names them all).
    return str(tiny_sft_path(family, start=start))


def launch_id(environ: Mapping[str, str] | None = None) -> str | None:
    """A name that every process of one external launch shares, for its run folder: torchrun's run id
    (``--standalone`` draws one, ``--rdzv-id`` names it), or SLURM's job and step ids when the step runs
    several tasks. None for one process, and for Lightning's own launcher, which hands rank 0's run
    folder to the processes it starts. Each process of an external launch composes its own config, so
    a time stamp could differ by a second between them and split the run over two folders."""
    environ = os.environ if environ is None else environ
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":  # "none": torchrun's default id, shared by unrelated launches
        return f"torchrun-{run_id}"
    job, tasks = environ.get("SLURM_JOB_ID"), environ.get("SLURM_STEP_NUM_TASKS", "1")  # set by srun
    if job and tasks.isdigit() and int(tasks) > 1:
        step = environ.get("SLURM_STEP_ID")
        return f"slurm-{job}" + (f".{step}" if step else "")
    return None


def _run_stamp(pattern: str) -> str:
    launch = launch_id()
    if launch:
        return launch
    stamp = datetime.now().strftime(pattern)
    # One process of a SLURM job (an array's task, each with its own job id): tasks starting in the same
    # second would otherwise share one folder and overwrite each other's checkpoints and logs.
    job = os.environ.get("SLURM_JOB_ID")
    return f"{stamp}_slurm-{job}" if job else stamp


def _run_folder(parent: str, pattern: str) -> str:
    """``parent/<stamp>`` (:func:`_run_stamp`), created here so that no other run has it: runs started in
    the same second (two terminals, a script's ``&``) would otherwise share one folder, and each one's
    checkpoint save replaces or deletes the other's files. The later run gets ``<stamp>_2``, ``_3``, ...
    The processes of one external launch share their folder on purpose, so it is not claimed: one named
    after the launch (:func:`launch_id`), or the time stamp where the launch names none (plain torchrun:
    its ranks agree when their clocks do, README)."""
    stamp = _run_stamp(pattern)
    if launch_id() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return os.path.join(parent, stamp)
    os.makedirs(parent, exist_ok=True)
    for n in itertools.count(1):
        folder = os.path.join(parent, stamp if n == 1 else f"{stamp}_{n}")
        try:
            os.mkdir(folder)  # atomic: exactly one process creates it, on a local or an NFS disk alike
        except FileExistsError:
            continue
        return folder
    raise AssertionError("unreachable")


# Groups composed by other configs, never chosen on the command line: left out of --help.
INTERNAL_GROUPS = ("hydra", "scale", "schema", "paths", "local")


def _config_groups(sources: Any) -> str:
    """The ``group: option, ...`` lines of ``--help``: the primary config folder's groups, without the
    partial configs others build on (``_online``, ``_tiny``: a leading underscore) or internal groups."""
    from pathlib import Path

    folders = [s["path"].removeprefix("file://") for s in sources or [] if s.get("provider") == "main"]
    if not folders or not Path(folders[0]).is_dir():
        return "(config folder not found)"
    lines = []
    for group in sorted(
        p for p in Path(folders[0]).iterdir() if p.is_dir() and p.name not in INTERNAL_GROUPS
    ):
        options = sorted(f.stem for f in group.glob("*.yaml") if not f.name.startswith("_"))
        if options:
            lines.append(f"{group.name}: {', '.join(options)}")
    return "\n".join(lines)


def register_resolvers() -> None:
    """Registers `${tiny_vlm:<family>[,random|<warm start>]}` (path of an offline tiny model, or of one of
    its SFT warm starts, ``warm_start.WARM_STARTS``), `${times:<value>,<factor>}` (their product), `${if_lora:<lora node>,<full>,<adapters>}` and
    `${run_folder:<parent>,<strftime pattern>}` (the run folder, named after :func:`launch_id`, else the
    time, and claimed for this run); safe to call twice."""
    if not OmegaConf.has_resolver("tiny_vlm"):
        OmegaConf.register_new_resolver("tiny_vlm", _tiny_vlm, use_cache=True)
    if not OmegaConf.has_resolver("config_groups"):
        OmegaConf.register_new_resolver("config_groups", _config_groups)
    if not OmegaConf.has_resolver("times"):
        # ${times:${scale.lr.online},0.5}: a setting relative to a size-dependent one, so an experiment tuned
        # on the tiny models keeps its ratio on a hub model's scale instead of its tiny absolute value.
        OmegaConf.register_new_resolver("times", lambda value, factor: float(value) * float(factor))
    if not OmegaConf.has_resolver("if_lora"):
        # ${if_lora:${model.lora},<full rate>,<LoRA rate>}: a rate that follows whether adapters are trained,
        # so `lora=default` (or `model.lora=null` on a 7B config) needs no rate written by hand.
        OmegaConf.register_new_resolver("if_lora", lambda lora, full, adapters: adapters if lora else full)
    if not OmegaConf.has_resolver("run_folder"):
        # Cached like Hydra's ${now:}: the folder is named once per process, and Hydra copies the cache into
        # each sweep job's config, so a sweep claims its folder once.
        OmegaConf.register_new_resolver("run_folder", _run_folder, use_cache=True)


def signature_defaults(target: type) -> dict[str, Any]:
    """``target``'s constructor parameters with their defaults, and its ``_target_``: a config node (stored
    in Hydra's ConfigStore) that the YAML including it overrides where it differs, writing no default again.
    A plain mapping, not a dataclass: a config for a subclass may add its own keys, as YAML could.
    Mappings and tuples become dicts and lists."""
    node: dict[str, Any] = {"_target_": f"{target.__module__}.{target.__qualname__}"}
    for name, default in init_defaults(target).items():
        if default is inspect.Parameter.empty:
            raise TypeError(f"{target.__qualname__}({name}) has no default to put in a config node")
        node[name] = config_value(default)
    return node


def register_schemas() -> None:
    """Stores ``schema/sampling`` (``SamplingOptions``), ``schema/vllm_engine`` (``EngineOptions``) and
    ``schema/datamodule`` (``VLMDataModule``'s settings, :func:`signature_defaults`)."""
    from lightning_vlm.data.datamodule import VLMDataModule
    from lightning_vlm.generation.base import SamplingOptions
    from lightning_vlm.generation.engine_options import EngineOptions

    store = ConfigStore.instance()
    store.store(group="schema", name="sampling", node=SamplingOptions)
    store.store(group="schema", name="vllm_engine", node=EngineOptions)
    store.store(group="schema", name="datamodule", node=signature_defaults(VLMDataModule))


register_resolvers()
register_schemas()
