"""Config help lives on the fields: `opdjax keys`, docs/guide/config-keys.md and the validation messages all read it,
and the choices a key lists are the registries validation checks against."""

import dataclasses
import pathlib

import pytest

from opdjax import config
from opdjax.cli.keys import format_markdown, select, yaml_value
from opdjax.cli.main import main
from opdjax.core import corrections, losses
from opdjax.data import tasks
from opdjax.quant import RECIPES
from opdjax.rollout.perturb import NOISE_MODES

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "guide" / "config-keys.md"
ROWS = config.describe(config.TrainConfig)


def test_the_committed_key_page_is_what_opdjax_keys_markdown_writes():
    assert PAGE.read_text() == format_markdown(ROWS), (
        "docs/guide/config-keys.md differs from the config's field help; regenerate it with "
        "`opdjax keys --markdown > docs/guide/config-keys.md`")


def _leaf_count(obj) -> int:
    """The keys of config object `obj`, nested sections (pipeline.wandb) counted by their keys."""
    return sum(_leaf_count(v) if dataclasses.is_dataclass(v) else 1 for v in vars(obj).values())


def test_every_key_of_every_section_has_help_and_its_default():
    leaves = [r for r in ROWS if r.type != "section"]
    assert len(leaves) == _leaf_count(config.TrainConfig())
    assert all(r.help and "\n" not in r.help for r in ROWS), [r.key for r in ROWS if not r.help or "\n" in r.help]
    d = config.to_dict(config.TrainConfig())
    for r in leaves:
        expected = d
        for part in r.key.split("."):
            expected = expected[part]
        assert (list(r.default) if isinstance(r.default, tuple) else r.default) == expected, r.key


def test_the_choices_a_key_lists_are_the_registries_validation_uses():
    by_key = {r.key: r for r in ROWS}
    assert by_key["loss.name"].choices == tuple(sorted(losses.LOSSES))
    assert by_key["loss.correction"].choices == tuple(sorted(corrections.CORRECTIONS))
    assert by_key["task.name"].choices == tuple(sorted(tasks.TASKS))
    assert by_key["prepare.student_task"].choices == tuple(sorted(set(tasks.TASKS) - {"jsonl"}))
    assert by_key["rollout.recipe"].choices == tuple(sorted(RECIPES))
    assert by_key["rollout.noise_mode"].choices == tuple(sorted(NOISE_MODES))
    for r in ROWS:  # a listed choice is accepted; a value outside them is refused naming the key's help
        if r.choices and r.type != "section":
            with pytest.raises(config.ConfigError, match="is not valid; choose one of") as e:
                config.load(config.TrainConfig, None, [f"{r.key}=not_a_choice"])
            assert r.help in str(e.value), r.key


def test_validation_messages_quote_the_keys_help():
    help_of = {r.key: r.help for r in ROWS}
    cases = {"rollout.noise_mode=sometimes": "rollout.noise_mode", "rollout.max_new_tokens=0": "rollout.max_new_tokens",
             "rollout.batch_size=many": "rollout.batch_size", "optim.lr=-1": "optim.lr", "seed=x": "seed"}
    for override, key in cases.items():
        with pytest.raises(config.ConfigError) as e:
            config.load(config.TrainConfig, None, [override])
        assert str(e.value).endswith(f"({help_of[key]})"), str(e.value)


def test_opdjax_keys_prints_a_section_with_defaults_types_choices_and_help(capsys):
    assert main(["keys", "rollout"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rollout: ") and "optim." not in out
    assert "rollout.noise_mode=fixed  (str; fixed | per_version | rounding)" in out
    assert "rollout.max_new_tokens=6  (int)" in out
    assert main(["keys", "mesh.shape"]) == 0
    assert "mesh.shape=[1, -1, 1]  (tuple)" in capsys.readouterr().out


def test_opdjax_keys_names_the_closest_key_for_a_misspelt_section(capsys):
    assert main(["keys", "rolout"]) == 2
    err = capsys.readouterr().err
    assert "no config key or section 'rolout' (did you mean 'rollout'?)" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["train", "serve", "measure", "study", "admit", "sensitivity"])
def test_every_command_with_overrides_says_where_the_keys_are_listed(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "opdjax keys" in " ".join(capsys.readouterr().out.split())


def test_defaults_are_written_as_a_key_value_override_takes_them():
    assert [yaml_value(v) for v in (None, "", 3e-4, True, (1, -1, 1), {"digits": 2}, "none")] == \
        ["null", "''", "0.0003", "true", "[1, -1, 1]", "{digits: 2}", "none"]
    for r in select(ROWS, ["rollout", "optim", "pipeline"]):  # each printed default parses back to itself
        if r.type != "section":
            assert getattr(config.load(config.TrainConfig, None, [f"{r.key}={yaml_value(r.default)}"]),
                           r.key.split(".")[0]) == getattr(config.TrainConfig(), r.key.split(".")[0]), r.key
