"""Graders on closed-form cases: exact, marker (the text after "####" / "The answer is") and numeric (GSM8K: the
completion's last number against the reference's number after "####", commas removed, 1e-6 tolerance)."""

import json

import pytest

from opdjax.data.graders import GRADERS, final_answer, get_grader, last_number, register_grader
from opdjax.data.tasks import JsonlTask, TaskError

GSM8K_REF = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 1,072"


@pytest.mark.parametrize("name,reference,completion,score", [
    ("exact", "46", " 46\n", 1.0),
    ("exact", "46", "46.", 0.0),
    ("marker", GSM8K_REF, "so in all... #### 1,072", 1.0),
    ("marker", "#### 72", "The answer is 72.", 1.0),
    ("marker", "Paris", "I think THE ANSWER IS: Paris.\nDone", 1.0),
    ("marker", "#### 72", "#### 27", 0.0),
    ("marker", "#### 72", "The answer is 72 #### 73", 0.0),  # the last marker decides
    ("numeric", GSM8K_REF, "48 + 24 + 1000 = 1072", 1.0),
    ("numeric", GSM8K_REF, "1,072 clips, from 48 in April", 0.0),  # the last number is 48
    ("numeric", "#### 0.5", "half: 0.5000001", 1.0),  # within 1e-6
    ("numeric", "#### 0.5", "half: 0.500002", 0.0),  # 2e-6 away
    ("numeric", "#### -3", "it drops by -3", 1.0),
    ("numeric", "#### 12", "no digits here", 0.0),
    ("numeric", "12", "twelve, i.e. 12", 1.0),  # a reference without a marker: its own last number
])
def test_graders_on_closed_form_cases(name, reference, completion, score):
    assert get_grader(name).grade(reference, completion) == score


def test_final_answer_and_last_number_closed_forms():
    assert final_answer(GSM8K_REF) == "1,072" and final_answer(" plain. ") == "plain"
    assert last_number(GSM8K_REF) == 1072.0 and last_number("1,234.5 then -7") == -7.0 and last_number("x") is None


def test_a_reference_the_grader_cannot_use_is_refused_at_load_naming_the_line(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps({"prompt": "a", "answer": "#### 4"}) + "\n" + json.dumps({"prompt": "b", "answer":
                                                                                          "#### four"}) + "\n")
    with pytest.raises(TaskError, match=r"g\.jsonl:2: the numeric grader needs a number"):
        JsonlTask(path, grader="numeric")
    task = JsonlTask(path, grader="marker")
    assert [task.grade(ex, "#### four") for ex in task.rows] == [0.0, 1.0]


def test_unknown_grader_lists_the_registered_ones_and_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="unknown grader 'nope'; registered graders: exact, marker, numeric"):
        get_grader("nope")
    with pytest.raises(ValueError, match="grader 'exact' is already registered"):
        register_grader("exact")(lambda reference, completion: 1.0)
    assert set(GRADERS) >= {"exact", "marker", "numeric"}
