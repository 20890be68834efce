"""README.md and the pages under docs/ run as written: every ```python block in a fresh temporary folder, every
command line of a script with flags its parser knows, every `make` target that exists.

A block that cannot run offline is marked by `<!-- readme-test: skip (the reason) -->` on the line before it; the
skips are counted and printed (keep them rare)."""

import argparse
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys

import pytest
from helpers import REPO_ROOT, load_script


DOCUMENTS = {path.relative_to(REPO_ROOT).as_posix(): path.read_text(encoding="utf-8") for path in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]}
README = "\n".join(DOCUMENTS.values())  # for the checks that look at the text as a whole
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\b(.*?)-->")
BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks(language: str) -> list[tuple[str, str, str | None]]:
    """(document:line, code, skip reason or None) of every fenced block in `language`."""
    found = []
    for document, text in DOCUMENTS.items():
        for match in BLOCK.finditer(text):
            if match.group(1) != language:
                continue
            before = text[: match.start()].rstrip().splitlines()
            skip = SKIP.search(before[-1]) if before else None
            where = f"{document}:{text.count(chr(10), 0, match.start()) + 1}"
            found.append((where, match.group(2), skip.group(1).strip() if skip else None))
    return found


PYTHON_BLOCKS = blocks("python")


def test_readme_skips_are_few():
    skipped = [(line, reason) for line, _, reason in PYTHON_BLOCKS if reason is not None]
    print(f"\nREADME: {len(PYTHON_BLOCKS)} python blocks, {len(skipped)} skipped: {skipped}")
    assert PYTHON_BLOCKS and len(skipped) <= max(1, len(PYTHON_BLOCKS) // 5), skipped


@pytest.mark.slow  # each block in a fresh interpreter: 7-13 s apiece on 2 cores
@pytest.mark.parametrize("line, code, skip", PYTHON_BLOCKS, ids=[line for line, _, _ in PYTHON_BLOCKS])
def test_python_block_runs_as_written(line, code, skip, tmp_path):
    if skip is not None:
        pytest.skip(f"README line {line} is marked skip {skip}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    first = code.strip().splitlines()[0]
    assert done.returncode == 0, f"README block at line {line} ({first!r}) failed:\n{done.stderr[-3000:]}"
    leaked = [p for p in os.listdir(REPO_ROOT) if p.startswith("my-pkm")]
    assert not leaked, f"README block at line {line} wrote {leaked} outside its working folder"


# ---- command lines ----


def shell_commands() -> list[tuple[int, str]]:
    """Each command of the bash blocks (continuations joined, comments dropped) and each inline `...` span that runs
    a script, with its README line."""
    commands = []
    for line, code, _ in blocks("bash"):
        text = re.sub(r"\\\n\s*", " ", code)
        for offset, row in enumerate(text.splitlines()):
            row = re.sub(r"(^|\s)#.*$", "", row).strip()
            if row:
                document, number = line.rsplit(":", 1)
                commands.append((f"{document}:{int(number) + 1 + offset}", row))
    for document, text in DOCUMENTS.items():
        for match in re.finditer(r"`([^`\n]*run_scripts/\w+\.py[^`\n]*)`", text):
            commands.append((f"{document}:{text.count(chr(10), 0, match.start()) + 1}", match.group(1)))
    return commands


SCRIPT_CALL = re.compile(r"(?:^|\s)(?:\S*python\S*|accelerate launch(?: --\S+(?: \d+)?)*|torchrun(?: --\S+ \S+)*)\s+(run_scripts/\w+\.py)\b")


class Parsed(Exception):
    pass


def check_flags(script: str, argv: list[str]) -> None:
    """Parse `argv` with the script's own parser (flags, types, choices), without its checks of files or models."""
    path = REPO_ROOT / script
    assert path.is_file(), f"{script} does not exist"
    sys.path.insert(0, str(path.parent))
    try:
        module = load_script(path.stem, folder=path.parent)
    finally:
        sys.path.remove(str(path.parent))
    parse = argparse.ArgumentParser.parse_args

    def parse_only(parser, args=None, namespace=None):
        parse(parser, args, namespace)
        raise Parsed

    errors = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(errors):
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
        patch.setattr(sys, "argv", [path.name, *argv])
        try:
            module.parse_args() if path.stem == "demo" else module.parse_args(argv)
        except Parsed:
            return
        except SystemExit as exit:
            if exit.code == 0:  # --help
                return
            raise AssertionError(f"{script} {shlex.join(argv)}: {errors.getvalue().strip()}") from None
    raise AssertionError(f"{script}: parse_args() did not parse")


def script_calls() -> list[tuple[int, str, list[str]]]:
    """(README line, script, arguments) of every script call; a seed_sweep line gives the sweep's call and its run's."""
    calls = []
    for line, command in shell_commands():
        # `[--flag value]` marks options; `...` stands for more arguments; `|`, `&&`, `;` end a command
        command = re.split(r"\s(?:\||&&|;)\s", command.replace("[", "").replace("]", ""))[0]
        while match := SCRIPT_CALL.search(command):
            words = shlex.split(command[match.end() :])
            calls.append((line, match.group(1), words))
            if not (match.group(1).endswith("seed_sweep.py") and "--" in words):
                break
            command = shlex.join(words[words.index("--") + 1 :])  # the command of one run
    return calls


CALLS = script_calls()


def test_readme_shows_script_commands():
    scripts = {script for _, script, _ in CALLS}
    assert {"run_scripts/run_mlm.py", "run_scripts/convert_to_pkm.py"} <= scripts, scripts


@pytest.mark.parametrize("line, script, argv", CALLS, ids=[f"line{line}-{s.split('/')[-1]}" for line, s, _ in CALLS])
def test_script_command_uses_existing_flags(line, script, argv):
    if "..." in argv or not any(word.startswith("-") for word in argv):
        # an excerpt (`...` stands for the rest): check that the script runs and that every flag shown exists
        argv = [word.split("=")[0] for word in argv if word.startswith("--")]
        path = REPO_ROOT / script
        done = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        unknown = [flag for flag in argv if not re.search(rf"{flag}\b", done.stdout)]
        assert not unknown, f"README line {line}: {script} has no {unknown}"
        return
    try:
        check_flags(script, argv)
    except AssertionError as error:
        raise AssertionError(f"README line {line}: {error}") from None


def test_make_targets_exist():
    makefile = (REPO_ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([\w.-]+):", makefile, re.MULTILINE))
    code = "\n".join(code for _, code, _ in blocks("bash")) + "\n" + "\n".join(re.findall(r"`([^`\n]+)`", README))
    named = set(re.findall(r"(?:^|[\s(=])make ([a-z][\w-]*)", code, re.MULTILINE))
    assert named, "the README names no make target"
    assert named <= targets, f"README names make targets the Makefile lacks: {sorted(named - targets)}"
