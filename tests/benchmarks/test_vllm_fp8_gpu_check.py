"""benchmarks/vllm_fp8_gpu_check.py with --emulate: the check a GPU user runs (unpatched vLLM there) passes here
through the CPU emulation, so the script stays ready for the first GPU with vLLM."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_gpu_check_passes_on_a_cpu_through_the_emulation(vllm_module):
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_fp8_gpu_check.py"), "--emulate",
                           "--prompts", "16"], capture_output=True, text=True, env=env, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0 and "PASS" in out, out[-3000:] + proc.stderr[-3000:]
    assert "recipe fp8_w8a8 (activations per token), emulated: True" in out
    assert out.count("| yes |") == 2  # v1 and v2: FP8 with vLLM's scales
