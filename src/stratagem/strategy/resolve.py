"""One rule for a strategy argument (``AutoDist(strategy_builder=...)``, ``stratagem run
--strategy``, ``stratagem plan --strategy``): a builder, a Strategy, a builder name or a
strategy file path."""

from __future__ import annotations

import os
from pathlib import Path

from stratagem.errors import StrategyError
from stratagem.strategy.builders import Auto, StrategyBuilder, builder_from_name
from stratagem.strategy.schema import Strategy

STRATEGY_SUFFIXES = (".json", ".yml", ".yaml")


def is_strategy_path(value: str) -> bool:
    """Whether a string argument names a strategy file (an existing file, a strategy
    suffix or a path separator) rather than a builder name."""
    return (Path(value).is_file() or Path(value).suffix in STRATEGY_SUFFIXES
            or os.sep in value)


def resolve_builder(value: StrategyBuilder | Strategy | str | None) -> StrategyBuilder:
    """The builder for ``value`` (None: :class:`Auto`, the planner's choice, which is at
    least as fast as the best built-in on bench/auto_strategy.py). A strategy file is
    loaded (and checked) here; an unknown name or a missing file raises
    :class:`StrategyError`."""
    if value is None:
        return Auto()
    if isinstance(value, str):
        if not is_strategy_path(value):
            return builder_from_name(value)  # raises StrategyError listing the known names
        if not Path(value).is_file():
            raise StrategyError(f"strategy file {value!r} not found", where="--strategy",
                                fix="pass an existing strategy file, or a builder name")
        return Strategy.load(value)
    if not hasattr(value, "build"):
        raise StrategyError(f"{value!r} is not a strategy builder",
                            fix="pass a builder such as sg.strategy.AllReduce(), a Strategy, "
                                "a builder name or a strategy file path")
    return value
