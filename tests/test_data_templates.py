"""Prompt/answer templates and the system turn (open-r1 style data by config only), and validation's
answer length following the data (``val_max_new_tokens: null``)."""

from __future__ import annotations

import json
import logging
import re

import datasets
import pytest
from PIL import Image
from transformers import AutoProcessor

from helpers import compose_train
from lightning_vlm.data import PromptDataModule, RowError, SFTDataModule
from lightning_vlm.data.templates import RowFormat
from lightning_vlm.generation.base import Rollouts
from lightning_vlm.methods.val_tokens import ANSWER_MARGIN
from lightning_vlm.models.chat_render import server_chat_template
from lightning_vlm.models.encoding import render
from lightning_vlm.models.tiny import TINY_FAMILIES
from lightning_vlm.training import train

# open-r1's system prompt (lmms-lab/multimodal-open-r1-8k-verified recipes): commas, tags and all.
SYSTEM = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer. The reasoning process and answer are enclosed within <think> </think> and <answer> "
    "</answer> tags, respectively, i.e., <think> reasoning process here </think><answer> answer here "
    "</answer>"
)
IMG = {"type": "image"}
LONG = "The shapes are red."  # 5 tokens of the tiny tokenizer; DPO's old cap of 4 could not score it
# tiny_start=random: these runs test data handling, not learning, so no SFT warm start is needed.
SHORT_RUN = ["tiny_start=random", "logger=none", "callbacks=none", "trainer.enable_progress_bar=false",
             "trainer.max_steps=1", "trainer.val_check_interval=1", "data.batch_size=2", "data.val_batch_size=2"]  # fmt: skip


