"""Builder protocol and registry: builders are pure ModelProfile × ResourceSpec → Strategy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from stratagem.analysis.profile import ModelProfile
from stratagem.errors import StrategyError
from stratagem.resource import ResourceSpec
from stratagem.strategy.schema import Strategy


@runtime_checkable
class StrategyBuilder(Protocol):
    """Anything with ``build(profile, spec) -> Strategy``; a Strategy builds itself."""

    def build(self, profile: ModelProfile, spec: ResourceSpec) -> Strategy: ...


_REGISTRY: dict[str, Callable[[], StrategyBuilder]] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make a builder constructible by name (``--strategy NAME``)."""

    def deco(cls: type) -> type:
        _REGISTRY[name] = cls
        return cls

    return deco


def builder_names() -> list[str]:
    return sorted(_REGISTRY)


def builder_from_name(name: str) -> StrategyBuilder:
    """A builder with default settings from its registered name (case-insensitive)."""
    for key, cls in _REGISTRY.items():
        if key.lower() == name.lower():
            return cls()
    raise StrategyError(f"unknown strategy builder {name!r}",
                        fix=f"use one of {', '.join(builder_names())}, or a strategy file path")


def smallest_divisor(n: int) -> int:
    """Smallest divisor >= 2 of ``n`` (``n`` itself if prime, 1 for n <= 1).

    AutoDist's rule for how many parts a partitioned all-reduce splits an axis into.
    """
    for i in range(2, n):
        if n % i == 0:
            return i
    return max(n, 1)
