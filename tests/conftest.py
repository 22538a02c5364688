"""Test session set-up: 8 fake CPU devices and a persistent compilation cache, before JAX initialises."""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pathlib  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

_CACHE = pathlib.Path(os.environ.get("OPDJAX_JAX_CACHE", pathlib.Path(__file__).resolve().parents[1] / ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="session")
def cpu_devices():
    devs = jax.devices("cpu")
    assert len(devs) >= 8, f"expected 8 CPU devices from JAX_NUM_CPU_DEVICES, got {len(devs)}"
    return devs
