"""The dataset and reasoning-gym tasks: the user's files read with `datasets`,
prompts rendered as the model sees them, a deterministic order per epoch,
and errors that name the file, the row and the field."""

from __future__ import annotations

import json
import pathlib

import pytest
import trio

from rlflow import config as C
from rlflow.tasks.dataset import DatasetError, DatasetTaskImpl, ReasoningGymTaskImpl, read_rows

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARITH = ROOT / "examples" / "data" / "arith.jsonl"
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    from rlflow.models import build_tokenizer

    # Every printable character, so that templates and words tokenize.
    chars = "".join(chr(c) for c in range(32, 127)) + "\n"
    tok: PreTrainedTokenizerFast = build_tokenizer(chars)
    return tok


def task(tokenizer, tmp_path=None, **fields) -> DatasetTaskImpl:
    cfg = C.DatasetTask(**{"train": str(ARITH), **fields})
    return DatasetTaskImpl(cfg, seed=3, tokenizer=tokenizer)


def write_jsonl(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_row_once_per_epoch_in_an_order_that_is_a_function_of_the_seed(tokenizer):
    first = task(tokenizer)
    n = len(first.train)
    assert n == 8000
    epoch0 = [first.index(g) for g in range(n)]
    epoch1 = [first.index(g) for g in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))  # no row skipped or repeated within an epoch
    assert epoch0 != epoch1  # reshuffled per epoch
    again = task(tokenizer)  # a resumed run, or another replica
    assert [again.index(g) for g in (0, 17, n + 5)] == [epoch0[0], epoch0[17], epoch1[5]]
    group = first.prompt(17, n=4, min_version=1)
    row = first.row(17)
    assert tokenizer.decode(group.prompt_ids) == row["prompt"] and group.reference == row["answer"]


def test_a_held_out_share_is_never_trained_on(tokenizer):
    held = task(tokenizer, eval_fraction=0.1)
    assert len(held.heldout) == 800 and len(held.train) + held.train.skipped["also in the evaluation split"] == 7200
    assert len(task(tokenizer, eval_fraction=0.1, eval_size=50).heldout) == 50
    train = {r["prompt"] for r in held.train.rows}
    assert not train & {r["prompt"] for r in held.heldout.rows}
    separate = task(tokenizer, eval=str(ARITH.with_name("arith-eval.jsonl")))
    assert len(separate.train) == 8000 and len(separate.heldout) == 1000


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv", "folder"])
def test_each_kind_of_file_is_read(kind, tmp_path):
    import datasets

    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]
    data = datasets.Dataset.from_list(rows)
    path = {
        "jsonl": tmp_path / "d.jsonl",
        "parquet": tmp_path / "d.parquet",
        "csv": tmp_path / "d.csv",
        "folder": tmp_path / "d",
    }[kind]
    {"jsonl": lambda: data.to_json(str(path)), "parquet": lambda: data.to_parquet(str(path)),
     "csv": lambda: data.to_csv(str(path), index=False), "folder": lambda: data.save_to_disk(str(path))}[kind]()
    got = read_rows(path)
    assert [(r["prompt"], str(r["answer"])) for r in got] == [(r["prompt"], r["answer"]) for r in rows]


def test_chat_messages_and_strings_go_through_the_template_with_the_system_prompt(tokenizer, tmp_path):
    tokenizer.chat_template = TEMPLATE
    try:
        data = write_jsonl(tmp_path / "chat.jsonl", [
            {"prompt": "hi", "answer": "1"},
            {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "yo"}], "answer": "2"},
        ])
        chat = task(tokenizer, train=str(data), system_prompt="be brief")
        assert chat.train.texts == [
            "<|system|>be brief\n<|user|>hi\n<|assistant|>",
            "<|system|>own\n<|user|>yo\n<|assistant|>",  # a row's own system message stays
        ]
        plain = task(tokenizer, train=str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi", "answer": "1"}])),
                     chat_template=False)
        assert plain.train.texts == ["hi"]
    finally:
        tokenizer.chat_template = None


