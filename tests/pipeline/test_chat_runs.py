"""Chat data in a run: rendered prompts are bounded by the student's context as rendered, a teacher with another chat
template is refused unless allowed, and a `messages` file trains through `opdjax train`."""

import json

import pytest

from opdjax.cli.main import main
from opdjax.config import ConfigError, TrainConfig, load
from opdjax.data.tasks import JsonlTask, get_task
from opdjax.models.tiny import load_tokenizer, make_tiny, train_tokenizer
from opdjax.pipeline import inputs


def _conv(i: int, split: str) -> str:
    return json.dumps({"messages": [{"role": "system", "content": "Answer with the number."},
                                    {"role": "user", "content": f"What is {i}+{i}?"},
                                    {"role": "assistant", "content": f"#### {2 * i}"}], "split": split})


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_data") / "chat.jsonl"
    path.write_text("\n".join([_conv(i, "train") for i in range(8)] + [_conv(8, "heldout")]) + "\n")
    return path


@pytest.fixture(scope="module")
def tokenizers():
    return {family: train_tokenizer(["What is 1+1? #### 2"], chat=family) for family in ("qwen2.5", "qwen3")}


def test_a_prompt_is_bounded_by_the_context_as_its_template_renders_it(chat_file, tokenizers):
    """The tiny tokenizer has no merges: a text is one token a byte. "What is 0+0?" is 12 tokens; rendered by the
    Qwen2.5 template it is 5 special tokens (3 <|im_start|>, 2 <|im_end|>) and the 59 bytes of "system\n", the
    system turn, "\n", "user\n", the question, "\n" and "assistant\n": 64, which fits 68 positions with 4 new
    tokens and not 67 (every row is as long)."""
    tok = tokenizers["qwen2.5"]
    cfg = load(TrainConfig, None, ["rollout.max_new_tokens=4"])
    task = JsonlTask(chat_file)
    text = "system\n" + "Answer with the number." + "\n" + "user\n" + "What is 0+0?" + "\n" + "assistant\n"
    assert len(tok(task.rows[0].prompt, add_special_tokens=False).input_ids) == 12 and len(text.encode()) == 59
    with pytest.raises(ConfigError, match=rf"{chat_file}:1: a prompt of 64 tokens \+ rollout.max_new_tokens=4 "
                                          r"exceeds the student's 67 positions \(9 row\(s\) do\)"):
        inputs.check_lengths(cfg, task, tok, 67)
    inputs.check_lengths(cfg, task, tok, 68)


def test_a_teacher_with_another_chat_template_is_refused_naming_both_unless_allowed(chat_file, tokenizers, tmp_path):
    qwen25, qwen3 = tokenizers["qwen2.5"], tokenizers["qwen3"]
    for tok, name in ((qwen25, "s25"), (qwen3, "t3")):
        tok.save_pretrained(tmp_path / name)
    student, teacher = load_tokenizer(tmp_path / "s25"), load_tokenizer(tmp_path / "t3")
    task, cfg = JsonlTask(chat_file), load(TrainConfig, None, [])
    with pytest.raises(ConfigError, match=rf"student's chat template \({tmp_path / 's25'}\) and the teacher's "
                                          rf"\({tmp_path / 't3'}\) differ; .*teacher.allow_template_mismatch=true"):
        inputs.check_chat_templates(cfg, task, student, teacher)
    inputs.check_chat_templates(load(TrainConfig, None, ["teacher.allow_template_mismatch=true"]), task, student,
                                teacher)
    inputs.check_chat_templates(cfg, task, student, load_tokenizer(tmp_path / "s25"))  # the same template
    inputs.check_chat_templates(cfg, get_task("addition"), student, teacher)  # nothing rendered
    inputs.check_chat_templates(cfg, JsonlTask(chat_file, chat=True), train_tokenizer([]), teacher)  # no template
    with pytest.raises(ConfigError, match=r"differ \(the teacher has none\)"):
        inputs.check_chat_templates(cfg, task, student, train_tokenizer([]))


@pytest.mark.slow  # a 2-step run through `opdjax train` with a held-out evaluation (about 9 s, warm cache)
def test_a_messages_file_trains_through_opdjax_train(chat_file, tmp_path):
    student = make_tiny(tmp_path / "student", "qwen3", "tiny", seed=1, chat="qwen3")
    teacher = make_tiny(tmp_path / "teacher", "qwen3", "tiny", seed=2, tokenizer=load_tokenizer(student))
    out = tmp_path / "run"
    assert main(["train", f"student={student}", f"teacher={teacher}", "task.name=jsonl",
                 f"task.options={{path: {chat_file}, chat_template_kwargs: {{enable_thinking: false}}, "
                 f"grader: numeric}}", "rollout.batch_size=4", "rollout.max_new_tokens=4", "pipeline.steps=2",
                 "pipeline.eval_every=2", "pipeline.eval_prompts=2", "pipeline.progress=false",
                 "pipeline.tensorboard=false", f"pipeline.out_dir={out}"]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2]
    assert any("eval/accuracy" in x for x in lines)


def test_prompts_shortcut_keeps_the_jsonl_options_and_drops_the_built_in_tasks():
    cfg = load(TrainConfig, None, ["prompts=p.jsonl", "task.options={digits: 2, grader: numeric, chat: false, "
                                                      "chat_template_kwargs: {enable_thinking: false}}"])
    assert cfg.task.name == "jsonl" and cfg.task.options == {
        "path": "p.jsonl", "grader": "numeric", "chat": False, "chat_template_kwargs": {"enable_thinking": False}}
