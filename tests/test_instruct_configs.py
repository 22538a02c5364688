"""The worked instruct configurations (`configs/instruct/*.yaml`): each loads and validates, the commands its header
gives parse as written (the servers' through `opdjax serve --print-command`), and the run it describes trains a few
steps on tiny random models of the same family with the real quirks (padded vocab_size, a list of stop ids in
generation_config.json, the family's chat template) — through the JAX engine and through vLLM."""

import json
import pathlib
import shlex

import pytest

from opdjax.cli.main import main
from opdjax.config import TrainConfig, load
from opdjax.models import hf
from opdjax.models.tiny import make_instruct_pair
from opdjax.pipeline import loop as pipeline

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = {"qwen2.5": "qwen2.5.yaml", "qwen3": "qwen3.yaml", "llama3": "llama3.yaml"}


def _commands(path: pathlib.Path) -> list[list[str]]:
    """The `opdjax ...` commands the config's header comments give, split as a shell would (paths in the repository
    made absolute: tests run elsewhere)."""
    return [[str(ROOT / a) if a.startswith("configs/") else a for a in shlex.split(line.lstrip("#").strip())]
            for line in path.read_text().splitlines() if line.startswith("#   opdjax ")]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("instruct")
    return {chat: make_instruct_pair(root / chat, chat, corpus=["What is 12+34? #### 46"]) for chat in CONFIGS}


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "train.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"What is {i}+{i}?"},
                          {"role": "assistant", "content": f"#### {2 * i}"}], "split": "heldout" if i > 9 else "train"}
            for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_tiny_pairs_carry_the_families_quirks(pairs):
    for chat, (student, teacher) in pairs.items():
        s, t = hf.load_config(student), hf.load_config(teacher)
        assert s.usable_vocab == t.usable_vocab < s.vocab_size < t.vocab_size, chat  # padded, differently
        assert s.vocab_size % 128 == 0 and t.vocab_size % 256 == 0
        assert len(s.eos_token_ids) == 2 and s.eos_token_ids == t.eos_token_ids
        assert "chat_template" in (json.loads((student / "tokenizer_config.json").read_text())
                                   | {"chat_template": None}) or (student / "chat_template.jinja").is_file()


@pytest.mark.parametrize("chat", sorted(CONFIGS))
def test_each_config_and_the_commands_it_gives_are_valid(chat, pairs, capsys):
    path = ROOT / "configs" / "instruct" / CONFIGS[chat]
    cfg = load(TrainConfig, path)
    assert cfg.rollout.endpoints and cfg.teacher.endpoints and cfg.task.name == "jsonl"
    commands = _commands(path)
    assert [c[1] for c in commands] == ["serve", "serve", "train"]
    models = [f"student={pairs[chat][0]}", f"teacher={pairs[chat][1]}"]
    for cmd in commands[:2]:  # the servers: exactly as written, but print the vLLM command instead of starting it
        assert main([cmd[1], "--print-command", *cmd[2:], *models]) == 0, cmd
        assert "vllm.entrypoints" in capsys.readouterr().out
    train = [a for a in commands[2][2:] if "=" in a and not a.startswith("--")]
    load(TrainConfig, path, [*train, *models])


def _tiny_run(path, pair, chat_file, out, *extra):
    """The config's run on a tiny pair: its own settings but sizes, lengths and steps, in-process engines."""
    return load(TrainConfig, path, [
        f"student={pair[0]}", f"teacher={pair[1]}", f"task.options.path={chat_file}", "rollout.endpoints=[]",
        "teacher.endpoints=[]", "sync.token_file=", "teacher.dtype=float32", "rollout.batch_size=4",
        "rollout.max_new_tokens=6", "pipeline.steps=2", "pipeline.eval_every=0", "pipeline.eval_prompts=2",
        "pipeline.checkpoint_every=0", "pipeline.progress=false", "pipeline.tensorboard=false",
        f"pipeline.out_dir={out}", *extra])


def _trained(out) -> list[dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "loss" in x]


@pytest.mark.slow  # three 2-step runs (a few seconds each, warm cache)
def test_each_config_trains_a_few_steps_through_the_jax_engine(pairs, chat_file, tmp_path):
    for chat, name in CONFIGS.items():
        cfg = _tiny_run(ROOT / "configs" / "instruct" / name, pairs[chat], chat_file, tmp_path / chat)
        assert pipeline.train(cfg, log=lambda s: None)["steps"] == 2
        steps = _trained(tmp_path / chat)
        assert [x["step"] for x in steps] == [1, 2] and all(x["staleness"] <= 1 for x in steps), chat


@pytest.mark.slow  # three 2-step runs, each starting a vLLM engine
@pytest.mark.vllm
def test_each_config_trains_a_few_steps_through_vllm(vllm_module, pairs, chat_file, tmp_path):
    for chat, name in CONFIGS.items():
        cfg = _tiny_run(ROOT / "configs" / "instruct" / name, pairs[chat], chat_file, tmp_path / chat,
                        "rollout.engine=vllm", "rollout.dtype=float32",
                        "rollout.vllm={kv_cache_memory_bytes: 33554432, max_num_seqs: 16}")
        assert pipeline.train(cfg, log=lambda s: None)["steps"] == 2
        steps = _trained(tmp_path / chat)
        assert [x["step"] for x in steps] == [1, 2], chat
        assert all(x["mismatch/abs_log_ratio_max"] < 1e-2 for x in steps if x["staleness"] == 0), chat