def text(s: str) -> dict:
    return {"type": "text", "text": s}


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """Keep the json builder's Arrow cache inside the test's folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def write_jsonl(path, rows: list[dict]) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


@pytest.fixture
def open_r1(tmp_path):
    """An open-r1 style JSONL: problem, solution (tagged or plain), and the image under another name."""
    (tmp_path / "img").mkdir()
    rows = []
    for i, color in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]):
        Image.new("RGB", (32, 32), color).save(tmp_path / "img" / f"{i}.png")
        solution = f"<answer> {i + 2} </answer>" if i % 2 == 0 else str(i + 2)
        rows.append({"problem": f"What is {i} + 2?", "solution": solution, "picture": f"img/{i}.png"})
    return write_jsonl(tmp_path / "train.jsonl", rows)


def test_open_r1_prompt_set_trains_grpo_by_config_only(open_r1, tmp_path):
    cfg = compose_train(
        ["method=grpo", f"data.train={open_r1}", 'data.prompt_template="{problem}"',
         f'data.system_prompt="{SYSTEM}"', "data.column_map={picture:image}", "data.val_fraction=0.5",
         "tiny_start=random", "logger=none", "callbacks=none", "trainer.enable_progress_bar=false", "trainer.max_steps=2",
         "trainer.val_check_interval=2", "data.batch_size=1", "data.val_batch_size=2",
         "method.num_generations=2", "method.val_num_generations=2"],
        tmp_path,
    )  # fmt: skip
    metrics, out = train(cfg)
    assert out["trainer"].global_step == 2 and "val/reward" in metrics and "val/answer_accuracy" in metrics
    row = out["datamodule"].val_dataset[0]
    system, user = row["prompt"]
    assert system == {"role": "system", "content": [text(SYSTEM)]}
    assert (
        user["role"] == "user"
        and user["content"][0] == IMG
        and user["content"][1]["text"].startswith("What is")
    )
    assert len(row["images"]) == 1 and row["images"][0].size == (32, 32)
    # accuracy_reward reads the solution column, inside <answer> tags or plain
    module = out["module"]
    for row in out["datamodule"].train_dataset:
        answer = str(int(row["problem"].split()[2]) + 2)
        completions = [f"<think>add</think><answer>{answer}</answer>", "<answer>99</answer>"]
        rollouts = Rollouts([row], [[1], [1]], completions, [False, False], num_generations=2)
        rewards, names = module.score(rollouts)
        assert names == ["accuracy_reward"] and rewards[:, 0].tolist() == [1.0, 0.0], row["solution"]


def test_a_mixed_file_whose_first_row_has_no_solution_still_scores_answers(tmp_path):
    """Python-json rows keep their own keys (a field changes type between rows): the first validation
    row is a caption with no ``solution``, yet the others' answers are scored and the reward sees them."""
    (tmp_path / "img").mkdir()
    Image.new("RGB", (32, 32), (255, 0, 0)).save(tmp_path / "img" / "0.png")
    val = [{"problem": "Describe it.", "picture": "img/0.png"},
           {"problem": "How many?", "solution": "2", "picture": "img/0.png"},
           {"problem": "Where?", "solution": [0.1, 0.2, 0.5, 0.6], "picture": "img/0.png"}]  # fmt: skip
    train_rows = [dict(val[1], problem=f"How many {i}?") for i in range(2)]
    cfg = compose_train(
        ["method=grpo", f"data.train={write_jsonl(tmp_path / 'train.jsonl', train_rows)}",
         f"data.val={write_jsonl(tmp_path / 'val.jsonl', val)}", 'data.prompt_template="{problem}"',
         "data.column_map={picture:image}", "tiny_start=random", "logger=none", "callbacks=none",
         "trainer.enable_progress_bar=false", "trainer.max_steps=1", "data.batch_size=1", "data.val_batch_size=3",
         "method.num_generations=2", "method.val_num_generations=2"],
        tmp_path,
    )  # fmt: skip
    metrics, out = train(cfg)
    assert "solution" not in out["datamodule"].val_dataset[0]
    assert "val/answer_accuracy" in metrics


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_tiny_chat_template_takes_a_system_turn(family, tiny_path):
    processor = AutoProcessor.from_pretrained(tiny_path(family))
    fmt = RowFormat("prompt", prompt_template="{problem}", system_prompt=SYSTEM)
    row = fmt.normalize({"problem": "What is 2 + 2?", "image": Image.new("RGB", (8, 8))}, 0, "data", None)
    rendered = render(processor, row["prompt"], add_generation_prompt=True)
    assert SYSTEM in rendered and rendered.index(SYSTEM) < rendered.index("What is 2 + 2?")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_block_content_renders_as_text_and_a_vllm_server_renders_it_the_same(family, tiny_path):
    # GLM-4.1V's template prints system and assistant content as it is: blocks would print as their repr.
    processor = AutoProcessor.from_pretrained(tiny_path(family))
    messages = [
        {"role": "system", "content": [text("Be brief.")]},
        {"role": "user", "content": [IMG, text("What colour?")]},
        {"role": "assistant", "content": [text("red")]},
        {"role": "user", "content": [text("And now?")]},
    ]
    rendered = render(processor, messages, add_generation_prompt=True)
    assert "Be brief." in rendered and "red" in rendered and "'text'" not in rendered
    # A vLLM server is handed content as blocks: the template it is given renders the same text.
    template = server_chat_template(processor)
    assert (template is not None) == (family == "glm4v")
    served = processor.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert served == rendered


def test_an_image_placeholder_in_a_template_places_the_image():
    # LLaVA-style "<image>\n{question}" was refused; the image now goes where the template writes it
    fmt = RowFormat("prompt", prompt_template="Look: <image>\n{problem}")
    row = fmt.normalize({"problem": "What is 2 + 2?", "image": Image.new("RGB", (8, 8))}, 0, "data", None)
    blocks = row["prompt"][-1]["content"]
    assert blocks == [
        {"type": "text", "text": "Look: "},
        {"type": "image"},
        {"type": "text", "text": "\nWhat is 2 + 2?"},
    ]


