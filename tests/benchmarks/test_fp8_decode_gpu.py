"""benchmarks/fp8_decode_gpu.py: the model table with no device, and the dry run (CPU, tiny shape) end to end, so
the script that a lent GPU runs does not rot between the sessions that have one."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from opdjax import quant
from opdjax.models.presets import model_config
from opdjax.quant import decode_cost

from .conftest import load_benchmark

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_model_rows_are_the_decode_cost_model_at_the_batch_that_fits():
    bench = load_benchmark("fp8_decode_gpu")
    cfg, mem = model_config("qwen3-1.7b"), 40 << 30
    rows = bench.model_rows(cfg, mem, 2048, 3.35e12)
    assert [r["config"] for r in rows] == ["bf16", "fp8 @ bf16 B", "fp8"]
    assert [r["batch"] for r in rows] == [168, 168, 348]
    fp8 = quant.get_recipe("fp8_w8a8_kv")
    assert rows[2]["model"] == decode_cost.decode_model(cfg, mem, 2048, 3.35e12, fp8)
    assert all(r["model"]["kind"] == "model" and r["model_as_timed"] == r["model"] for r in rows)
    sdpa = bench.model_rows(cfg, mem, 2048, 3.35e12, attn="sdpa")
    assert sdpa[0]["model_as_timed"]["bytes"] == sdpa[0]["model"]["bytes"]  # BF16: nothing to dequantize
    assert sdpa[2]["model_as_timed"]["bytes"] > sdpa[2]["model"]["bytes"]  # + the BF16 copy
    with pytest.raises(ValueError, match="raise --memory-gib"):
        bench.model_rows(cfg, 2 << 30, 2048, 3.35e12)


def test_model_only_prints_the_labelled_table(capsys):
    assert load_benchmark("fp8_decode_gpu").main(["--model-only", "--shapes", "qwen3-1.7b,qwen3-8b"]) == 0
    out = capsys.readouterr().out
    assert "model: bytes moved / 3.35 TB/s (h100-sxm)" in out
    assert "| qwen3-8b | batch |" in out and "| fp8 | 221 | 452,608 |" in out and "| — |" in out


@pytest.mark.slow  # a subprocess that imports torch and JAX
def test_dry_run_times_every_config_on_cpu_and_checks_the_fp8_paths(tmp_path):
    out = tmp_path / "dry.json"
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_decode_gpu.py"), "--dry-run", "--out",
                           str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "plumbing, not speed" in proc.stdout and "FP8 GEMM:" in proc.stdout
    res = json.loads(out.read_text())
    assert res["check"]["ok"] and res["check"]["fp8_vs_bf16"] > 0  # FP8 changes the logits, a little
    assert res["check_attention"] is None or res["check_attention"]["ok"]
    rows = res["shapes"]["tiny"]
    assert rows[2]["batch"] > rows[0]["batch"] == rows[1]["batch"] > 0
    for r in rows:
        assert r["measured"]["kind"] == "measured" and r["measured"]["step_s"] > 0
        assert r["model"]["kind"] == "model"
    assert rows[1]["measured"]["gemm"] in ("rowwise", "tensorwise", "emulated")