def test_long_prompts_are_left_out_and_counted(tokenizer, tmp_path):
    rows = [{"prompt": "x" * n, "answer": ""} for n in (5, 50, 500)]
    short = task(tokenizer, train=str(write_jsonl(tmp_path / "d.jsonl", rows)), max_prompt_tokens=60)
    assert len(short.train) == 2 and sum(short.train.skipped.values()) == 1
    assert "task.max_prompt_tokens = 60" in next(iter(short.train.skipped))
    with pytest.raises(DatasetError, match="no training rows are left"):
        task(tokenizer, train=str(write_jsonl(tmp_path / "e.jsonl", rows)), max_prompt_tokens=2)


@pytest.mark.parametrize(
    ("rows", "fields", "error"),
    [
        ([{"prompt": "a", "answer": "1"}, {"question": "b", "answer": "2"}], {},
         r"d.jsonl: line 2: has no field 'prompt'"),
        ([{"prompt": "a"}], {}, r"d.jsonl: line 1: has no field 'answer' \(task.answer"),
        ([{"prompt": [{"role": "user"}], "answer": "1"}], {},
         r"d.jsonl: line 1: field 'prompt'\[0\]: is not a \{role, content\} message"),
        ([{"prompt": [{"role": "user", "content": "x"}], "answer": "1"}], {"chat_template": False},
         r"d.jsonl: line 1: field 'prompt': holds chat messages, but prompts are not rendered with a chat template"),
        ([{"prompt": 7, "answer": "1"}], {"chat_template": True},
         r"d.jsonl: line 1: field 'prompt': is neither a string nor a list"),
    ],
)
def test_bad_rows_name_the_file_the_row_and_the_field(tokenizer, tmp_path, rows, fields, error):
    tokenizer.chat_template = TEMPLATE
    try:
        with pytest.raises(DatasetError, match=error):
            task(tokenizer, train=str(write_jsonl(tmp_path / "d.jsonl", rows)), **fields)
    finally:
        tokenizer.chat_template = None


def test_a_row_is_named_as_its_file_numbers_it(tokenizer, tmp_path):
    """Lines from 1 as an editor shows them (blank lines and a CSV's header
    counted, a quoted CSV field may span lines); records from 1 where the
    file has no lines."""
    import datasets

    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "answer": "1"}\n\n   \n{"prompt": "b", "answer": "2"}\n'
                                      '{"q": "c", "answer": "3"}\n')
    with pytest.raises(DatasetError, match=r"d.jsonl: line 5: has no field 'prompt'"):
        task(tokenizer, train=str(tmp_path / "d.jsonl"))
    (tmp_path / "d.csv").write_text('prompt,answer\n"a\nspanning",1\n\nb,2\n,3\n')
    with pytest.raises(DatasetError, match=r"d.csv: line 6: has no field 'prompt'"):
        task(tokenizer, train=str(tmp_path / "d.csv"))
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}, {"prompt": None, "answer": "3"}]
    (tmp_path / "d.json").write_text(json.dumps(rows, indent=1))
    data = datasets.Dataset.from_list(rows)
    data.to_parquet(str(tmp_path / "d.parquet"))
    data.save_to_disk(str(tmp_path / "folder"))
    for name in ("d.json", "d.parquet", "folder"):
        with pytest.raises(DatasetError, match=rf"{name}: record 3: has no field 'prompt'"):
            task(tokenizer, train=str(tmp_path / name))
    # JSON lines in a .json file are lines.
    write_jsonl(tmp_path / "lines.json", rows)
    with pytest.raises(DatasetError, match=r"lines.json: line 3: has no field 'prompt'"):
        task(tokenizer, train=str(tmp_path / "lines.json"))


