"""The one registry of gradient compressor names, and the checks of their settings.

A strategy names a compressor per all-reduce synchronizer. Validation, the builders and
the runtime's plan compiler all read this registry; the runtime registers each compressor
implementation here when it defines it (:func:`stratagem.runtime.register_compressor`), so
a user's compressor is accepted everywhere as soon as it is registered. The built-in names
are registered here, below the runtime, so that a strategy can be validated without it.
"""

from __future__ import annotations

from collections.abc import Callable

from stratagem.errors import StrategyError

SettingsCheck = Callable[[int, bool, str], None]  # (powersgd_rank, sparse, where)


def _no_check(powersgd_rank: int, sparse: bool, where: str) -> None:
    """Compressors without settings accept any parameter."""


def _powersgd_check(powersgd_rank: int, sparse: bool, where: str) -> None:
    if powersgd_rank < 1:
        raise StrategyError(f"powersgd_rank must be >= 1, got {powersgd_rank}",
                            where=where, fix="use a small positive rank such as 1 or 4")
    if sparse:
        raise StrategyError("powersgd cannot compress a sparse embedding gradient",
                            where=where, fix="use compressor none, or a PS synchronizer")


_CHECKS: dict[str, SettingsCheck] = {
    "none": _no_check, "fp16": _no_check, "bf16": _no_check, "powersgd": _powersgd_check}


def register_compressor_name(name: str, check: SettingsCheck | None = None) -> None:
    """Accept ``name`` as a compressor (``check`` validates its settings; default none)."""
    if not name or not isinstance(name, str):
        raise StrategyError(f"invalid compressor name {name!r}", where="register_compressor",
                            fix="name it with a non-empty string")
    _CHECKS[name] = check or _CHECKS.get(name, _no_check)


def compressor_names() -> list[str]:
    """The registered compressor names, sorted."""
    return sorted(_CHECKS)


def check_compressor(name: str, powersgd_rank: int = 1, sparse: bool = False,
                     where: str | None = None) -> None:
    """Raise :class:`StrategyError` unless ``name`` is registered and its settings fit
    (``sparse``: the parameter has a sparse gradient; None: not known yet)."""
    check = _CHECKS.get(name)
    if check is None:
        raise StrategyError(f"unknown compressor {name!r}", where=where,
                            fix=f"use one of {', '.join(_CHECKS)}, or register "
                                "yours with stratagem.runtime.register_compressor")
    check(powersgd_rank, sparse, where or "compressor")