def test_template_naming_a_missing_column_names_file_row_and_column(tmp_path):
    rows = [{"problem": "1?", "solution": "1"}, {"question": "2?", "solution": "2"}]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    dm = PromptDataModule(train=path, prompt_template="Solve: {problem}")
    with pytest.raises(
        RowError, match=r"data.jsonl, row 1, column 'problem'.*prompt_template.*missing_column"
    ):
        dm.setup()
    dm = PromptDataModule(train=path, prompt_template="Solve: {problem}", on_bad_row="skip")
    dm.setup()
    assert dm.train_dataset.indices == [0] and dm.skipped == {"missing_column": 1}


@pytest.mark.parametrize(
    ("template", "value"),
    [("{answers}", ["red", "crimson"]), ("A: {answers}", {"text": "red"}), ("{meta[answers]}", ("red",))],
)
def test_a_template_field_that_is_a_list_or_dict_is_refused_naming_it(template, value):
    # VQAv2's `answers` (a list) was written as its Python repr, "['red', 'crimson']", and trained on.
    fmt = RowFormat("sft", prompt_template="{q}", answer_template=template)
    row = {"q": "Colour?", "answers": value, "meta": {"answers": value}}
    field = template[template.index("{") + 1 : template.index("}")]
    with pytest.raises(RowError, match=rf"row 3, column '(answers|meta)'.*\{{{re.escape(field)}\}} is a"):
        fmt.normalize(row, 3, "data.jsonl", None, False)
    # One item of it, or a number, is text
    fmt = RowFormat("sft", prompt_template="{q} {n}", answer_template="{answers[0]}")
    out = fmt.normalize({"q": "Colour?", "n": 2, "answers": ["red"]}, 0, "data.jsonl", None, False)
    assert out["messages"][-1]["content"] == [{"type": "text", "text": "red"}]


@pytest.mark.parametrize(
    ("module", "kwargs", "match"),
    [
        (PromptDataModule, {"prompt_template": "{problem"}, "data.prompt_template='{problem' is not"),
        (PromptDataModule, {"prompt_template": "Q: {}"}, "must name a column"),
        (PromptDataModule, {"prompt_template": {"problem": None}}, "must be a string.*quote it"),
        (PromptDataModule, {"answer_template": "{solution}"}, "answer_template applies to SFT data only"),
        (SFTDataModule, {"prompt_template": "{problem}"}, "need both data.prompt_template"),
    ],
)
def test_bad_template_settings_fail_at_construction(module, kwargs, match):
    with pytest.raises(ValueError, match=match):
        module(**kwargs)


def test_sft_rows_from_templates_and_a_row_keeps_its_own_system_turn():
    fmt = RowFormat("sft", prompt_template="{problem} ({{one word}})", answer_template="<answer>{solution}</answer>",
                    system_prompt="Be brief.")  # fmt: skip
    row = fmt.normalize({"problem": "Color?", "solution": "red", "image": "a.png"}, 0, "data", None, False)
    assert row["messages"] == [
        {"role": "system", "content": [text("Be brief.")]},
        {"role": "user", "content": [IMG, text("Color? ({one word})")]},
        {"role": "assistant", "content": [text("<answer>red</answer>")]},
    ]
    own = [{"role": "system", "content": "Think."}, {"role": "user", "content": "Hi"}]
    row = RowFormat("prompt", system_prompt="Be brief.").normalize({"prompt": own}, 0, "data", None)
    assert [m["content"] for m in row["prompt"]] == [[text("Think.")], [text("Hi")]]


def preference_rows(answers: list[str]) -> list[dict]:
    return [{"prompt": "Color?", "chosen": a, "rejected": "blue", "image": "img.png"} for a in answers]


def sft_rows(answers: list[str]) -> list[dict]:
    return [{"problem": "Color?", "solution": a, "image": "img.png"} for a in answers]


