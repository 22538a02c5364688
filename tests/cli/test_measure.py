"""`opdjax measure` takes the same config and overrides as train/admit, and reports bad input in one line."""

from opdjax.cli.main import build_parser, main
from opdjax.cli.measure import format_table


def test_measure_parses_train_overrides(capsys):
    args = build_parser().parse_args(["measure", "--batches", "2", "rollout.engine=vllm",
                                      "rollout.vllm={kv_cache_dtype: fp8}"])
    assert args.batches == 2 and args.overrides == ["rollout.engine=vllm", "rollout.vllm={kv_cache_dtype: fp8}"]
    assert main(["measure", "rollout.temprature=0.5"]) == 2
    err = capsys.readouterr().err
    assert "ConfigError" in err and "did you mean 'rollout.temperature'" in err and "Traceback" not in err


def test_format_table_has_one_row_per_engine():
    t = format_table([("jax", {"k1": 0.1, "k3": 0.2, "num_tokens": 48}), ("vllm fp8", {"k3": 0.3, "num_tokens": 40})])
    lines = t.splitlines()
    assert len(lines) == 4 and "k3" in lines[0] and lines[2].startswith("jax") and lines[2].rstrip().endswith("48")
