"""What a model card shows of the run that made its model: the command line, without secrets (`--hub_token`, values
shaped like access tokens) or this machine's paths (`card_command`, `redact_command`; `redact_secrets` for saved
run settings), and the license when the source names none. Standard library only: the scripts' `--help` reads
`DEFAULT_LICENSE` through `training.arguments`, and nothing here needs torch or huggingface_hub."""

import os
import re
import shlex
from pathlib import Path


DEFAULT_LICENSE = "apache-2.0"

# an argument whose name has one of these words holds a secret; values shaped like access tokens are secrets whatever
# their argument (Hugging Face, GitHub, OpenAI-style, AWS keys)
SECRET_NAME = re.compile(r"(^|_)(token|secret|password|passwd|api_key|apikey|credentials?|auth)($|_)", re.IGNORECASE)
SECRET_VALUE = re.compile(r"\b(hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|AKIA[0-9A-Z]{16})\b")
REDACTED = "<redacted>"


def is_secret_option(option: str) -> bool:
    """Whether a `--flag`'s value must never be written down: a word of its name is a token, password or secret
    (`--hub_token`, `--wandb_api_key`; not `--tokenizer_name`)."""
    return option.startswith("-") and SECRET_NAME.search(option.lstrip("-").replace("-", "_")) is not None


def redact_secrets(settings: dict) -> dict:
    """`settings` without the entries whose name marks a secret (`hub_token`, ...), token-like values replaced by
    `<redacted>` (also inside strings and lists)."""

    def clean(value):
        if isinstance(value, str):
            return SECRET_VALUE.sub(REDACTED, value)
        if isinstance(value, (list, tuple)):
            return type(value)(clean(v) for v in value)
        if isinstance(value, dict):
            return redact_secrets(value)
        return value

    return {key: clean(value) for key, value in settings.items() if not SECRET_NAME.search(str(key))}


def redact_argv(argv: list[str]) -> list[str]:
    """A command line fit to print or save: the value of every secret flag (`--hub_token X`, `--hub_token=X`) and
    every token-like word replaced by `<redacted>`."""
    redacted, hide_next = [], False
    for word in argv:
        flag, equals, _ = word.partition("=")
        secret_flag = flag.startswith("--") and is_secret_option(flag)
        if hide_next:
            redacted.append(REDACTED)
        elif secret_flag and equals:
            redacted.append(f"{flag}={REDACTED}")
        else:
            redacted.append(SECRET_VALUE.sub(REDACTED, word))
        hide_next = secret_flag and not equals
    return redacted


def _shown_path(value: str, output_dir: Path | None, cwd: Path) -> str:
    """A path as a card shows it: relative when under the output folder or the working directory, else its name."""
    path = Path(value).expanduser()
    if not path.is_absolute() and ".." not in path.parts:
        return value
    path = Path(os.path.normpath(cwd / path))
    if output_dir is not None and path.is_relative_to(output_dir):
        return (Path(output_dir.name) / path.relative_to(output_dir)).as_posix()
    if path.is_relative_to(cwd):
        return path.relative_to(cwd).as_posix() or "."
    return path.name or "<path>"


def secret_options(parser) -> tuple[str, ...]:
    """The spellings of every option of an argparse `parser` whose destination holds a secret (`dest` `hub_token`,
    whatever its flag is called)."""
    return tuple(
        option
        for action in parser._actions  # argparse keeps no public list of its actions
        if SECRET_NAME.search(action.dest)
        for option in action.option_strings
    )


def _is_secret(option: str, secrets: tuple[str, ...]) -> bool:
    """Whether `option` is a secret's flag: by its name, or as a spelling (or an abbreviation, where a parser would
    take one) of a secret destination's flag in `secrets`."""
    if is_secret_option(option):
        return True
    abbreviation = option.startswith("--") and len(option) > 2
    return option.startswith("-") and any(s == option or (abbreviation and s.startswith(option)) for s in secrets)


def _card_words(argv: list[str], output_dir: Path | None, secrets: tuple[str, ...] = ()) -> list[str]:
    cwd = Path(os.getcwd()).resolve()
    # a local copy of a Hub model (the bundled MiniLM) is shown as the Hub id that --base_model says it holds
    base_model = next((argv[i + 1] for i, word in enumerate(argv[:-1]) if word == "--base_model"), None)
    words, skip_value = [], False
    for word in argv:
        if base_model and words and words[-1] == "--model_name_or_path" and Path(word).is_absolute():
            words.append(base_model)
            continue
        if skip_value:
            skip_value = False
            if not word.startswith("-"):
                continue
        option, equals, value = word.partition("=")
        if _is_secret(option, secrets) or (equals and not word.startswith("-") and is_secret_option("--" + option)):
            skip_value = not equals  # `--hub_token X`, `--hub_token=X`, `HF_TOKEN=X`
            continue
        if equals and value and os.sep not in option:  # --flag=PATH, NAME=PATH (--validation_files)
            words.append(f"{option}={_shown_path(value, output_dir, cwd)}")
        else:
            words.append(word if word.startswith("-") else _shown_path(word, output_dir, cwd))
    return [SECRET_VALUE.sub(REDACTED, word) for word in words]


def card_command(
    script: str | os.PathLike,
    argv: list[str],
    output_dir: str | os.PathLike | None = None,
    launcher: str = "python",
    parser=None,
) -> str:
    """The command line behind a result, fit for a public model card: `python run_scripts/<script> ...`, without
    any secret (`--hub_token`, flags or variables naming a token, password or secret: dropped with their value) and
    without this machine's paths (absolute paths under `output_dir` or the working directory become relative, other
    absolute paths their file or folder name). With the script's argparse `parser`, every flag whose parsed
    destination is a secret is dropped too, however it is spelt (`secret_options`)."""
    output_dir = Path(os.path.normpath(Path(output_dir).absolute())) if output_dir is not None else None
    secrets = secret_options(parser) if parser is not None else ()
    words = _card_words(list(argv), output_dir, secrets)
    return shlex.join([*launcher.split(), f"run_scripts/{Path(script).name}", *words])


def redact_command(command: str, output_dir: str | os.PathLike | None = None) -> str:
    """A command line given as text, with the secrets and machine paths of `card_command` removed; a
    `... some/dir/<script>.py ...` is shown as `... run_scripts/<script>.py ...`."""
    output_dir = Path(os.path.normpath(Path(output_dir).absolute())) if output_dir is not None else None
    words = shlex.split(command)
    script = next((i for i, word in enumerate(words) if word.endswith(".py") and not word.startswith("-")), None)
    launcher = [Path(word).name if Path(word).is_absolute() else word for word in words[:script or 0]]
    if script is None:
        return shlex.join(_card_words(words, output_dir))
    shown = [*_card_words(launcher, output_dir), f"run_scripts/{Path(words[script]).name}"]
    return shlex.join(shown + _card_words(words[script + 1 :], output_dir))


__all__ = [
    "DEFAULT_LICENSE",
    "REDACTED",
    "SECRET_NAME",
    "SECRET_VALUE",
    "card_command",
    "is_secret_option",
    "redact_argv",
    "redact_command",
    "redact_secrets",
    "secret_options",
]
