"""Comparing a saved training state (model + optimizer state dicts) with a reference."""

from __future__ import annotations

from typing import Any

import torch


def assert_state_close(got: dict[str, Any], want: dict[str, Any], *, rtol: float = 1e-5,
                       atol: float = 1e-7) -> None:
    """Every model tensor and every optimizer state entry of ``want`` equals ``got``'s."""
    for k, v in want["model"].items():
        torch.testing.assert_close(got["model"][k], v, rtol=rtol, atol=atol, msg=k)
    for pid, state in want["optimizer"]["state"].items():
        for k, v in state.items():
            torch.testing.assert_close(got["optimizer"]["state"][pid][k], v, rtol=rtol,
                                       atol=atol, msg=f"{pid}.{k}")
