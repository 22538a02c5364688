"""The documentation site builds with warnings as errors; the README, the guides and the results pages name only
commands and flags that exist and links that resolve; the README stays a front door (short, no lab notebook); every
results page states its command, machine and seeds; every example prints its usage line when arguments are missing.

`make docs` builds the same site (mkdocs.yml, docs/) into site/. mkdocs and mkdocstrings are test extras: a missing
one is a failure, never a skip.
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
RESULTS = ROOT / "docs" / "results"
README = ROOT / "README.md"
README_MAX_LINES = 250
# History has no place in user-facing docs: issue numbers, first person, commit hashes, "before this change".
LAB_NOTEBOOK = re.compile(r"issue [0-9]|\bI (added|started|ran)\b|commit [0-9a-f]{7}"
                          r"|before this change|previous levers", re.I)
# Written by the config key reference generator from the config's field metadata, not by hand.


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
    core = (site / "guide" / "api" / "core" / "index.html").read_text()
    assert 'id="opdjax.core.mismatch.metrics"' in core, "the opdjax.core page lacks mismatch.metrics"
    assert "k3" in core and "METRIC_KEYS" in core
    for page in ("cpu-study", "mixed-tpu-gpu", "library"):
        assert (site / "guide" / page / "index.html").is_file(), f"guide {page} was not built"
    for page in RESULTS.glob("*.md"):
        built = site / "results" / ("" if page.stem == "index" else page.stem) / "index.html"
        assert built.is_file(), f"results page {page.name} was not built"
    assert (site / "results" / "budget_sort_cpu" / "budget.json").is_file(), "the study data is not in the site"
    assert "opd_step" in (site / "guide" / "api" / "pipeline" / "index.html").read_text()


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


def _inline_commands(markdown: str):
    """(command, flags) of every inline `opdjax CMD ...` code span (results pages name their commands inline)."""
    for span in re.findall(r"`(opdjax [^`]+)`", markdown):
        m = re.match(r"opdjax (?:--debug )?([a-z][a-z-]*)\b(.*)", span)
        if m and not m.group(1).endswith("-"):
            yield m.group(1), set(re.findall(r"(?<![\w=])(--[a-z][a-z-]*)", m.group(2)))


def _doc_pages() -> list[pathlib.Path]:
    return [*GUIDE.glob("*.md"), *RESULTS.glob("*.md"), ROOT / "docs" / "index.md", README]


def test_guides_name_only_existing_commands_and_flags():
    options = _cli_options()
    seen = 0
    for page in _doc_pages():
        text = page.read_text()
        for command, flags in [*_commands(text), *_inline_commands(text)]:
            seen += 1
            assert command in options, f"{page.name}: `opdjax {command}` is not a command ({sorted(options)})"
            unknown = flags - options[command]
            assert not unknown, f"{page.name}: `opdjax {command}` has no option {sorted(unknown)}"
    assert seen >= 60


def _links(markdown: str):
    """Relative link targets of a Markdown page, without their #anchor."""
    for target in re.findall(r"\]\(([^)\s]+)\)", markdown):
        if not re.match(r"[a-z]+:|#", target):
            yield target.split("#")[0]


def test_readme_is_a_short_front_door_linking_every_results_page():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has {len(text.splitlines())} lines"
    assert text.index("make demo") < text.index("make test") < 400, "the two commands come first"
    assert "configs/budget_sort_cpu.yaml" in text and "configs/budget_cpu.yaml" not in text, \
        "the README's study runs the instrument that measures"
    for name in ("docs/results/budget-sort-cpu.md", "docs/results/admission-validity-sort-cpu.md",
                 "docs/results/phenomena-sort-cpu.md", "docs/results/index.md"):
        assert f"({name})" in text, f"README.md does not link {name}"


def test_every_relative_link_in_the_readme_and_the_docs_resolves():
    for page in _doc_pages():
        for target in _links(page.read_text()):
            path = (page.parent / target).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)} links {target}, which does not exist"


def test_user_facing_docs_hold_no_history():
    pages = [README, ROOT / "docs" / "index.md", *GUIDE.rglob("*.md"), *RESULTS.rglob("*.md")]
    for page in pages:
        for i, line in enumerate(page.read_text().splitlines(), 1):
            assert not LAB_NOTEBOOK.search(line), f"{page.relative_to(ROOT)}:{i}: {line.strip()}"


def test_every_results_page_states_its_command_machine_and_seeds():
    pages = [p for p in RESULTS.glob("*.md") if p.stem != "index"]
    assert len(pages) >= 10
    index = (RESULTS / "index.md").read_text()
    for page in pages:
        text = page.read_text()
        for field in ("**Command:**", "**Machine:**", "**Seeds:**"):
            assert field in text, f"{page.name} does not state {field.strip('*:').lower()}"
        assert f"({page.name})" in index, f"docs/results/index.md does not list {page.name}"


@pytest.mark.slow  # a fresh interpreter per example (imports JAX)
@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_examples_print_their_usage_line_on_wrong_arguments(example):
    # Without its arguments (or with one too many) an example says how to call it: no traceback.
    argv = ["a", "b", "3", "extra"]
    r = subprocess.run([sys.executable, str(ROOT / "examples" / example), *argv], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"usage: python examples/{example}" in r.stderr
    if example in ("own_opd_loop.py", "remote_servers.py"):  # required arguments: none given
        r = subprocess.run([sys.executable, str(ROOT / "examples" / example)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode != 0 and "Traceback" not in r.stderr and "usage: python examples/" in r.stderr
