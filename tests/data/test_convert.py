"""`opdjax data convert`: each common layout becomes rows `JsonlTask` loads with the same prompt and reference, and a
malformed row is refused in one line naming file:line, with nothing written."""

import json

import pytest

from opdjax.cli.main import main
from opdjax.data.convert import convert_file
from opdjax.data.tasks import JsonlTask, TaskError

USER = {"role": "user", "content": "What is 2+2?"}
ASSISTANT = {"role": "assistant", "content": "4"}


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _read(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


LAYOUT_CASES = {
    "messages": ({"messages": [{"role": "system", "content": "Be brief."}, USER, ASSISTANT], "id": 7},
                 {"messages": [{"role": "system", "content": "Be brief."}, USER, ASSISTANT]}),
    "question_answer": ({"question": "What is 2+2?", "answer": "2+2=4\n#### 4", "split": "heldout"},
                        {"prompt": "What is 2+2?", "answer": "2+2=4\n#### 4", "split": "heldout"}),
    "prompt_completion": ({"prompt": "What is 2+2?", "completion": 4}, {"prompt": "What is 2+2?", "answer": "4"}),
}


@pytest.mark.parametrize("layout", list(LAYOUT_CASES))
@pytest.mark.parametrize("asked", ["auto", "named"])
def test_each_layout_converts_to_rows_the_jsonl_task_reads_back(tmp_path, layout, asked):
    row, want = LAYOUT_CASES[layout]
    src, dst = _write(tmp_path / "in.jsonl", [row, ""]), tmp_path / "out.jsonl"
    assert convert_file(src, dst, layout if asked == "named" else "auto") == {layout: 1}
    assert _read(dst) == [want]
    (ex,) = JsonlTask(dst).rows
    assert ex.prompt == "What is 2+2?" and ex.answer in ("4", "2+2=4\n#### 4")


def test_conversational_prompt_completion_becomes_messages_with_the_completion_as_answer(tmp_path):
    src = _write(tmp_path / "in.jsonl", [{"prompt": [USER], "completion": [ASSISTANT]}])
    convert_file(src, tmp_path / "out.jsonl")
    assert _read(tmp_path / "out.jsonl") == [{"messages": [USER], "answer": "4"}]


BAD_ROWS = [
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"content": "hi"}]}, r"messages\[0\] has no 'role'"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, r"messages\[0\] \(user\) has content of type list"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "no user turn"),
    ({"question": "", "answer": "1"}, "'question' is empty"),
    ({"question": "q", "answer": {"x": 1}}, "'answer' must be a string or number"),
    ({"prompt": [USER], "completion": [USER]}, "a conversational 'completion' must be one assistant turn"),
    ({"prompt": [{"role": "user"}]}, r"prompt\[0\] \(user\) has no 'content'"),
    ({"text": "hi"}, "no known layout: expected one of the keys \\['messages', 'question', 'prompt'\\]"),
    ({"prompt": "q", "split": "test"}, "'split' must be one of"),
    ("[1, 2]", "expected a JSON object"),
    ("{oops", "invalid JSON"),
]


@pytest.mark.parametrize("row,words", BAD_ROWS)
def test_a_malformed_row_is_refused_naming_file_and_line_and_nothing_is_written(tmp_path, row, words):
    src = _write(tmp_path / "in.jsonl", [{"question": "q", "answer": "1"}, "", row])
    with pytest.raises(TaskError, match=r"in\.jsonl:3: .*" + words) as e:
        convert_file(src, tmp_path / "out.jsonl")
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == [src]


def test_a_row_not_of_the_named_layout_is_refused(tmp_path):
    src = _write(tmp_path / "in.jsonl", [{"prompt": "q"}])
    with pytest.raises(TaskError, match=r"in\.jsonl:1: layout 'question_answer' needs a 'question' field"):
        convert_file(src, tmp_path / "out.jsonl", "question_answer")


def test_the_cli_converts_reports_and_refuses_in_one_line(tmp_path, capsys):
    src = _write(tmp_path / "in.jsonl", [LAYOUT_CASES[k][0] for k in LAYOUT_CASES])
    dst = tmp_path / "out.jsonl"
    assert main(["data", "convert", str(src), str(dst)]) == 0
    assert "wrote 3 rows (1 messages, 1 prompt_completion, 1 question_answer)" in capsys.readouterr().out
    assert main(["data", "convert", str(src), str(dst)]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    _write(src, [{"messages": "hi"}])
    assert main(["data", "convert", str(src), str(dst), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"opdjax data: error: TaskError: {src}:1: 'messages' must be") and "\n" not in err
