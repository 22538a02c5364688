"""A griffe extension for the API reference (mkdocs.yml loads it): the reST habits of opdjax's docstrings, as Markdown.

opdjax's docstrings are prose written with a few reStructuredText conventions that Markdown would print literally.
Before mkdocstrings renders them, this rewrites, in the docstring text only (the source is not touched):

- roles, ``:func:`metrics` ``, ``:mod:`opdjax.core.mismatch` ``, ...: a link to the object's entry when the site
  renders it (public, documented, not in ``opdjax.cli``), else inline code;
- a paragraph ending in ``::`` (a literal block follows): the ``::`` becomes ``:``, the indented block stays code;
- simple tables (``=====  =====`` rules): Markdown tables;
- aligned "name   description" paragraphs (every line a term, two or more spaces, then text; or an indented
  continuation): preformatted (without the code markup), so their columns stay aligned.

Anything it does not recognise is left as it is.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|mod|data|class|meth|attr|obj|exc|const):`~?([^`]+)`")
_RULE = re.compile(r"^ *=+( +=+)+ *$")
_TERM = re.compile(r"^[^\s|`][^\s]*( [^\s]+)? {2,}\S")


def _rendered(obj) -> bool:
    """Whether the site renders `obj` (the API pages use filters ["!^_"] and leave out undocumented members)."""
    parts = obj.path.split(".")
    if parts[0] != "opdjax" or (len(parts) > 1 and parts[1] == "cli") or any(p.startswith("_") for p in parts):
        return False
    while obj is not None and obj.path != "opdjax":
        if not obj.is_module and not obj.docstring:
            return False
        obj = obj.parent
    return True


def _resolve(obj, name: str):
    """The object `name` refers to from `obj`'s docstring (full path, or relative to its class or module)."""
    collection = obj.modules_collection
    scopes = [obj] if obj.is_class or obj.is_module else []
    scopes += [obj.parent, obj.module] if obj.parent is not None else [obj.module]
    candidates = [name] + [f"{s.path}.{name}" for s in scopes if s is not None]
    for path in candidates:
        try:
            found = collection[path]
        except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
        try:
            return found.final_target if found.is_alias else found
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
    return None


def _roles(obj, text: str) -> str:
    def link(m: re.Match) -> str:
        name = m.group(1).strip()
        target = _resolve(obj, name)
        short = name.split(".")[-1] if m.group(0).count("~") else name
        if target is not None and _rendered(target):
            return f"[`{short}`][{target.path}]"
        return f"`{short}`"
    return _ROLE.sub(link, text)


def _literal_blocks(text: str) -> str:
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.rstrip().endswith("::") and i + 1 < len(lines) and not lines[i + 1].strip():
            stripped = line.rstrip()[:-2].rstrip()
            lines[i] = stripped + ":" if stripped else ""
    return "\n".join(lines)


def _aligned_blocks(text: str) -> str:
    out: list[str] = []
    block: list[str] = []

    def flush() -> None:
        terms = sum(bool(_TERM.match(x)) for x in block)
        if len(block) >= 2 and _TERM.match(block[0]) and terms >= 2 and all(
                _TERM.match(x) or x.startswith("  ") for x in block):
            if out and out[-1].strip():
                out.append("")
            plain = [re.sub(r"``?([^`]+?)``?", r"\1", re.sub(r"\[`([^`]+)`\]\[[^\]]*\]", r"\1", x)) for x in block]
            out.extend(["```text", *plain, "```"])
        else:
            out.extend(block)
        block.clear()

    fence = False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fence = not fence
        if fence or not line.strip() or (not block and line.startswith(" ")):
            flush()
            out.append(line)
        else:
            block.append(line)
    flush()
    return "\n".join(out)


def _cells(line: str, n: int) -> list[str]:
    cells = re.split(r" {2,}", line.strip(), maxsplit=n - 1)
    cells = [re.sub(r" {2,}", " ", c.strip()).replace("|", "\\|") for c in cells]
    return cells + [""] * (n - len(cells))


def _tables(text: str) -> str:
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        rules = [j for j in range(i, len(lines)) if _RULE.match(lines[j])][:3]
        if len(rules) < 3 or rules[0] != i or any(not lines[j].strip() for j in range(rules[0], rules[2])):
            out.append(lines[i])
            i += 1
            continue
        n = len(lines[i].split())
        head = _cells(" ".join(lines[rules[0] + 1:rules[1]]), n)
        body = [_cells(row, n) for row in lines[rules[1] + 1:rules[2]]]
        if out and out[-1].strip():
            out.append("")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * n)
        out.extend("| " + " | ".join(row) + " |" for row in body)
        i = rules[2] + 1
    return "\n".join(out)


class RestToMarkdown(griffe.Extension):
    """Rewrite every docstring once the whole package is loaded (roles need the other modules to resolve)."""

    def on_package(self, *, pkg, **kwargs) -> None:
        if pkg.path == "opdjax":
            self._walk(pkg, set())

    def _walk(self, obj, seen: set) -> None:
        if obj.path in seen or obj.is_alias:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            obj.docstring.value = _aligned_blocks(_tables(_literal_blocks(_roles(obj, obj.docstring.value))))
        for member in list(obj.members.values()):
            if not member.is_alias:
                self._walk(member, seen)
