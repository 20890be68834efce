"""Input a command cannot use (a flag's value, a file, a folder, a model without what the command needs) and its one
form in every script: argparse's usage error (`usage: ...`, `<script>: error: <message>`, exit status 2), never a
traceback. Standard library only: a script's `--help` imports no torch."""

import argparse
import contextlib
import functools


class InputError(ValueError):
    """Input a command cannot use; the message names the input and what is wrong. A ValueError, so that callers of the
    library that catch ValueError keep working; the scripts print it as a usage error ([`usage_errors`],
    [`exits_with_usage_errors`]). Raised for such input only, never for a bug."""


def one_line(error: BaseException) -> str:
    """The error's message on one line (a wrapped library message keeps its words)."""
    return " ".join(str(error).split())


@contextlib.contextmanager
def usage_errors(parser: argparse.ArgumentParser, *types: type[Exception]):
    """Inside: an `InputError`, or an exception of one of `types` where the code inside only checks input (e.g. the
    ValueError of a config's own checks while a config is built from the flags), ends the script as
    `parser.error(message)`. Any other exception keeps its traceback."""
    try:
        yield
    except (InputError, *types) as error:
        parser.error(one_line(error))


def exits_with_usage_errors(build_parser):
    """Decorator of a script's `main(argv=None)`: an `InputError` raised anywhere inside it (what only the loaded
    model or data shows: a model without memories, a text shorter than one sequence, a sequence length beyond the
    model's positions) ends the script as a usage error of `build_parser()`'s parser, as a bad flag does."""

    def decorate(main):
        @functools.wraps(main)
        def run(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except InputError as error:
                build_parser().error(one_line(error))

        return run

    return decorate


__all__ = ["InputError", "exits_with_usage_errors", "one_line", "usage_errors"]
