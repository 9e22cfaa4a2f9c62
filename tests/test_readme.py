"""Every command in the README runs as written.

Each ``train.py`` / ``eval.py`` command of the README's bash blocks composes (its overrides are real
config options). Those that run on this machine (CPU, tiny models) then run for 2 steps in-process;
the GPU ones (hub models, DeepSpeed, several GPUs) bind their model node instead, without a download.
Placeholders the README uses for a user's own files are replaced by real files written here. The
full-length default jobs are the learning tests (test_sft_learns, test_dpo_learns, test_online_learns).
"""

from __future__ import annotations

import json
import re
import shlex

import pytest
from PIL import Image
from test_configs import _bind

from helpers import ROOT, compose_train
from lightning_vlm.training import train

GPU_MARKS = ("model=qwen2_5_vl", "model=qwen2_vl", "model=gemma3", "model=llava_next", "model=smolvlm",
             "trainer=deepspeed", "trainer=gpu", "trainer.devices=4", "trainer.devices=8", "num_nodes=")  # fmt: skip
# several processes or a server: their own tests run them (test_ddp_*, test_vllm_server)
OWN_TESTS = ("trainer=ddp", "trainer=fsdp", "generation=vllm_server", "torchrun", "srun")
SHORT = ["trainer.max_steps=2", "trainer.val_check_interval=2", "data.synthetic.num_val=8",
         "data.val_batch_size=8", "logger=csv", "trainer.enable_progress_bar=false"]  # fmt: skip


def readme_commands() -> list[str]:
    """The train.py / eval.py command lines of the README's bash blocks (continuations joined)."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if re.search(r"\b(train|eval)\.py\b", line):
                commands.append(line)
    return commands


def _overrides(command: str) -> tuple[str, list[str], bool]:
    words = shlex.split(command)
    entry = next(i for i, w in enumerate(words) if w.endswith(("train.py", "eval.py")))
    args = [w for w in words[entry + 1 :] if w != "-m"]
    # a sweep composes with its first value of each list (its jobs are tested in test_train)
    first = [
        a.split("=", 1)[0] + "=" + a.split("=", 1)[1].split(",")[0] if "," in a and "[" not in a else a
        for a in args
    ]
    return ("eval" if words[entry].endswith("eval.py") else "train"), first, "-m" in words


@pytest.fixture(scope="module")
def user_files(tmp_path_factory, tiny_path):
    """Stand-ins for the README's placeholders: data files, a checkpoint, an HF folder."""
    root = tmp_path_factory.mktemp("readme_user")
    Image.new("RGB", (32, 32), (255, 0, 0)).save(root / "red.png")
    user = {
        "role": "user",
        "content": [{"type": "image"}, {"type": "text", "text": "What color is the shape?"}],
    }
    sft = {
        "messages": [user, {"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
        "images": ["red.png"],
    }
    prompt = {"prompt": [user], "solution": "red", "images": ["red.png"]}
    for name, row in (("train", sft), ("val", sft), ("prompts", prompt)):
        (root / f"{name}.jsonl").write_text("\n".join(json.dumps(row) for _ in range(8)))
    cfg = compose_train([*SHORT, "callbacks=none",
                         "+callbacks.export._target_=lightning_vlm.callbacks.export.ExportHFModel",
                         f"+callbacks.export.dirpath={root / 'hf'}",
                         "+callbacks.ckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint",
                         f"+callbacks.ckpt.dirpath={root / 'ckpt'}", "+callbacks.ckpt.filename=last"], root / "run")  # fmt: skip
    train(cfg)
    dpo = [*SHORT, "method=dpo", "callbacks=none", "+callbacks.ckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint",
           f"+callbacks.ckpt.dirpath={root / 'dpo_ckpt'}", "+callbacks.ckpt.filename=last"]  # fmt: skip
    train(compose_train(dpo, root / "dpo_run"))
    return root


def _substitute(command: str, files) -> str:
    """The command with the README's placeholders replaced by the stand-in files."""
    online = re.search(r"method=(grpo|gspo|rloo|online_dpo)\b", command)
    dpo = re.search(r"method=(dpo|mpo)\b", command)
    mapping = {
        "/data/train.jsonl": files / "train.jsonl",
        "/data/val.jsonl": files / ("prompts.jsonl" if online else "val.jsonl"),
        "<hf folder>": files / "hf",
        "sft_model": files / "hf",
    }
    for placeholder, path in mapping.items():
        command = command.replace(placeholder, str(path))
    ckpt = files / ("dpo_ckpt" if dpo else "ckpt") / "last.ckpt"
    return re.sub(r"ckpt_path=\S*<[^>]+>\S*", f"ckpt_path={ckpt}", command)


COMMANDS = readme_commands()


def test_the_readme_has_commands_to_check():
    assert len(COMMANDS) >= 15 and any("eval.py" in c for c in COMMANDS)


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_runs_as_written(command, user_files, tmp_path):
    config_name, args, sweep = _overrides(_substitute(command, user_files))
    cfg = compose_train(args, tmp_path, config_name=config_name)
    if any(m in command for m in GPU_MARKS):
        _bind(cfg.model)  # its model and settings resolve; the run itself needs the GPU and the hub
        return
    if sweep or any(m in command for m in OWN_TESTS):
        return  # composes; runs in test_train / test_ddp_* / test_vllm_server
    cfg = compose_train([*args, *SHORT], tmp_path, config_name=config_name)
    if config_name == "eval":
        from lightning_vlm.evaluation import evaluate

        evaluate(cfg)
    else:
        train(cfg)
