"""SFT warm starts of the tiny models: where the default online and preference jobs begin.

A random tiny model answers the synthetic task at chance, so an RL method sees reward 0 almost
everywhere and DPO has no answers to keep; a short SFT run fixes that. ``tiny_sft_path(family)``
runs that SFT once (``train.py`` itself, in a subprocess, with the project's own SFT config) and
caches the exported HF folder beside the tiny models, like the tiny models themselves. Configs reach
it as ``${tiny_vlm:<family>,sft}`` (``tiny_start: sft``, set by the online and preference methods).

The cache key covers the tiny recipe, the warm-start recipe below and the source of everything
that shapes an SFT run (the package and the SFT configs), so changed training code rebuilds it.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from lightning_vlm.models.tiny import default_cache_dir, recipe_hash, tiny_vlm_path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmStart:
    """One warm start's own recipe: SFT steps, learning rate and the data overrides of its task."""

    steps: int
    lr: float
    overrides: tuple[str, ...] = ()


# Not the SFT defaults: those train to convergence, these stop early so the RL methods have something
# left to learn (measured: greedy colour answers ~0.7 after 80 steps).
WARM_STARTS: dict[str, WarmStart] = {
    "sft": WarmStart(80, 1e-3),
    # The 2 x 2 grounding task on tiny Idefics3, stopped once every data order has learned to localise:
    # sampled IoU 0.45-0.62, greedy boxes 0.70-0.84 for seeds 0-5 (seed 0, built here: 0.535 / 0.77; on
    # 1 thread 0.54 / 0.72). The former 250 steps at 3e-3 were a lottery: seeds 1, 3 and 5 stayed at
    # chance (IoU 0.24-0.31) and a 1-thread build reached 0.38, so one CI build whose rounding differed
    # started GRPO at chance.
    "sft_grounding": WarmStart(
        200, 1e-3, ("data.synthetic.kinds=[grounding]", "data.synthetic.image_size=56")
    ),
    # One per answer-reward kind (data/vqa.py, conf/experiment/grpo_*.yaml), on 56-pixel images; each stops
    # where GRPO still has room (measured greedy / sampled: choice 0.90 / 0.10 after 60 steps, reading
    # 0.87 / 0.76 after 300, counting 0.52 / 0.43 after 120, width within 4 pixels - / 0.37 after 300).
    # One warm start on all four kinds learned them too (greedy count 0.55, choice 0.71, reading 0.85 after
    # 1000 steps), but GRPO on that mix then collapsed them into one another's answers.
    **{
        f"sft_{name}": WarmStart(
            steps, 1e-3, (f"data.synthetic.kinds=[{kind}]", "data.synthetic.image_size=56")
        )
        for name, kind, steps in (
            ("choice", "choice", 60),
            ("ocr", "text", 300),
            ("count", "count_cells", 120),
            ("size", "size", 300),
        )
    },  # fmt: skip
    # Multiple choice and reading in one run (experiment=grpo_mixed), reading drawn 3 times as often: on an
    # even mix, choice was learned (sampled 0.60) while reading was not (0.25) after 150 steps; here the
    # sampled rewards start at 0.29 (choice) and 0.76 (reading), both with room for GRPO.
    "sft_mixed": WarmStart(
        300, 1e-3, ("data.synthetic.kinds=[choice,text,text,text]", "data.synthetic.image_size=56")
    ),
}

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Torch threads of every warm-start build (see _build); 2 is what every measured figure was built with.
BUILD_THREADS = 2
# What the weights of an SFT run of the tiny model depend on besides the recipe: the model, data,
# SFT and training code and every config file the job composes (tests/test_warm_start.py checks that).
_SOURCES = ("lightning_vlm/models", "lightning_vlm/data", "lightning_vlm/losses/sft.py",
            "lightning_vlm/methods/sft.py", "lightning_vlm/methods/common.py", "lightning_vlm/parallel",
            "lightning_vlm/training.py", "lightning_vlm/config.py", "lightning_vlm/callbacks/export.py",
            "conf/train.yaml", "conf/method/sft.yaml", "conf/method/_optimizer.yaml", "conf/data", "conf/scale",
            "conf/model", "conf/trainer/default.yaml", "conf/local", "conf/callbacks/none.yaml",
            "conf/generation/hf.yaml", "conf/logger/none.yaml", "conf/paths", "conf/hydra", "train.py")  # fmt: skip
# Launcher variables that would make the warm-start subprocess join the caller's process group.
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
               "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED", "PL_TRAINER_GPUS")  # fmt: skip


