"""The documentation site builds with warnings as errors; the guides and the README name only commands and flags
that exist.

`make docs` builds the same site (mkdocs.yml, docs/guide/) into site/. mkdocs and mkdocstrings are test extras: a
missing one is a failure, never a skip.
"""

import argparse
import pathlib
import re
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide"


def _require_mkdocs() -> None:
    for module in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            __import__(module)
        except ImportError as e:
            pytest.fail(f"{module} is not installed ({e}); the docs build needs the test extras: "
                        f"pip install -e '.[test]'")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    _require_mkdocs()
    out = tmp_path_factory.mktemp("site")
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"mkdocs build --strict failed (rc {r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-6000:]}"
    print(f"mkdocs build --strict: {time.time() - t0:.1f}s")
    return out


@pytest.mark.timeout(300)
def test_site_builds_strict_with_the_api_reference(site):
    core = (site / "api" / "core" / "index.html").read_text()
    assert 'id="opdjax.core.mismatch.metrics"' in core, "the opdjax.core page lacks mismatch.metrics"
    assert "k3" in core and "METRIC_KEYS" in core
    for page in ("cpu-study", "mixed-tpu-gpu", "library"):
        assert (site / page / "index.html").is_file(), f"guide {page} was not built"
    assert "opd_step" in (site / "api" / "pipeline" / "index.html").read_text()


def test_every_subpackage_has_an_api_page():
    documented = set()
    for page in (GUIDE / "api").glob("*.md"):
        documented |= set(re.findall(r"^::: (opdjax(?:\.\w+)?)\s*$", page.read_text(), re.M))
    packages = {f"opdjax.{p.parent.name}" for p in (ROOT / "opdjax").glob("*/__init__.py")} - {"opdjax.cli"}
    modules = {f"opdjax.{p.stem}" for p in (ROOT / "opdjax").glob("*.py") if not p.stem.startswith("_")}
    assert packages | modules | {"opdjax"} <= documented, f"no API page for {sorted(packages | modules - documented)}"


def test_readme_links_every_guide():
    readme = (ROOT / "README.md").read_text()
    for guide in ("cpu-study.md", "mixed-tpu-gpu.md", "library.md"):
        assert f"docs/guide/{guide}" in readme, f"README.md does not link docs/guide/{guide}"


def _cli_options() -> dict[str, set[str]]:
    from opdjax.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(p._option_string_actions) | set(parser._option_string_actions) for name, p in sub.choices.items()}


def _shell_blocks(markdown: str):
    """The text of every ```bash (or unlabelled) fenced block."""
    block, lang = None, None
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            if block is None:
                block, lang = [], line.strip()[3:].strip()
            else:
                if lang in ("", "bash", "sh", "shell"):
                    yield "\n".join(block)
                block = None
        elif block is not None:
            block.append(line)


def _commands(markdown: str):
    """(command, flags) of every `opdjax CMD ...` line (with its continuations) in the guides' shell blocks."""
    for block in _shell_blocks(markdown):
        for cmd in re.split(r"\n(?!\s)", block.replace("\\\n", " ")):
            for m in re.finditer(r"(?<![\w/.-])opdjax (?:--debug )?([a-z][a-z-]*)\b([^|;&#\n]*)", cmd):
                yield m.group(1), set(re.findall(r"(?<![\w=])(--[a-z][a-z-]*)", m.group(2)))


def test_guides_name_only_existing_commands_and_flags():
    options = _cli_options()
    seen = 0
    for page in [*GUIDE.glob("*.md"), ROOT / "README.md"]:
        for command, flags in _commands(page.read_text()):
            seen += 1
            assert command in options, f"{page.name}: `opdjax {command}` is not a command ({sorted(options)})"
            unknown = flags - options[command]
            assert not unknown, f"{page.name}: `opdjax {command}` has no option {sorted(unknown)}"
    assert seen >= 40
