"""benchmarks/vllm_kv_capacity.py: vLLM's own KV allocator gives an FP8 KV cache twice the tokens of a BF16 one at
equal kv_cache_memory_bytes, as `opdjax capacity`'s arithmetic says (to one block of rounding)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from opdjax.rollout.vllm_settings import fp8_kv_cache_unsupported_reason

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_vllm_fp8_kv_allocation_matches_the_capacity_arithmetic(vllm_module, tmp_path):
    reason = fp8_kv_cache_unsupported_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "cap.json"
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_kv_capacity.py"), "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["model"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"tiny", "qwen3-1.7b-kv"}
    for r in rows.values():
        assert r["vllm_bf16"]["cache_dtype"] == "auto" and r["vllm_fp8"]["cache_dtype"] == "fp8"
        assert r["vllm_ratio"] == pytest.approx(2.0, abs=0.06)
        assert r["arithmetic"]["ratio"] == pytest.approx(2.0, abs=1e-3)
        assert r["vllm_bf16"]["kv_cache_size_tokens"] == r["vllm_bf16"]["tokens"]  # the log line's figure
    q = rows["qwen3-1.7b-kv"]
    assert q["arithmetic"]["bf16_bytes_per_token"] == 2 * 28 * 8 * 128 * 2  # Qwen3-1.7B's KV layout
    assert q["vllm_bf16"]["num_blocks"] * q["vllm_bf16"]["block_size"] * q["arithmetic"]["bf16_bytes_per_token"] \
        <= q["kv_bytes"]