def source_hash() -> str:
    """A short hash of the sources an SFT run of a tiny model depends on."""
    digest = hashlib.sha256()
    for entry in _SOURCES:
        path = ROOT / entry
        files = sorted(path.rglob("*.py") if path.is_dir() else [path]) + (
            sorted(path.rglob("*.yaml")) if path.is_dir() else []
        )
        for file in files:
            if file.is_file() and "__pycache__" not in file.parts:
                digest.update(str(file.relative_to(ROOT)).encode())
                digest.update(file.read_bytes())
    return digest.hexdigest()[:12]


def _check_checkout() -> pathlib.Path:
    script = ROOT / "train.py"
    if not script.is_file() or not (ROOT / "conf").is_dir():
        raise FileNotFoundError(
            f"tiny_start=sft builds its warm start with the project's train.py and conf/, not found "
            f"under {ROOT} (is lightning_vlm installed from a checkout, `pip install -e .`?). Set "
            "tiny_start=random or model.model_name_or_path=<an HF folder>."
        )
    return script


def tiny_sft_path(
    family: str, cache_dir: str | os.PathLike | None = None, start: str = "sft"
) -> pathlib.Path:
    """Folder of ``family``'s tiny model after the warm-start SFT run ``start`` (``WARM_STARTS``), built
    once and cached."""
    if start not in WARM_STARTS:
        raise ValueError(f"tiny_start={start!r}: expected 'random' or one of {sorted(WARM_STARTS)}")
    recipe = WARM_STARTS[start]
    base = tiny_vlm_path(family, cache_dir)
    root = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    stem = f"{family}-{start}{recipe.steps}-lr{recipe.lr:g}-{recipe_hash(family)}"
    target = root / f"{stem}-{source_hash()}"
    if (target / "config.json").is_file():
        return target
    # One builder at a time (ranks of one job, parallel test sessions); the others wait, then reuse.
    with open(root / f".{stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            _build(family, base, target, recipe)
            # Older code's warm starts of this family, once no run can still be starting from them.
            for stale in root.glob(f"{stem}-*"):
                if stale != target and time.time() - stale.stat().st_mtime > 86400:
                    shutil.rmtree(stale, ignore_errors=True)
    return target


def build_overrides(family: str, base: pathlib.Path, tmp: pathlib.Path, recipe: WarmStart) -> list[str]:
    """The train.py overrides of a warm-start build (every config file they compose is in ``_SOURCES``)."""
    return [
        "method=sft", f"model=tiny_{family}", f"model.model_name_or_path={base}", "tiny_start=random",
        "logger=none", "callbacks=none", "trainer.enable_progress_bar=false", f"trainer.max_steps={recipe.steps}",
        "trainer.limit_val_batches=0", "trainer.accelerator=cpu", "trainer=default", "seed=0",
        f"method.optimizer.lr={recipe.lr}", "data=sft", "data.train=synthetic", *recipe.overrides,
        "+callbacks.export._target_=lightning_vlm.callbacks.export.ExportHFModel",
        f"+callbacks.export.dirpath={tmp / 'model'}", f"hydra.run.dir={tmp / 'run'}", "hydra.job.chdir=false",
    ]  # fmt: skip


def _build(family: str, base: pathlib.Path, target: pathlib.Path, recipe: WarmStart) -> None:
    script = _check_checkout()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}-building-", dir=target.parent))
    command = [sys.executable, str(script), *build_overrides(family, base, tmp, recipe)]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV and not k.startswith("TORCHELASTIC_")}
    env.setdefault("HF_HUB_OFFLINE", "1")
    # A fixed thread count: the cached weights must not depend on who builds them first. Reductions split
    # over another number of threads round differently (measured: a build under OMP_NUM_THREADS=1, as a
    # 2-process test's ranks have, differed by 8e-5, and Online DPO from it learned 0.78 instead of 0.83).
    env.update(OMP_NUM_THREADS=str(BUILD_THREADS), MKL_NUM_THREADS=str(BUILD_THREADS))
    # And exactly that many, run to run: MKL may otherwise use fewer threads than asked (MKL_DYNAMIC, e.g.
    # under a narrower CPU mask), and without its CNR mode (MKL_CBWR=AUTO) it does not promise equal
    # results run to run. One CI build once differed from its twin; these leave the weights built here
    # bit for bit as they were (measured on the 80-step sft build) and remove what could vary elsewhere.
    env.update(MKL_DYNAMIC="FALSE", OMP_DYNAMIC="FALSE", MKL_CBWR="AUTO")
    log.info(
        "Building the SFT warm start of tiny %s (%d steps, once; cached in %s)",
        family,
        recipe.steps,
        target,
    )
    try:
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0 or not (tmp / "model" / "config.json").is_file():
            raise RuntimeError(
                f"building the SFT warm start of tiny {family} failed (exit {done.returncode}):\n"
                f"{' '.join(command)}\n{done.stderr[-4000:]}"
            )
        os.replace(tmp / "model", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
