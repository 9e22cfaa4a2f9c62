"""Sample completions (TRL's log_completions): a W&B table read back from the offline run, the JSONL
file other loggers get, and the rich console table; train.py's train() for two steps each."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import wandb
from lightning.pytorch.loggers import WandbLogger
from PIL import Image
from wandb.proto import wandb_internal_pb2

from helpers import compose_train
from lightning_vlm.callbacks.completions import print_completions
from lightning_vlm.methods.completions import CompletionRecorder, CompletionSample, answer_samples
from lightning_vlm.training import train

# Two tiny steps, validated once at the end on four rows; a table per step for online methods.
SHORT = [
    "trainer.max_steps=2", "trainer.val_check_interval=2", "data.synthetic.num_val=4",
    "data.val_batch_size=4", "callbacks.completions.log_completions_steps=1",
]  # fmt: skip
ONLINE = ["method=grpo", "data.batch_size=2", "method.num_generations=2"]
COLUMNS = ["step", "image", "prompt", "completion"]


@pytest.fixture
def tiny(tiny_path) -> list[str]:
    """The random tiny model, not the SFT warm start the online and preference configs pick: that one is
    keyed by the training code's hash and rebuilt (minutes) after any edit; two steps need no skill."""
    return [f"model.model_name_or_path={tiny_path()}"]


