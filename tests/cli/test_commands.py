"""Issue 29 audit: `opdjax convert`, `sensitivity` and `recipe-search` end to end through the CLI, with the real
probe (not a fake), on the tiny pair."""

import json

import numpy as np
import pytest

from opdjax.cli.main import main
from opdjax.models import hf

PAIR_ARGS = ["task.options={digits: 1}", "rollout.batch_size=8", "rollout.max_new_tokens=4",
             "pipeline.progress=false", "pipeline.tensorboard=false"]


def test_convert_resaves_bf16_shards_that_load_back_as_the_cast_weights(pair, tmp_path, capsys):
    dst = tmp_path / "bf16"
    assert main(["convert", pair[0], str(dst), "--dtype", "bfloat16", "--max-shard-mb", "0.05"]) == 0
    assert (dst / "model.safetensors.index.json").is_file() and len(list(dst.glob("*.safetensors"))) > 1
    _, src = hf.load_state(pair[0])
    _, back = hf.load_state(dst, param_dtype="bfloat16")
    cfg = hf.ModelConfig.from_dir(pair[0])
    a, b = hf.named_params(cfg, src), hf.named_params(cfg, back)
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]).astype("bfloat16").view(np.uint16),
                                      np.asarray(b[name]).view(np.uint16), err_msg=name)
    with pytest.raises(SystemExit) as info:  # a dtype convert does not write: argparse's one-line usage error
        main(["convert", pair[0], str(tmp_path / "x"), "--dtype", "float8"])
    assert info.value.code == 2 and "invalid choice: 'float8'" in capsys.readouterr().err


@pytest.mark.slow
def test_sensitivity_and_recipe_search_run_the_real_probe(pair, tmp_path, capsys):
    common = [f"student={pair[0]}", f"teacher={pair[1]}", *PAIR_ARGS]
    rep = tmp_path / "sens.json"
    assert main(["sensitivity", "--by", "group", "--no-kv", "--batches", "1", "--out", str(rep), *common]) == 0
    units = json.loads(rep.read_text())["units"]
    assert [u["unit"] for u in units] == ["qkv", "o", "gate_up", "down"]
    ms = [u["m"] for u in units]
    assert all(m >= 0 for m in ms) and len(set(ms)) == 4  # each unit measured on its own
    budget = tmp_path / "budget.json"
    budget.write_text(json.dumps({"metric": "k3", "budget": 1.0}))  # generous: the full FP8 recipe fits
    out = tmp_path / "search"
    assert main(["recipe-search", "--budget", str(budget), "--by", "layer", "--batches", "1", "--out", str(out),
                 *common]) == 0
    report = json.loads((out / "report.json").read_text())
    assert json.loads((out / "recipe.json").read_text())["name"] == "fp8_searched"
    assert report and (out / "vllm.json").is_file()

