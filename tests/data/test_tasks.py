"""Tasks: determinism, disjoint splits, graders, JSONL loading and its errors."""

import json

import pytest

from opdjax.data import tasks
from opdjax.data.tasks import Example, JsonlTask, corpus, get_task

BUILTINS = ["addition", "sort", "copy", "reverse"]


@pytest.mark.parametrize("name", BUILTINS)
def test_examples_are_deterministic_in_seed(name):
    task = get_task(name)
    a = task.examples(50, seed=3)
    b = get_task(name).examples(50, seed=3)
    c = task.examples(50, seed=4)
    assert [(e.prompt, e.answer) for e in a] == [(e.prompt, e.answer) for e in b]
    assert [e.prompt for e in a] != [e.prompt for e in c]


@pytest.mark.parametrize("name", BUILTINS)
def test_train_and_heldout_are_disjoint(name):
    task = get_task(name)
    train = task.examples(400, seed=0, split="train")
    held = task.examples(100, seed=0, split="heldout")
    assert len(train) == 400 and len(held) == 100
    assert {e.prompt for e in train}.isdisjoint({e.prompt for e in held})
    assert all(e.meta["split"] == "train" for e in train) and all(e.meta["split"] == "heldout" for e in held)
    # distinct items are preferred while the split has plenty of them
    assert len({e.prompt for e in held}) == 100


def test_addition_heldout_pair_never_appears_swapped_in_train():
    task = get_task("addition", digits=1)  # 100 ordered pairs: forces the swap case to be exercised
    train = task.examples(300, seed=1)
    held = task.examples(20, seed=1, split="heldout")
    pairs = lambda xs: {frozenset((e.meta["a"], e.meta["b"])) for e in xs}  # noqa: E731
    assert pairs(train).isdisjoint(pairs(held))


def test_addition_answers_are_correct_and_prompts_short():
    for ex in get_task("addition", digits=3).examples(100, seed=0):
        a, b = ex.prompt[:-1].split("+")
        assert ex.prompt.endswith("=") and len(a) <= 3 and len(b) <= 3
        assert ex.answer == str(int(a) + int(b))


def test_sort_copy_reverse_answers():
    for ex in get_task("sort", length=5).examples(30, seed=0):
        ds = ex.prompt[len("sort "):-1].split()
        assert len(ds) == 5 and ex.answer == " ".join(sorted(ds))
    for ex in get_task("reverse").examples(30, seed=0):
        s = ex.prompt[len("reverse "):-1]
        assert ex.answer == s[::-1]
    for ex in get_task("copy", length=6).examples(30, seed=0):
        assert ex.answer == ex.prompt[len("copy "):-1] and len(ex.answer) == 6


def test_graders_exact_match_after_strip():
    task = get_task("addition")
    ex = Example(prompt="12+34=", answer="46", meta={})
    assert task.grade(ex, "46") == 1.0
    assert task.grade(ex, "  46\n") == 1.0
    assert task.grade(ex, "47") == 0.0
    assert task.grade(ex, "46 7") == 0.0
    assert task.grade(ex, "") == 0.0
    sort_ex = get_task("sort").examples(1, seed=0)[0]
    assert get_task("sort").grade(sort_ex, sort_ex.answer) == 1.0
    assert get_task("sort").grade(sort_ex, sort_ex.answer.replace(" ", "")) == 0.0


def test_cut_at_earliest_marker():
    assert tasks.cut_at("46</s>junk\n", ["\n", "</s>"]) == "46"
    assert tasks.cut_at("46", ["</s>"]) == "46"


def test_corpus_is_prompt_plus_answer():
    lines = corpus("addition", 5, seed=0)
    exs = get_task("addition").examples(5, seed=0)
    assert lines == [e.prompt + e.answer for e in exs]


