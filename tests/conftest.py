"""Test session set-up: 8 fake CPU devices, a persistent compilation cache and cheap code generation, before JAX
initialises.

The tiny test models spend most of their time in XLA's compiler, not in running, so the suite (and every process it
starts) generates CPU code at LLVM -O0 (`--xla_backend_optimization_level=0`; `OPDJAX_TEST_XLA_OPT` overrides): about
a third less time from a cold cache. XLA's HLO passes, where the simulated quantization must survive the algebraic
simplifier, run as always; only machine-code optimisation is skipped, and every numeric check compares against
its reference with a tolerance or within one process.
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
_OPT = f"--xla_backend_optimization_level={os.environ.get('OPDJAX_TEST_XLA_OPT', '0')}"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_OPT}".strip()

import pathlib  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Fuzz tests draw the same examples on every run (a red CI is a change, never a dice roll); explore new ones locally
# with HYPOTHESIS_PROFILE=explore.
settings.register_profile("ci", derandomize=True, max_examples=300)
settings.register_profile("explore", max_examples=5000, derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_CACHE = pathlib.Path(os.environ.get("OPDJAX_JAX_CACHE", pathlib.Path(__file__).resolve().parents[1] / ".jax_cache"))
os.environ["OPDJAX_JAX_CACHE"] = str(_CACHE)  # `opdjax` processes the tests start share the same cache
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="session")
def used_checkout(tmp_path_factory) -> pathlib.Path:
    """A directory like a checkout after `make demo`: `runs/demo` holds a finished previous run."""
    root = tmp_path_factory.mktemp("used_checkout")
    demo = root / "runs" / "demo"
    demo.mkdir(parents=True)
    for name, text in (("config.json", "{}"), ("summary.json", '{"steps": 1}'), ("metrics.jsonl", '{"step": 1}\n')):
        (demo / name).write_text(text)
    return root


@pytest.fixture(autouse=True)
def _from_a_used_checkout(used_checkout, monkeypatch):
    """Every test runs from a directory that holds a previous `runs/demo` (what `make demo` leaves), never from the
    repository: a test that depends on the working directory (a relative path, the default out_dir) fails here."""
    monkeypatch.chdir(used_checkout)


@pytest.fixture(scope="session")
def cpu_devices():
    devs = jax.devices("cpu")
    assert len(devs) >= 8, f"expected 8 CPU devices from JAX_NUM_CPU_DEVICES, got {len(devs)}"
    return devs


REQUIRE = os.environ.get("OPDJAX_REQUIRE_VLLM") == "1"  # `make test` and CI: every reference must run


def require_reference(name: str):
    """Import a reference implementation (torch, transformers): skipped where it is not installed, but an import
    error — a red suite — under OPDJAX_REQUIRE_VLLM=1 (`make test`, CI), where a broken install must not turn
    "logits match transformers" into a green skip."""
    if REQUIRE:
        import importlib

        return importlib.import_module(name)
    return pytest.importorskip(name)


@pytest.fixture(scope="session")
def vllm_module():
    """The real vllm package: skipped when missing, a failure when OPDJAX_REQUIRE_VLLM=1 (as in CI)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - any import failure means "no usable vLLM"
        msg = f"vllm is not importable ({e!r})"
        if os.environ.get("OPDJAX_REQUIRE_VLLM") == "1":
            pytest.fail(msg + " and OPDJAX_REQUIRE_VLLM=1")
        pytest.skip(msg)
    return vllm


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    """(student_dir, teacher_dir): tiny random qwen3 models sharing one locally trained tokenizer."""
    from opdjax.models.tiny import load_tokenizer, make_tiny

    root = tmp_path_factory.mktemp("pair")
    student = make_tiny(root / "student", "qwen3", "tiny", seed=1, corpus=["12+34=46", "7+8=15"])
    teacher = make_tiny(root / "teacher", "qwen3", "tiny", seed=2, tokenizer=load_tokenizer(student))
    return str(student), str(teacher)


@pytest.fixture(scope="session")
def padded_pair(pair, tmp_path_factory):
    """(student_dir, teacher_dir) sharing the pair's tokenizer (259 tokens) in vocabularies padded past it, as real
    pairs are (Qwen2.5: 151665 tokens in 151936 or 152064 rows): the student's rounded up to 128 rows (384), the
    teacher's to 256 (512)."""
    from opdjax.models.tiny import load_tokenizer, make_tiny

    root = tmp_path_factory.mktemp("padded")
    tok = load_tokenizer(pair[0])
    student = make_tiny(root / "student", "qwen3", "tiny", seed=1, tokenizer=tok, vocab_multiple=128)
    teacher = make_tiny(root / "teacher", "qwen3", "tiny", seed=2, tokenizer=tok, vocab_multiple=256)
    return str(student), str(teacher)


# The longest test files (measured from a cold cache on a 2-core AVX2 EPYC), started first: pytest-xdist's loadfile
# scheduler hands files out in collection order, so a long file collected last would end the run on one worker
# while the other idles.
LONGEST_FIRST = (
    "tests/remote/test_multiprocess.py", "tests/remote/test_vllm_server.py", "tests/remote/test_multiprocess_resume.py",
    "tests/remote/test_serve_processes.py", "tests/pipeline/test_loop.py", "tests/remote/test_vllm_server_fp8.py",
    "tests/benchmarks/test_accelerator_check.py", "tests/study/test_study.py", "tests/examples/test_examples.py",
    "tests/benchmarks/test_vllm_fp8_gpu_check.py", "tests/pipeline/test_prepare.py",
)


def pytest_collection_modifyitems(config, items):
    """Files in `LONGEST_FIRST` order first, then the rest as collected (a stable sort: each file stays whole)."""
    rank = {f: i for i, f in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
