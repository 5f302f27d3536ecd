"""Every command-line option is documented in docs/reference (a flag added without its line
in the reference fails here)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

from stratagem.cli import build_parser

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference"


def options(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
            ) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(command path, option strings) of every visible option, subcommands included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from options(sub, (*path, name))
        elif action.option_strings and action.help != argparse.SUPPRESS \
                and "--help" not in action.option_strings:
            yield " ".join(path) or "stratagem", tuple(action.option_strings)


def test_every_option_is_in_the_reference() -> None:
    text = "\n".join(p.read_text() for p in REFERENCE.glob("*.md"))
    found = list(options(build_parser()))
    assert len(found) > 30  # the walk reached the subcommands
    missing = [f"{cmd} {'/'.join(opts)}" for cmd, opts in found
               if not any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text)
                          for o in opts)]
    assert not missing, f"undocumented options (add them to docs/reference): {missing}"
