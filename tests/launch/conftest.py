"""Fixtures for launcher tests."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def script(tmp_path: Path) -> Callable[[str, str], Path]:
    """``script(name, source)`` writes a training script and returns its path."""

    def write(name: str, source: str) -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write
