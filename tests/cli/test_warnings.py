"""Issue 29: the core commands print no spurious warning. On a core install (no torch), transformers announced at
import that "PyTorch was not found", which a user reads as an error; opdjax uses only its tokenizers."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # starts Python subprocesses that import opdjax and transformers

# What a core install (`make demo`'s venv) looks like to transformers: no torch package to find.
NO_TORCH = ("import importlib.util\nfind = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda n, *a: None if n.split('.')[0] == 'torch' else find(n, *a)\n")


def test_train_help_prints_no_pytorch_was_not_found_line_without_torch():
    code = NO_TORCH + "from opdjax.cli import main\nmain(['train', '--help'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage: opdjax train" in out.stdout
    assert "PyTorch was not found" not in out.stdout + out.stderr
    # ... while transformers itself, imported without opdjax's CLI, still says it (the check can fail)
    bare = subprocess.run([sys.executable, "-c", NO_TORCH + "import transformers"], capture_output=True, text=True,
                          timeout=120)
    assert "PyTorch was not found" in bare.stdout + bare.stderr
