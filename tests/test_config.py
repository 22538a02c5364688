"""Config loading: defaults, YAML, overrides, and clear errors for bad keys and values."""

import pathlib

import pytest

from opdjax.cli.main import main
from opdjax.config import ConfigError, TrainConfig, check_expanded_size, dump_yaml, load, to_dict
from opdjax.pipeline.rundir import config_changes


def test_shipped_yaml_equals_embedded_defaults():
    path = pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"
    assert load(TrainConfig, path) == load(TrainConfig)
    assert dump_yaml(load(TrainConfig)) == path.read_text()


def test_overrides_and_shortcuts(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  temperature: 0.7\npipeline:\n  steps: 3\n")
    cfg = load(TrainConfig, p, ["pipeline.steps=5", "student=/some/dir", "teacher.engine=jax", "optim.lr=1e-3",
                               "mesh.shape=[2,2,2]", "loss.options={tail: false}", "prompts=/x.jsonl"])
    assert cfg.rollout.temperature == 0.7 and cfg.pipeline.steps == 5
    assert cfg.student.path == "/some/dir" and cfg.teacher.path == "builtin"
    assert cfg.optim.lr == 1e-3 and cfg.mesh.shape == (2, 2, 2) and cfg.loss.options == {"tail": False}
    assert cfg.task.name == "jsonl" and cfg.task.options["path"] == "/x.jsonl"


@pytest.mark.parametrize("override, message", [
    ("rollout.temprature=1", r"unknown key 'rollout.temprature' \(did you mean 'rollout.temperature'\?\)"),
    ("bogus=1", "unknown key 'bogus'; valid keys at top level: prompts, seed, student"),
    ("rollout.engine=sglang", r"rollout.engine='sglang' is not valid; choose one of \['jax', 'vllm'\]"),
    ("rollout.batch_size=many", "rollout.batch_size='many' has the wrong type: expected int"),
    ("loss.name=kl", "loss.name='kl' is not valid; choose one of"),
    ("loss.correction=tis", "loss.correction='tis' is not valid; choose one of"),
    ("rollout.recipe=fp4", "rollout.recipe='fp4' is not valid"),
    ("optim.lr=-1", "optim.lr must be > 0"),
    ("rollout.top_p=0", r"rollout.top_p must be in \(0, 1\]"),
    ("rollout.noise_mode=sometimes", r"rollout.noise_mode=.sometimes. is not valid; choose one of \[.fixed., .per_version., .rounding.\]"),
    ("rollout.decode_attention=flash", r"rollout.decode_attention='flash' is not valid; choose one of \['einsum', 'pallas'\]"),
    ("pipeline.mode=sometimes", "pipeline.mode='sometimes' is not valid"),
    ("sync.transport=udp", r"sync.transport='udp' is not valid; choose one of \['auto', 'inproc', 'shm', 'tcp'\]"),
    ("steps", "must look like key=value"),
])
def test_bad_config_is_a_clear_error(override, message):
    with pytest.raises(ConfigError, match=message):
        load(TrainConfig, None, [override])


def test_cli_reports_config_errors_with_exit_code_2(capsys):
    assert main(["train", "rollout.temprature=1"]) == 2
    assert "did you mean 'rollout.temperature'" in capsys.readouterr().err


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load(TrainConfig, tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load(TrainConfig, tmp_path / "list.yaml")


def test_cli_reports_model_and_checkpoint_errors_without_a_traceback(capsys, tmp_path, pair):
    """A student directory that does not exist, a directory without config.json and an unsupported model_type:
    one line naming the problem, exit 2 (the model-config and checkpoint errors are user errors too). Run from a
    directory whose default out_dir holds a previous run: the bad model is named, not the run-directory conflict."""
    assert pathlib.Path("runs/demo/summary.json").is_file()  # the conftest's used checkout
    import json
    import shutil

    from opdjax import models
    from opdjax.config import ConfigError as TrainConfigError

    assert models.ConfigError is TrainConfigError  # one ConfigError class
    student, teacher = pair
    assert main(["train", f"student={tmp_path / 'nope'}", f"teacher={teacher}"]) == 2
    err = capsys.readouterr().err
    assert "ConfigError: student=" in err and "no such directory" in err and "Traceback" not in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", f"student={student}", f"teacher={empty}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("opdjax train: ") and "config.json" in err[0], err
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(student, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    assert main(["train", f"student={gpt2}", f"teacher={teacher}"]) == 2
    err = capsys.readouterr().err
    assert "ConfigError:" in err and "gpt2/config.json: unsupported model_type 'gpt2'" in err


def test_a_path_shortcut_survives_later_keys_of_its_section():
    cfg = load(TrainConfig, None, ["teacher=/models/t", "teacher.dtype=bfloat16", "student=/models/s",
                                   "student.remat=block"])
    assert (cfg.teacher.path, cfg.teacher.dtype) == ("/models/t", "bfloat16")
    assert (cfg.student.path, cfg.student.remat) == ("/models/s", "block")


def test_keys_of_a_section_survive_a_later_path_shortcut():
    cfg = load(TrainConfig, None, ["teacher.engine=vllm", "teacher=/models/t", "student.remat=block",
                                   "student=/models/s"])
    assert (cfg.teacher.path, cfg.teacher.engine) == ("/models/t", "vllm")
    assert (cfg.student.path, cfg.student.remat) == ("/models/s", "block")


def test_every_opdjax_error_is_one_line_and_debug_shows_the_traceback(capsys, tmp_path, pair):
    from opdjax.core.errors import InputError, OpdjaxError, UnavailableError
    from opdjax.remote.client import ServersUnavailable

    assert issubclass(InputError, OpdjaxError) and issubclass(ServersUnavailable, UnavailableError)
    assert issubclass(UnavailableError, OpdjaxError)
    argv = ["train", f"student={tmp_path / 'nope'}", f"teacher={pair[1]}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("opdjax train: error: ConfigError: "), err
    with pytest.raises(ConfigError, match="no such directory"):
        main(["--debug", *argv])


@pytest.mark.parametrize("override", ["optim.lr=.nan", "optim.lr=.inf", "rollout.temperature=.nan", "optim.lr=-.inf"])
def test_non_finite_numbers_are_refused(override):
    with pytest.raises(ConfigError, match="must be a finite number"):
        load(TrainConfig, None, [override])


def test_mesh_shapes_and_lengths_are_checked_before_any_model_is_built(capsys, tmp_path, pair):
    """A mesh this machine cannot hold, a zero axis, a completion longer than the model, bad task options: one line,
    exit 2, before the models load (issue 16 rows 7-8)."""
    with pytest.raises(ConfigError, match="positive device counts"):
        load(TrainConfig, None, ["mesh.shape=[0,1,1]"])
    base = [f"student={pair[0]}", f"teacher={pair[1]}", f"pipeline.out_dir={tmp_path}"]
    for extra, words in ((["mesh.shape=[16,1,1]"], "needs 16 devices"),
                         (["rollout.max_new_tokens=100000"], "leaves no room for a prompt"),
                         (["task.options={digits: 1, bogus: 2}"], "task 'addition'")):
        assert main(["train", *base, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err


def test_a_prompt_longer_than_the_model_is_refused_with_its_line(capsys, tmp_path, pair):
    """Issue 16 row 7: a 1 MB prompt is refused up front (file:line), not an out-of-memory trace minutes later."""
    import json

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "1+2=", "split": "train"}) + "\n" +
                 json.dumps({"prompt": "7" * (1 << 20), "split": "heldout"}) + "\n")
    argv = ["train", f"student={pair[0]}", f"teacher={pair[1]}", f"prompts={f}", f"pipeline.out_dir={tmp_path}/r"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{f}:2: a prompt of" in err[0], err


BOMB = "rollout:\n  vllm:\n" + "".join(
    f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9) if i else 'lol'}]\n" for i in range(12))


@pytest.mark.parametrize("argv", [["train", "--print-config"], ["train"]])
def test_a_yaml_alias_bomb_under_an_untyped_section_is_refused_in_one_line(capsys, tmp_path, argv):
    """Issue 29 row 6: 9^11 values once expanded, a few hundred bytes as written: refused at once, not expanded."""
    p = tmp_path / "bomb.yaml"
    p.write_text(BOMB)
    assert main([*argv[:1], "--config", str(p), *argv[1:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "alias" in err[0] and str(p) in err[0], err
    with pytest.raises(ConfigError, match="alias bomb"):
        load(TrainConfig, None, ["rollout.vllm={a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], "
                                 + ", ".join(f"b{i}: &b{i} [{', '.join([f'*b{i - 1}' if i else '*a'] * 10)}]"
                                             for i in range(6)) + "}"])


def test_a_long_list_as_written_is_not_called_an_alias_bomb():
    """Issue 38 row 7: a 10^6-seed study was refused as "an alias bomb?". Only an expansion through aliases (one
    object reached twice) is one; a long list as written costs what it cost to read and is left to the typed checks
    (a study's seed bound)."""
    check_expanded_size({"seeds": list(range(200_000))}, "x")
    shared = [1] * 10
    for _ in range(6):
        shared = [shared] * 10
    with pytest.raises(ConfigError, match="alias bomb"):
        check_expanded_size({"a": shared}, "x")


def test_bad_config_files_get_one_line_errors(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("rollout:\n  recipe: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load(TrainConfig, bad)
    with pytest.raises(ConfigError, match="is a directory; expected a YAML file"):
        load(TrainConfig, tmp_path)


def test_a_temperature_that_overflows_the_logits_is_refused():
    """Issue 29 row 3: 1e-30 sampled pad tokens with -inf log-probs and a zero gradient; 0 is greedy."""
    from opdjax.rollout import SamplingParams

    with pytest.raises(ConfigError, match="rollout.temperature=1e-30 is below 1e-05.*use 0 for greedy"):
        load(TrainConfig, None, ["rollout.temperature=1e-30"])
    with pytest.raises(ConfigError, match="teacher.temperature=1e-30"):
        load(TrainConfig, None, ["teacher.temperature=1e-30"])
    with pytest.raises(ValueError, match="use 0 for greedy"):
        SamplingParams(temperature=1e-30)  # the engines, used directly, take the same SamplingParams
    assert SamplingParams(temperature=0).temperature == 0 and load(TrainConfig, None, ["rollout.temperature=0"])


def test_a_completion_longer_than_the_builtin_student_is_refused_before_the_pair_is_prepared(tmp_path, capsys):
    """Issue 29: rollout.max_new_tokens=100000 with no cached built-in pair trained the teacher for 2.5 minutes
    before refusing; now the length is checked against the pair's configured size first."""
    import time

    t0 = time.perf_counter()
    argv = ["train", "rollout.max_new_tokens=100000", f"prepare.cache_dir={tmp_path / 'cache'}",
            f"pipeline.out_dir={tmp_path / 'run'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rollout.max_new_tokens=100000 leaves no room for a prompt" in err[0], err
    assert time.perf_counter() - t0 < 30 and not (tmp_path / "cache").exists()


def test_pipeline_wandb_is_a_section_with_a_mode_shortcut():
    assert load(TrainConfig, None, ["pipeline.wandb=offline"]).pipeline.wandb.mode == "offline"
    cfg = load(TrainConfig, {"pipeline": {"wandb": {"project": "p"}}}, ["pipeline.wandb=online"])
    assert (cfg.pipeline.wandb.mode, cfg.pipeline.wandb.project) == ("online", "p")  # the shortcut keeps the rest
    with pytest.raises(ConfigError, match="YAML reads yes/no/on/off as a boolean"):
        load(TrainConfig, None, ["pipeline.wandb.mode=off"])
    with pytest.raises(ConfigError, match="each tag is a non-empty string"):
        load(TrainConfig, None, ["pipeline.wandb.tags=[fp8, 3]"])


def test_a_resume_may_turn_wandb_on_or_change_its_settings():
    old = to_dict(TrainConfig())
    del old["pipeline"]["wandb"]  # a run started before pipeline.wandb existed
    new = to_dict(load(TrainConfig, None, ["pipeline.wandb=online", "pipeline.wandb.tags=[fp8]"]))
    assert config_changes(old, new) == []