def test_registry_errors_list_names_and_options():
    with pytest.raises(ValueError, match="addition"):
        get_task("nope")
    with pytest.raises(ValueError, match="digits"):
        get_task("addition", digit=3)
    with pytest.raises(ValueError, match="digits"):
        get_task("addition", digits=0)
    with pytest.raises(ValueError, match="split"):
        get_task("copy").examples(3, seed=0, split="test")


def _task_cell(answer: str):
    """A notebook cell defining `ConstTask`: each run makes a new class with the same qualified name."""

    class ConstTask:
        name = "test_const"

        def examples(self, n, seed, split="train"):
            return [Example(prompt=f"q{i}", answer=answer) for i in range(n)]

        def grade(self, example, completion_text):
            return float(completion_text.strip() == example.answer)

    return ConstTask


def _other_task_cell():
    class ConstTask:  # same name, different qualified name
        name = "test_const"

    return ConstTask


def test_reregistering_the_same_task_definition_replaces_it():
    try:
        tasks.register_task("test_const")(_task_cell("1"))
        second = tasks.register_task("test_const")(_task_cell("2"))  # the cell, run again with an edit
        assert tasks.TASKS["test_const"] is second
        assert [e.answer for e in get_task("test_const").examples(2, seed=0)] == ["2", "2"]
    finally:
        tasks.TASKS.pop("test_const", None)
    assert "test_const" not in tasks.TASKS


