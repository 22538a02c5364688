"""Chat prompts: a JSONL conversation becomes exactly the ids transformers' `apply_chat_template` gives for the
family's template (Qwen2.5, Qwen3 with thinking off, Llama-3), plain prompts follow `chat: auto|true|false`, and a
malformed conversation is refused naming file:line."""

import json

import pytest

from opdjax.data.chat import ChatError, ChatPrompt
from opdjax.data.prompts import encode_prompts
from opdjax.data.tasks import Example, JsonlTask, TaskError
from opdjax.models.tiny import CHAT_FORMATS, load_tokenizer, train_tokenizer

SYSTEM, USER, ANSWER = "Be brief.", "What is 12+34?", "46"
# family -> the text its format gives for [user] + generation prompt, written out by hand from the family's format
EXPECTED = {
    "qwen2.5": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
               f"<|im_start|>user\n{USER}<|im_end|>\n<|im_start|>assistant\n",
    "qwen3": f"<|im_start|>user\n{USER}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "llama3": f"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{USER}<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
}
KWARGS = {"qwen2.5": {}, "qwen3": {"enable_thinking": False}, "llama3": {}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> a tiny tokenizer with the family's chat template, saved and loaded back from disk."""
    root = tmp_path_factory.mktemp("chat_tok")
    out = {}
    for family in CHAT_FORMATS:
        train_tokenizer(["What is 12+34? 46"], chat=family).save_pretrained(root / family)
        out[family] = load_tokenizer(root / family)
    return out


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("family", list(CHAT_FORMATS))
def test_a_messages_row_encodes_to_the_ids_of_transformers_apply_chat_template(saved, tmp_path, family):
    tok = saved[family]
    convs = [[{"role": "user", "content": USER}],
             [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
             [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
              {"role": "user", "content": USER}]]
    path = _write(tmp_path / "c.jsonl", [{"messages": c + [{"role": "assistant", "content": ANSWER}]} for c in convs])
    task = JsonlTask(path, chat_template_kwargs=KWARGS[family])
    got = encode_prompts(tok, task.rows)
    for ids, conv in zip(got, convs):
        want = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True,
                                       **KWARGS[family])["input_ids"]
        assert ids == list(want)
    # The format itself, against text written out by hand, tokenized without added special tokens.
    assert got[0] == tok(EXPECTED[family], add_special_tokens=False).input_ids
    assert [ex.answer for ex in task.rows] == [ANSWER] * 3 and task.rows[0].prompt == USER


@pytest.mark.parametrize("family", list(CHAT_FORMATS))
def test_the_template_special_tokens_are_added_tokens_and_bos_is_never_doubled(saved, family):
    tok, fmt = saved[family], CHAT_FORMATS[family]
    assert set(fmt.special) <= set(tok.get_added_vocab())
    assert tok.eos_token == fmt.eos and tok.chat_template == fmt.template
    ex = Example(prompt=USER, answer=None, chat=ChatPrompt((("user", USER),), KWARGS[family]))
    (ids,) = encode_prompts(tok, [ex])
    bos = tok.bos_token_id
    assert ids.count(bos) == (0 if bos is None else 1) and (bos is None or ids[0] == bos)


def test_qwen3_thinking_switch_reaches_the_template(saved, tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"prompt": USER}])
    on = encode_prompts(saved["qwen3"], JsonlTask(path).rows)[0]
    off = encode_prompts(saved["qwen3"], JsonlTask(path, chat_template_kwargs={"enable_thinking": False}).rows)[0]
    think = saved["qwen3"]("<think>\n\n</think>\n\n", add_special_tokens=False).input_ids
    assert off == on + think


def test_plain_prompts_follow_the_chat_option(saved, tmp_path):
    """auto: a user turn when the tokenizer has a template, the raw text when it has none; true: a tokenizer without
    a template is an error; false: always the raw text, and a conversation is refused."""
    plain_tok = train_tokenizer(["What is 12+34? 46"])
    path = _write(tmp_path / "p.jsonl", [{"prompt": USER, "answer": ANSWER}])
    raw = plain_tok(USER, add_special_tokens=False).input_ids
    qwen = saved["qwen2.5"]
    rendered = qwen(EXPECTED["qwen2.5"], add_special_tokens=False).input_ids
    assert encode_prompts(qwen, JsonlTask(path).rows) == [rendered]
    assert encode_prompts(plain_tok, JsonlTask(path).rows) == [raw]
    assert encode_prompts(qwen, JsonlTask(path, chat=False).rows) == [qwen(USER, add_special_tokens=False).input_ids]
    with pytest.raises(ChatError, match="has no chat template"):
        encode_prompts(plain_tok, JsonlTask(path, chat=True).rows)
    conv = _write(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": USER}]}])
    with pytest.raises(TaskError, match=r"m\.jsonl:1: .*chat=false"):
        JsonlTask(conv, chat=False)
    with pytest.raises(ChatError, match="has no chat template"):
        encode_prompts(plain_tok, JsonlTask(conv).rows)
    with pytest.raises(TaskError, match="'chat' must be auto, true or false"):
        JsonlTask(path, chat="yes")


def test_the_answer_field_is_the_reference_over_a_final_assistant_turn_and_keys_name_prompts(tmp_path):
    sys_user = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    path = _write(tmp_path / "c.jsonl", [
        {"messages": sys_user + [{"role": "assistant", "content": "it is 46"}], "answer": 46},
        {"messages": sys_user},
        {"messages": [{"role": "user", "content": USER}], "split": "train"}])
    a, b, c = JsonlTask(path).rows
    assert (a.answer, b.answer) == ("46", None)
    assert a.key == b.key != c.key == USER  # a system turn makes another prompt; one user turn is its text
    assert a.chat.turns == (("system", SYSTEM), ("user", USER)) and c.meta["split"] == "train"


BAD_MESSAGES = [
    ([], "'messages' must be a non-empty list"),
    ("hi", "'messages' must be a non-empty list of {role, content} turns, got str"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"content": "x"}], r"messages\[0\] has no 'role'"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\] has role 'robot'"),
    ([{"role": "user", "content": 3}], r"messages\[0\] \(user\) has content of type int"),
    ([{"role": "user"}], r"messages\[0\] \(user\) has no 'content'"),
    ([{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}], "no user turn"),
    ([{"role": "user", "content": "  "}], r"last user turn \(messages\[0\]\) is empty"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
     "2 turns after the last user turn"),
]


@pytest.mark.parametrize("messages,words", BAD_MESSAGES)
def test_a_malformed_conversation_is_refused_naming_file_and_line(tmp_path, messages, words):
    path = _write(tmp_path / "c.jsonl", [{"prompt": "fine"}, {"messages": messages}])
    with pytest.raises(TaskError, match=r"c\.jsonl:2: .*" + words) as e:
        JsonlTask(path)
    assert "\n" not in str(e.value)


def test_a_row_with_both_messages_and_prompt_and_an_unknown_grader_are_refused(tmp_path):
    path = _write(tmp_path / "c.jsonl", [{"prompt": "a", "messages": [{"role": "user", "content": "a"}]}])
    with pytest.raises(TaskError, match=r"c\.jsonl:1: both 'messages' and 'prompt'"):
        JsonlTask(path)
    with pytest.raises(TaskError, match="unknown grader 'fuzzy'; registered graders: exact, marker, numeric"):
        JsonlTask(_write(tmp_path / "p.jsonl", [{"prompt": "a"}]), grader="fuzzy")
