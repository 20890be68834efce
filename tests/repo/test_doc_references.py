"""Every repository file and section that a page (README.md, docs/*.md) or a docstring or comment of the package, the
scripts and the benchmarks names exists: a path from the repository root (`tests/compat/test_release.py`; a
`<placeholder>` or `*` stands for any part, `{a,b}` for either), a Markdown link relative to its page, and a section
named as `page.md#anchor` (GitHub's anchor of a heading) or as `the README's "Heading"`."""

import io
import itertools
import os
import re
import subprocess
import tokenize
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

from helpers import REPO_ROOT


def repository_files() -> set[str]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    return {name for name in listed if (REPO_ROOT / name).exists()}  # deleted but not yet committed: gone


FILES = repository_files()
PATHS = FILES | {str(parent) for name in FILES for parent in Path(name).parents if str(parent) != "."}
FOLDERS = sorted({name.split("/")[0] for name in FILES if "/" in name})
PAGES = ["README.md", *sorted(name for name in FILES if re.fullmatch(r"docs/[^/]+\.md", name))]
SOURCES = sorted(name for name in FILES if name.endswith(".py") and name.split("/")[0] in ("modeling_pkm_bert", "run_scripts", "benchmarks"))  # fmt: skip
PATH = re.compile(
    r"(?<![\w./<>*-])((?:%s)/(?:<[^>\n]*>|[\w.*/{},-])+|README\.md|Makefile|setup\.py|constraints[\w-]*\.txt)"
    r"(#[\w-]+)?" % "|".join(map(re.escape, FOLDERS))
)
LINK = re.compile(r"\]\(([^)\s]+)\)")
QUOTED_SECTION = re.compile(r"\b(README|[\w/.-]+\.md)'s\s+\"([^\"]+)\"")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: str) -> set[str]:
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", FENCE.sub("", (REPO_ROOT / page).read_text(encoding="utf-8")), re.M):
        base = anchor(heading)
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


def exists(path: str) -> bool:
    path = re.sub(r"<[^>]*>", "*", path).rstrip("/")
    braces = re.findall(r"\{([^{}]*)\}", path)
    template = re.sub(r"\{[^{}]*\}", "{}", path)
    for choice in itertools.product(*(group.split(",") for group in braces)):
        candidate = template.format(*choice)
        if not (any(fnmatchcase(name, candidate) for name in PATHS) if "*" in candidate else candidate in PATHS):
            return False
    return True


def problems_of(text: str, where: str, page_dir: str = "") -> list[str]:
    """What `text` (of file `where`; a page's links are relative to `page_dir`) names that does not exist."""
    problems = []
    references = [(match[1].rstrip(".,-/"), match[2]) for match in PATH.finditer(text)]
    for target in LINK.findall(text) if page_dir is not None else []:
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, section = target.partition("#")
        references.append((os.path.normpath(os.path.join(page_dir, path)) if path else where, f"#{section}" if section else None))
    for path, section in references:
        if not exists(path):
            problems.append(f"{where}: {path} does not exist")
        elif section and path.endswith(".md") and section[1:] not in anchors(path):
            problems.append(f"{where}: {path} has no section {section}")
    for page, heading in QUOTED_SECTION.findall(text):
        page = "README.md" if page == "README" else page
        if not exists(page) or anchor(heading) not in anchors(page):
            problems.append(f'{where}: {page} has no section "{heading}"')
    return problems


def docstrings_and_comments(source: str) -> str:
    """The comments and string literals (f-strings aside: their paths are computed) of a Python file."""
    kept = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and "f" not in token.string.split(token.string[-1])[0].lower()):
            kept.append(token.string)
    return "\n".join(kept)


def test_anchor_is_githubs():
    assert anchor("Memory+ and modern options") == "memory-and-modern-options"
    assert anchor("Configuration (`BertPkmConfig`: every `BertConfig` field plus)") == "configuration-bertpkmconfig-every-bertconfig-field-plus"
    assert "hashed-n-gram-memory-engram-style" in anchors("docs/configuration.md")


def test_a_wrong_reference_is_found():
    text = "see `tests/test_release.py`, [x](configuration.md#no-such-section), the README's \"No such\" and docs/*.md"
    assert len(problems_of(text, "docs/page.md", "docs")) == 3


@pytest.mark.parametrize("name", PAGES + SOURCES)
def test_every_named_file_and_section_exists(name):
    text = (REPO_ROOT / name).read_text(encoding="utf-8")
    if name.endswith(".py"):
        problems = problems_of(docstrings_and_comments(text), name, None)
    else:
        problems = problems_of(text, name, str(Path(name).parent))
    assert not problems, "\n".join(problems)