def test_a_different_task_under_a_taken_name_is_refused_and_the_entry_kept():
    try:
        first = tasks.register_task("test_const")(_task_cell("1"))
        with pytest.raises(ValueError, match=r"task 'test_const' is already registered to "
                                             r"tests\.data\.test_tasks\._task_cell\.<locals>\.ConstTask.*"
                                             r"pick another name"):
            tasks.register_task("test_const")(_other_task_cell())
        assert tasks.TASKS["test_const"] is first
    finally:
        tasks.TASKS.pop("test_const", None)
    with pytest.raises(ValueError, match="task 'addition' is already registered to opdjax.data.tasks.AdditionTask"):
        tasks.register_task("addition")(_task_cell("1"))


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_loads_grades_and_splits(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": i} for i in range(200)]
    rows += [{"prompt": "pinned", "answer": "x", "split": "heldout"}, {"prompt": "noans"}]
    p = _write(tmp_path / "d.jsonl", [json.dumps(r) for r in rows] + [""])
    task = get_task("jsonl", path=str(p))
    assert isinstance(task, tasks.Task)
    held = task.split_rows("heldout")
    train = task.split_rows("train")
    assert len(held) + len(train) == 202
    assert {e.prompt for e in held}.isdisjoint({e.prompt for e in train})
    assert "pinned" in {e.prompt for e in held}
    assert 5 <= len(held) <= 45  # ~10% of 200 by hash, plus the pinned row
    # deterministic, and cycles rather than dropping when n exceeds the split
    assert task.examples(30, seed=1, split="heldout") == task.examples(30, seed=1, split="heldout")
    big = task.examples(3 * len(held), seed=0, split="heldout")
    assert len(big) == 3 * len(held) and set(big) == set(held)
    q7 = next(e for e in task.rows if e.prompt == "q7")
    assert q7.answer == "7" and task.grade(q7, " 7 ") == 1.0 and task.grade(q7, "8") == 0.0
    noans = next(e for e in task.rows if e.prompt == "noans")
    assert noans.answer is None and task.grade(noans, "anything") is None
    assert not task.graded


def test_jsonl_custom_keys(tmp_path):
    p = _write(tmp_path / "d.jsonl", [json.dumps({"q": "hi", "a": "yo", "split": "train"})])
    task = JsonlTask(p, prompt_key="q", answer_key="a")
    (ex,) = task.examples(1, seed=0)
    assert (ex.prompt, ex.answer) == ("hi", "yo") and task.graded


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        JsonlTask(tmp_path / "nope.jsonl")


def test_jsonl_bad_json_names_line(tmp_path):
    p = _write(tmp_path / "d.jsonl", ['{"prompt": "a"}', "", '{"prompt": "b",,}'])
    with pytest.raises(ValueError, match=r"d\.jsonl:3: invalid JSON"):
        JsonlTask(p)


def test_jsonl_missing_prompt_key_names_line(tmp_path):
    p = _write(tmp_path / "d.jsonl", ['{"prompt": "a"}', '{"question": "b"}'])
    with pytest.raises(ValueError, match=r"d\.jsonl:2: missing prompt key 'prompt'.*question"):
        JsonlTask(p)


def test_jsonl_bad_split_and_non_object_name_line(tmp_path):
    p = _write(tmp_path / "d.jsonl", ['{"prompt": "a", "split": "test"}'])
    with pytest.raises(ValueError, match=r"d\.jsonl:1: 'split'"):
        JsonlTask(p)
    p = _write(tmp_path / "e.jsonl", ['{"prompt": "a"}', "[1, 2]"])
    with pytest.raises(ValueError, match=r"e\.jsonl:2: expected a JSON object"):
        JsonlTask(p)


def test_jsonl_empty_split_is_an_error(tmp_path):
    p = _write(tmp_path / "d.jsonl", ['{"prompt": "a", "split": "train"}'])
    with pytest.raises(ValueError, match="heldout"):
        JsonlTask(p).examples(1, seed=0, split="heldout")


def test_prompt_files_are_used_whole_and_bad_rows_name_file_and_line(tmp_path):
    """Issue 16 rows 5 and 9: every training row of a large file is streamed (no silent 4,096 cap); an empty
    file, a non-JSON line, a missing prompt and non-UTF-8 bytes are TaskErrors naming file:line."""
    import json as _json

    from opdjax.core.errors import InputError
    from opdjax.data.prompts import PromptStream
    from opdjax.data.tasks import TaskError, get_task

    big = tmp_path / "big.jsonl"
    big.write_text("".join(_json.dumps({"prompt": f"q{i}", "split": "train" if i % 10 else "heldout"}) + "\n"
                           for i in range(9002)))
    stream = PromptStream(get_task("jsonl", path=str(big)), seed=0)
    assert stream.size == 9002 - 901
    assert len({ex.prompt for ex in stream.next(stream.size)}) == stream.size  # one epoch: each row once
    cases = {"empty.jsonl": (b"", "no rows"), "nojson.jsonl": (b'{"prompt": "a"}\nnot json\n', ":2: invalid JSON"),
             "noprompt.jsonl": (b'{"question": "a"}\n', ":1: missing prompt key"),
             "latin1.jsonl": (b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n', ":2: not UTF-8")}
    for name, (data, words) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(TaskError, match=words) as e:
            get_task("jsonl", path=str(tmp_path / name))
        assert isinstance(e.value, InputError) and name in str(e.value)


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t "])
def test_an_empty_prompt_is_refused_naming_file_and_line(tmp_path, prompt):
    """Issue 38 row 7: an empty (or whitespace-only) prompt was accepted and trained on."""
    from opdjax.data.tasks import TaskError

    p = _write(tmp_path / "d.jsonl", ['{"prompt": "a"}', json.dumps({"prompt": prompt, "answer": "1"})])
    with pytest.raises(TaskError, match=r"d\.jsonl:2: 'prompt' is empty"):
        JsonlTask(p)


def test_a_line_over_the_reader_cap_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    """A line longer than MAX_LINE_BYTES is refused naming file:line and the cap, having read at most the cap."""
    from opdjax.data.tasks import TaskError

    monkeypatch.setattr(tasks, "MAX_LINE_BYTES", 1000)
    p = _write(tmp_path / "d.jsonl", ['{"prompt": "a"}', json.dumps({"prompt": "x" * 900}),
                                      json.dumps({"prompt": "x" * 1000})])
    with pytest.raises(TaskError, match=r"d\.jsonl:3: a line of more than 1,000 bytes"):
        JsonlTask(p)