@pytest.mark.parametrize(
    ("method", "setting"), [("sft", None), ("dpo", None), ("dpo", 7), ("sft_synthetic", None)]
)
def test_val_max_new_tokens_follows_the_longest_answer_unless_set(method, setting, tmp_path, caplog):
    overrides = [*SHORT_RUN, f"method.val_max_new_tokens={'null' if setting is None else setting}"]
    if method == "sft_synthetic":  # one-word answers: 1 token + the margin
        overrides += ["method=sft", "data.synthetic.num_train=4", "data.synthetic.num_val=2"]
        longest = 1
    else:
        Image.new("RGB", (16, 16), (255, 0, 0)).save(tmp_path / "img.png")
        build = sft_rows if method == "sft" else preference_rows
        train_file = write_jsonl(tmp_path / "train.jsonl", build(["red", "red"]))
        val_file = write_jsonl(tmp_path / "val.jsonl", build(["red", LONG]))
        overrides += [f"method={method}", f"data.train={train_file}", f"data.val={val_file}"]
        if method == "sft":  # SFT data from templates too
            overrides += ['data.prompt_template="{problem}"', 'data.answer_template="{solution}"']
        longest = 5
    with caplog.at_level(logging.INFO, logger="lightning_vlm.methods.val_tokens"):
        metrics, out = train(compose_train(overrides, tmp_path))
    module = out["module"]
    assert len(module.vlm.tokenizer(LONG, add_special_tokens=False)["input_ids"]) == 5
    expected = setting if setting is not None else longest + ANSWER_MARGIN
    assert module.val_new_tokens == expected and "val/answer_accuracy" in metrics
    logged = [r.getMessage() for r in caplog.records if r.name == "lightning_vlm.methods.val_tokens"]
    assert logged == ([] if setting is not None else [f"val_max_new_tokens={expected}: the longest of 2 "
                      f"validation answers + {ANSWER_MARGIN} tokens (method.val_max_new_tokens=null; set a "
                      "number to override)"])  # fmt: skip


def test_column_map_renames_instead_of_copying(tmp_path):
    Image.new("RGB", (8, 8), (255, 0, 0)).save(tmp_path / "a.png")
    rows = [{"question": "Color?", "image": "a.png", "solution": "red"}]
    dm = PromptDataModule(train=write_jsonl(tmp_path / "q.jsonl", rows), column_map={"question": "prompt"})
    dm.setup()
    row = dm.train_dataset[0]
    assert "question" not in row and row["prompt"][0]["content"] == [IMG, text("Color?")]
    # a list of images in a column named "image": renamed, not "both 'image' and 'images'"
    rows = [{"image": ["a.png", "a.png"], "prompt": [{"role": "user", "content": [IMG, IMG, text("Q")]}]}]
    dm = PromptDataModule(train=write_jsonl(tmp_path / "two.jsonl", rows), column_map={"image": "images"})
    dm.setup()
    assert len(dm.train_dataset[0]["images"]) == 2 and "image" not in dm.train_dataset[0]
    # a swap still reads each column once, under its new name
    fmt = RowFormat("prompt", column_map={"a": "b", "b": "a"})
    assert fmt.fill({"a": 1, "b": 2, "c": 3}) == {"a": 2, "b": 1, "c": 3}


def test_column_map_keeps_our_column_on_rows_without_the_mapped_one():
    # {image: images} dropped the images of a row that already had "images" (silently, a text-only row),
    # and {question: prompt} failed rows written with "prompt" as missing their prompt.
    fmt = RowFormat("prompt", column_map={"image": "images", "question": "prompt"})
    assert fmt.fill({"prompt": "P", "images": ["a", "b"]}) == {"prompt": "P", "images": ["a", "b"]}
    assert fmt.fill({"question": "Q", "image": "a"}) == {"prompt": "Q", "images": "a"}


def test_column_map_reads_a_nested_field_by_its_dotted_path():
    # verl's rows hold the answer at reward_model.ground_truth: no config reached it
    fmt = RowFormat("prompt", column_map={"reward_model.ground_truth": "solution"})
    verl = {"prompt": "P", "reward_model": {"style": "rule", "ground_truth": "4"}}
    assert fmt.fill(verl) == {**verl, "solution": "4"}
    assert fmt.fill({"prompt": "P", "reward_model": None}) == {"prompt": "P", "reward_model": None}
    # a column whose own name holds the dot wins over the path
    assert fmt.fill({"prompt": "P", "reward_model.ground_truth": "5"}) == {"prompt": "P", "solution": "5"}