def test_rows_keep_their_line_through_a_held_out_share(tokenizer):
    held = task(tokenizer, eval_fraction=0.1)
    lines = ARITH.read_text().splitlines()
    for split in (held.train, held.heldout):
        for i in (0, 7, len(split) - 1):
            line = int(split.where(i).rsplit("line ", 1)[1])
            assert json.loads(lines[line - 1]) == split.rows[i]
    g = 123
    assert held.where(g) == held.train.where(held.index(g))


def test_a_prompt_column_mixing_strings_and_messages_is_a_warning_naming_the_first_odd_row(tokenizer, tmp_path):
    tokenizer.chat_template = TEMPLATE
    try:
        rows = [{"prompt": "hi", "answer": "1"}] * 6 + [
            {"prompt": [{"role": "user", "content": "yo"}], "answer": "2"},
            {"prompt": [{"role": "user", "content": "again"}], "answer": "3"},
        ]
        mixed = task(tokenizer, train=str(write_jsonl(tmp_path / "d.jsonl", rows)))
        assert len(mixed.train) == 8  # it still loads
        (warning,) = mixed.warnings
        assert warning.startswith(f"{tmp_path / 'd.jsonl'}: line 7: field 'prompt' is a list of chat messages, "
                                  "while line 1 has a string")
        clean = task(tokenizer, train=str(write_jsonl(tmp_path / "e.jsonl", rows[:6])))
        assert clean.warnings == []
    finally:
        tokenizer.chat_template = None


def test_missing_and_unknown_files_are_named(tmp_path):
    with pytest.raises(DatasetError, match="nowhere.jsonl: no such file"):
        read_rows(tmp_path / "nowhere.jsonl")
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DatasetError, match=r"d.txt: not a data file rlflow reads"):
        read_rows(tmp_path / "d.txt")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(DatasetError, match=r"bad.jsonl: cannot be read as json"):
        read_rows(tmp_path / "bad.jsonl")


def test_reasoning_gym_problems_are_rows(tokenizer):
    cfg = C.ReasoningGymTask(dataset="leg_counting", size=20, eval_size=5)
    gym = ReasoningGymTaskImpl(cfg, seed=1, tokenizer=tokenizer)
    assert len(gym.train) + sum(gym.train.skipped.values()) == 20 and len(gym.heldout) == 5
    row = gym.row(3)
    assert set(row) >= {"question", "answer", "metadata"} and gym.prompt(3, 2).reference == row["answer"]
    assert not {r["question"] for r in gym.train.rows} & {r["question"] for r in gym.heldout.rows}
    # Another run seed: other training problems, the same evaluation problems.
    other = ReasoningGymTaskImpl(cfg, seed=2, tokenizer=tokenizer)
    assert [r["question"] for r in other.heldout.rows] == [r["question"] for r in gym.heldout.rows]
    assert [r["question"] for r in other.train.rows] != [r["question"] for r in gym.train.rows]
    with pytest.raises(DatasetError, match="reasoning-gym dataset 'no_such_thing'"):
        ReasoningGymTaskImpl(C.ReasoningGymTask(dataset="no_such_thing"), seed=1, tokenizer=tokenizer)


async def test_reasoning_gym_problems_are_scored_by_their_own_verifier(tokenizer):
    from rlflow.rewards import FunctionSpec, Sample, Status, open_pool

    gym = ReasoningGymTaskImpl(C.ReasoningGymTask(dataset="leg_counting", size=5, eval_size=1), seed=1,
                               tokenizer=tokenizer)
    row = gym.row(0)
    with trio.fail_after(120):
        async with open_pool([FunctionSpec(path="rlflow.rewards:reasoning_gym", workers=1)]) as pool:
            right, wrong, foreign = await pool.score_many([
                Sample(prompt=gym.prompt_text(0), response=row["answer"], reference=row["answer"], row=row),
                Sample(prompt=gym.prompt_text(0), response="-1", reference=row["answer"], row=row),
                Sample(prompt="", response="1", row={"question": "x"}),
            ])
    assert right[0].value == 1.0 and wrong[0].value == 0.0
    assert foreign[0].status is Status.ERROR and "not a reasoning-gym entry" in foreign[0].message
