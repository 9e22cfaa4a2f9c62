"""kill -9 of a ``train.py`` run, then a resume from its ``last.ckpt`` (tests/test_kill9_resume.py).

    python tests/_kill9_scenarios.py REPORT.json WORKDIR SCENARIO [SCENARIO...]

Per scenario (sft, dpo, grpo, grpo_vllm) this runs, with one torch thread in every process (the same
work must give the same bits): an uninterrupted run (in this process), two ``train.py`` subprocesses
SIGKILLed by :class:`Kill9`, one at a seeded random optimizer step between two ``last.ckpt`` writes and
one right after the write on the last batch of epoch 0, and a resume of each from its ``last.ckpt``
(in this process, through the same ``train()`` that ``train.py`` calls); SFT's epoch-boundary resume
is itself a ``train.py`` run, killed again mid-epoch 1 and resumed once more. Every run ends with its own
``last.ckpt`` at the final step, which the test compares tensor by tensor. The killed runs go two at a
time in the background while this process trains, which keeps both cores busy; the vLLM scenario runs
last here, since an engine rebinds this process's threads.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[1]
BATCHES_PER_EPOCH, EPOCHS, CKPT_EVERY_BATCHES = 4, 2, 2
TINY = ["logger=none", "callbacks=model_checkpoint", "~callbacks.model_checkpoint", "trainer.limit_val_batches=0",
        "trainer.enable_progress_bar=false", "data.synthetic.num_val=4", "seed=0"]  # fmt: skip
ONLINE = ["method=grpo", "data.batch_size=2", f"data.synthetic.num_train={2 * BATCHES_PER_EPOCH}",
          "method.num_generations=4", "method.steps_per_generation=2"]  # fmt: skip


class Kill9(L.Callback):
    """SIGKILLs its own process once ``at_step`` optimizer steps are done (checked at every batch end and
    before every optimizer step, so an online method dies between the steps of one generation), or at
    the end of epoch ``at_epoch_end``: after the batch-end hooks, where ``last.ckpt`` was written.
    ``marker`` gets the step it died at first (JSON), so the test knows how far the lost run got."""

    def __init__(self, marker: str, at_step: int | None = None, at_epoch_end: int | None = None) -> None:
        self.marker, self.at_step, self.at_epoch_end = Path(marker), at_step, at_epoch_end

    def _die(self, trainer: L.Trainer, where: str) -> None:
        state = {"global_step": trainer.global_step, "epoch": trainer.current_epoch, "where": where}
        self.marker.write_text(json.dumps(state))
        os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        # Lightning runs checkpoint callbacks' hooks last: a kill here comes before this batch's write.
        if trainer.global_step == self.at_step:
            self._die(trainer, "batch_end")

    def on_before_optimizer_step(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.at_step:
            self._die(trainer, "before_optimizer_step")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.at_epoch_end:
            self._die(trainer, "epoch_end")


class SigTerm(L.Callback):
    """Sends SIGTERM (or ``signum``: SLURM's requeue signal SIGUSR1) to its own process, as a preemption or
    ``scancel`` does, at the end of the batch that reaches ``at_step`` optimizer steps; on rank ``rank``
    only, when given."""

    def __init__(self, at_step: int, rank: int | None = None, signum: str = "SIGTERM") -> None:
        self.at_step, self.rank, self.signum = at_step, rank, getattr(signal, signum)

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.at_step and self.rank in (None, trainer.global_rank):
            os.kill(os.getpid(), self.signum)


class RaiseOnRank(L.Callback):
    """Raises on rank ``rank`` alone at the end of the batch that reaches ``at_step`` optimizer steps (a
    reward function failing on that rank's rows, an out-of-memory error)."""

    def __init__(self, at_step: int, rank: int) -> None:
        self.at_step, self.rank = at_step, rank

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.at_step and trainer.global_rank == self.rank:
            raise RuntimeError(f"boom on rank {self.rank} at step {self.at_step}")


class BarrierAtEpochEnd(L.Callback):
    """A user's callback with a collective at each training epoch's end (an all-rank evaluation, say)."""

    def on_train_epoch_end(self, trainer: L.Trainer, *args) -> None:
        trainer.strategy.barrier("epoch_end")


class ValidationBatches(L.Callback):
    """Appends the global step of every validation batch fit starts to the file ``path`` (one line each;
    a stop before a validation leaves it empty)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.path.touch()

    def on_validation_batch_start(self, trainer: L.Trainer, *args) -> None:
        if not trainer.sanity_checking:
            with self.path.open("a") as f:
                f.write(f"{trainer.global_step}\n")


class SigTermInValidation(L.Callback):
    """Sends SIGTERM to its own process at the first validation batch: before fit when
    ``validate_before_fit=true``."""

    def on_validation_batch_end(self, trainer: L.Trainer, *args) -> None:
        if not trainer.sanity_checking:
            os.kill(os.getpid(), signal.SIGTERM)


@dataclass
class Scenario:
    """A method's tiny run: 2 epochs of 4 batches, ``last.ckpt`` every 2 batches."""

    overrides: list[str]
    steps_per_batch: int = 1  # optimizer steps per batch (GRPO: steps_per_generation)
    # Budget in epochs (max_epochs, no max_steps); its epoch-boundary resume is killed again mid-epoch 1
    # and resumed once more: Lightning's epoch counters after such a resume once made that second resume
    # retrain epoch 1 (lightning_vlm/callbacks/resume.py).
    epoch_budget: bool = False

    @property
    def max_steps(self) -> int:
        return BATCHES_PER_EPOCH * EPOCHS * self.steps_per_batch

    @property
    def every(self) -> int:
        return CKPT_EVERY_BATCHES * self.steps_per_batch

    @property
    def epoch_steps(self) -> int:
        return BATCHES_PER_EPOCH * self.steps_per_batch

    def random_candidates(self) -> list[int]:
        """Steps strictly between a mid-epoch checkpoint and the next one: the resume starts mid-epoch and
        redoes the steps the killed run had done since."""
        mids = [c for c in range(self.every, self.max_steps, self.every) if c % self.epoch_steps]
        return [k for c in mids for k in range(c + 1, c + self.every)]

    def args(self) -> list[str]:
        budget = [f"trainer.max_steps={self.max_steps}"]
        if self.epoch_budget:
            budget = ["trainer.max_steps=-1", f"trainer.max_epochs={EPOCHS}"]
        return [
            *TINY,
            *self.overrides,
            *budget,
            f"callbacks.last_checkpoint.every_n_train_steps={self.every}",
        ]


SCENARIOS = {
    "sft": Scenario(
        ["method=sft", "data.batch_size=4", f"data.synthetic.num_train={4 * BATCHES_PER_EPOCH}"],
        epoch_budget=True,
    ),
    # bco_pair beside sigmoid: its running δ is module state that a resume must restore too.
    "dpo": Scenario(
        [
            "method=dpo",
            "method.loss_type=[sigmoid,bco_pair]",
            "data.batch_size=4",
            f"data.synthetic.num_train={4 * BATCHES_PER_EPOCH}",
        ]
    ),
    "grpo": Scenario(ONLINE, steps_per_batch=2),
    "grpo_vllm": Scenario([*ONLINE, "generation=vllm_colocate"], steps_per_batch=2),
}


def kill_chains(name: str, scenario: Scenario) -> dict[str, list[dict]]:
    """Per kill point, the kills in order (each later one in a resume of the one before): a random step
    from an RNG seeded by LIGHTNING_VLM_KILL_SEED and the scenario's name, and the end of epoch 0."""
    seed = int(os.environ.get("LIGHTNING_VLM_KILL_SEED", "0"))
    rng = random.Random(f"{seed}:{name}")
    candidates = scenario.random_candidates()
    chains = {"random": [{"at_step": rng.choice(candidates)}], "epoch": [{"at_epoch_end": 0}]}
    if scenario.epoch_budget:
        chains["epoch"].append({"at_step": rng.choice([k for k in candidates if k > scenario.epoch_steps])})
    return chains


def _kill_run(args: list[str], run_dir: Path, kill: dict) -> dict:
    """``train.py`` with :class:`Kill9`; returns its exit code (-9 expected), marker and log tail."""
    marker = run_dir / "killed.json"
    extra = ["+callbacks.kill9._target_=_kill9_scenarios.Kill9", f"+callbacks.kill9.marker={marker}",
             *(f"+callbacks.kill9.{k}={v}" for k, v in kill.items()), f"hydra.run.dir={run_dir}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(run_dir / "train.log", "w") as log:
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, *extra], cwd=run_dir, env=env,
                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=600)  # fmt: skip
    return {
        "dir": str(run_dir),
        "returncode": proc.returncode,
        "marker": json.loads(marker.read_text()) if marker.is_file() else None,
        "log_tail": (run_dir / "train.log").read_text()[-3000:],
        "seconds": time.perf_counter() - start,
    }


def _kill_chain(args: list[str], run_dir: Path, chain: list[dict]) -> list[dict]:
    """The kills of ``chain`` in turn, each resuming from the ``last.ckpt`` the one before left."""
    done: list[dict] = []
    for i, kill in enumerate(chain):
        resume = [f"ckpt_path={Path(done[-1]['dir']) / 'checkpoints' / 'last.ckpt'}"] if done else []
        done.append(_kill_run([*args, *resume], run_dir / f"kill{i}", kill))
        if done[-1]["returncode"] != -signal.SIGKILL:
            break
    return done


def _in_process(args: list[str], run_dir: Path) -> float:
    from helpers import compose_train
    from lightning_vlm.training import train

    start = time.perf_counter()
    train(compose_train(args, run_dir))
    return time.perf_counter() - start


def _guarded(section: dict, key: str, fn, *args) -> None:
    # One run's failure is reported, not raised: the other scenarios still run.
    try:
        section[key] = fn(*args)
    except Exception as exc:
        section[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def main(report_path: Path, workdir: Path, names: list[str]) -> None:
    import torch

    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 gives the train.py subprocesses
    names = sorted(names, key=lambda n: n == "grpo_vllm")  # vLLM last (it rebinds this process's threads)
    report: dict = {}
    kills: dict[tuple[str, str], Future] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for name in names:
            scenario = SCENARIOS[name]
            chains = kill_chains(name, scenario)
            report[name] = {"scenario": {**asdict(scenario), "max_steps": scenario.max_steps,
                                         "every": scenario.every, "epoch_steps": scenario.epoch_steps},
                            "chains": chains, "kills": {}, "runs": {}}  # fmt: skip
            for point, chain in chains.items():
                kills[name, point] = pool.submit(_kill_chain, scenario.args(), workdir / name / point, chain)
        for name in names:
            scenario, section = SCENARIOS[name], report[name]
            straight = workdir / name / "straight"
            section["runs"]["straight"] = {"dir": str(straight)}
            _guarded(section["runs"]["straight"], "seconds", _in_process, scenario.args(), straight)
            for point in ("random", "epoch"):
                _guarded(section["kills"], point, kills[name, point].result)
                done = section["kills"][point]
                if not isinstance(done, list):
                    continue  # the error is in the report
                last = Path(done[-1]["dir"]) / "checkpoints" / "last.ckpt"
                resumed = workdir / name / f"{point}_resumed"
                section["runs"][point] = {"dir": str(resumed), "ckpt_path": str(last)}
                if last.is_file():
                    _guarded(section["runs"][point], "seconds", _in_process,
                             [*scenario.args(), f"ckpt_path={last}"], resumed)  # fmt: skip
            report_path.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
