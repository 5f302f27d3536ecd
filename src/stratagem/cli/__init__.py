"""The command line: ``stratagem run | plan | report | simulate | cluster | submit | ...``.

``main`` parses and dispatches (:mod:`stratagem.cli.app`); each subcommand that does more than
call one library function has its own module here (``plan``, ``plan_picture``, ``report``,
``simulate``, ``service``)."""

from stratagem.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