def wandb_records(path: Path):
    """The protobuf records of an offline ``.wandb`` file. wandb 0.31 no longer ships a Python reader
    (its Go core writes the file): this is the LevelDB log framing wandb uses, 32 KiB blocks of
    chunks with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a wandb transaction log"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (length == 0 and kind == 0) or pos + 7 + length > len(data):  # the end, or a chunk being written
            break
        buf = data[pos + 7 : pos + 7 + length] if kind in (1, 2) else buf + data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            yield record


def logged_tables(run_dir: Path, key: str) -> list[tuple[dict, dict[str, Path]]]:
    """Each table logged under ``key``: its JSON (as wandb uploads it) and its files by artifact path."""
    (log_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    # wandb.finish() can return before wandb-core's writer has flushed the file: wait for the run's
    # exit record (it had not yet in 4 of 24 runs on the loaded test machine).
    deadline = time.monotonic() + 30
    records = list(wandb_records(log_file))
    while not any(r.HasField("exit") for r in records):
        assert time.monotonic() < deadline, f"{log_file} has no exit record after 30 s"
        time.sleep(0.2)
        records = list(wandb_records(log_file))
    history = [
        {tuple(i.nested_key): i.value_json for i in r.history.item} for r in records if r.HasField("history")
    ]
    assert any(h.get((key, "_type")) == '"table-file"' for h in history), f"no table logged as {key!r}"
    tables = []
    for r in records:
        # a run_table artifact per log; its name is the key made safe (and made unique), its entry is not
        files = {e.path: Path(e.local_path) for e in r.artifact.manifest.contents}
        if r.HasField("artifact") and r.artifact.type == "run_table" and f"{key}.table.json" in files:
            tables.append((json.loads(files[f"{key}.table.json"].read_text()), files))
    return tables


@pytest.fixture
def wandb_data_dir(tmp_path, monkeypatch):
    # wandb stages a table's images (for `wandb sync`) under its data dir: keep them in the test's folder.
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    yield
    wandb.finish()  # the next WandbLogger would otherwise reuse this run


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "key", "values"),
    [
        ("grpo", "completions", ["accuracy_reward", "reward", "advantage"]),
        ("sft", "val/completions", ["reference", "correct"]),
        ("dpo", "val/completions", ["reference", "correct"]),
        ("kto", "val/completions", ["reference", "correct"]),
    ],
)
def test_wandb_table_has_the_columns_and_images(method, key, values, tiny, tmp_path, wandb_data_dir):
    overrides = ONLINE if method == "grpo" else [f"method={method}"]
    train(compose_train([*overrides, *tiny, *SHORT, "logger=wandb"], tmp_path))
    wandb.finish()
    tables = logged_tables(tmp_path, key)
    # grpo: one table per optimizer step (log_completions_steps=1), at the step that generated them;
    # sft/dpo/kto: one per validation (the first validation batch: all four rows)
    assert [sorted({row[0] for row in t["data"]}) for t, _ in tables] == (
        [[0], [1]] if method == "grpo" else [[2]]
    )
    for table, files in tables:
        assert table["columns"] == [*COLUMNS, *values]
        assert len(table["data"]) == 4  # 2 prompts x 2 generations, or 4 validation rows
        for row in table["data"]:
            image = row[1]
            assert image["_type"] == "image-file" and files[image["path"]].is_file()
            assert Image.open(files[image["path"]]).size == (image["width"], image["height"])
            assert "color" in row[2]  # the synthetic question


@pytest.mark.slow
def test_csv_logger_appends_jsonl_rows_and_prints_them(tiny, tmp_path, capsys):
    train(
        compose_train(
            [*ONLINE, *tiny, *SHORT, "logger=csv", "callbacks.completions.num_completions_to_print=3"],
            tmp_path,
        )
    )
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 0, 0, 0, 1, 1, 1, 1] and {r["stage"] for r in rows} == {"train"}
    for r in rows:
        assert list(r) == ["stage", *COLUMNS, "accuracy_reward", "reward", "advantage"]
        assert r["reward"] == r["accuracy_reward"] and isinstance(r["advantage"], float)
        assert (tmp_path / r["image"]).is_file()  # a PNG in the run folder, not pixels in the file
    # the two completions of a prompt share its image file; two prompts per step
    assert rows[0]["image"] == rows[1]["image"] != rows[2]["image"]
    out = capsys.readouterr().out
    assert "completions at step 0" in out and "completions at step 1" in out
    assert out.count("accuracy_reward") == 2  # one console table per log, headers once each
    assert out.count("├") == 2 * 2  # num_completions_to_print=3 of the 4 rows: 2 row separators each


@pytest.mark.slow
def test_off_switch_writes_and_prints_nothing(tiny, tmp_path, capsys):
    overrides = ["method=sft", *tiny, *SHORT, "logger=csv", "callbacks.completions.log_completions=false"]
    train(compose_train(overrides, tmp_path))
    assert not (tmp_path / "completions.jsonl").exists() and not (tmp_path / "completions").exists()
    assert "completions at step" not in capsys.readouterr().out


def test_console_table_renders_the_samples(capsys):
    samples = [
        CompletionSample(f"prompt {i}", f"answer-{i}", None, {"reference": "red", "correct": i == 0})
        for i in range(2)
    ]
    assert print_completions("val/completions", 7, samples)
    out = capsys.readouterr().out
    assert "val/completions at step 7" in out and "prompt 1" in out and "answer-1" in out
    assert "reference" in out and "correct" in out and "True" in out and "False" in out


def test_recorder_keeps_one_batch_per_request():
    recorder = CompletionRecorder()
    assert not recorder.wants("val")  # not asked: methods build nothing
    recorder.request("val")
    sample = CompletionSample("p", "c", None, {})
    recorder.record("val", [sample])
    assert not recorder.wants("val")  # later validation batches record nothing
    assert recorder.take("val") == [sample] and recorder.take("val") == []


def test_a_second_write_at_the_same_step_keeps_each_lines_own_image(tmp_path):
    # A run resumed into its own folder logs again at steps it logged before the stop: the earlier
    # lines must still show their own images, not the later write's.
    from lightning_vlm.callbacks.completions import JSONL_NAME, append_jsonl

    for colour in ("red", "blue"):
        sample = CompletionSample("Q", "A", Image.new("RGB", (4, 4), colour), {"reward": 1.0})
        append_jsonl(tmp_path, "train", 3, [sample])
    lines = [json.loads(line) for line in (tmp_path / JSONL_NAME).read_text().splitlines()]
    pixels = [Image.open(tmp_path / line["image"]).getpixel((0, 0)) for line in lines]
    assert pixels == [(255, 0, 0), (0, 0, 255)]


class _StepsLogger(WandbLogger):
    """Records the step of every W&B log call (metrics, tables, images), logging nothing."""

    def __init__(self, save_dir) -> None:
        # A stand-in run: no wandb run starts (nor its folder, nor a run later loggers would reuse)
        super().__init__(
            save_dir=str(save_dir), offline=True, experiment=SimpleNamespace(id="run", dir=str(save_dir))
        )
        self.steps: list[tuple[int | None, list[str]]] = []

    def log_metrics(self, metrics, step=None) -> None:
        self.steps.append((step, sorted(k for k in metrics if k != "epoch")))

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def save(self) -> None:
        pass

    def finalize(self, status) -> None:
        pass


class _TwoStepsABatch(L.LightningModule):
    """An online method's shape: two optimizer steps per batch, a completion recorded per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.automatic_optimization = torch.nn.Linear(2, 1), False
        self.completion_recorder = CompletionRecorder()

    def training_step(self, batch, batch_idx) -> None:
        if self.completion_recorder.wants("train"):
            self.completion_recorder.record("train", [CompletionSample("p", "c", None, {"reward": 1.0})])
        opt = self.optimizers()
        for _ in range(2):
            opt.zero_grad()
            self.manual_backward(self.layer(batch[0]).sum())
            opt.step()
        self.log("train/reward", float(batch_idx))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_tables_go_to_wandb_at_the_step_its_metrics_take(tmp_path):
    # Lightning logs metrics once per batch (generation), while global_step counts optimizer steps: tables
    # at global_step ran ahead of the metrics (0, 2, 4 ... against 1, 3, 5), and a resumed run's W&B
    # history, read from its last logged step, then skipped metrics it never had.
    from lightning_vlm.callbacks.completions import LogCompletions
    from lightning_vlm.callbacks.run_report import RunReport

    logger, report = _StepsLogger(tmp_path), RunReport(str(tmp_path), {"reward": ["train/reward"]})
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(6, 2)), batch_size=1)
    trainer = L.Trainer(max_steps=12, logger=logger, callbacks=[LogCompletions(True, 0, None), report],
                        log_every_n_steps=2,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(_TwoStepsABatch(), data)
    tables = [step for step, keys in logger.steps if keys == ["completions"]]
    metrics = [step for step, keys in logger.steps if "train/reward" in keys]
    assert trainer.global_step == 12 and metrics == [1, 3, 5]
    assert tables == [0, 1, 2, 3, 4, 5]  # one a batch (log_every_n_steps=2 optimizer steps), at its batch
    report.finish(trainer)  # the curves image, after the last batch
    assert [step for step, keys in logger.steps if keys == ["curves"]] == [6]


def test_values_json_cannot_hold_are_written_as_null():
    from lightning_vlm.methods.completions import _number

    # NaN (a reward function's None) and an infinite reward: json.dumps writes NaN / Infinity, not JSON
    assert [_number(v) for v in (float("nan"), float("inf"), -float("inf"), 0.5)] == [None, None, None, 0.5]


def test_a_row_without_a_reference_has_no_verdict():
    # KTO: an undesirable row without `solution` has no reference; hits are those of the scored rows only.
    rows = [{"prompt": f"q{i}", "images": []} for i in range(3)]
    samples = answer_samples(rows, ["a", "b", "c"], ["a", None, "x"], [1.0, 0.0])
    assert [(s.values["reference"], s.values["correct"]) for s in samples] == [
        ("a", True),
        (None, None),
        ("x", False),
    ]
    for hits in ([1.0, 0.0, 1.0], [1.0]):
        with pytest.raises(ValueError, match=f"{len(hits)} hits for 2 references"):
            answer_samples(rows, ["a", "b", "c"], ["a", None, "x"], hits)
