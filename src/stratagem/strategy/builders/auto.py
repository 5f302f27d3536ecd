"""Auto: the strategy chosen by the planner's cost model and search (stratagem.planner).

This builder is the name and the options; the planner, a layer above, registers the
function that does the work (:func:`set_planner`) when it is imported -- as the runtime
registers compressor implementations under names validated here. ``AutoDist`` and
``stratagem plan`` import the planner, so ``strategy_builder="Auto"`` works there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stratagem.analysis.profile import ModelProfile
from stratagem.errors import StrategyError
from stratagem.resource import ResourceSpec
from stratagem.strategy.builders.base import register
from stratagem.strategy.compressors import check_compressor
from stratagem.strategy.schema import Strategy

_PLANNER: list[Callable[[Auto, ModelProfile, ResourceSpec], Strategy]] = []


def set_planner(fn: Callable[[Auto, ModelProfile, ResourceSpec], Strategy]) -> None:
    """Install the planner that :meth:`Auto.build` calls (stratagem.planner does this)."""
    _PLANNER[:] = [fn]


@register("Auto")
@dataclass(frozen=True)
class Auto:
    """Per parameter, the synchronizer, grouping, shards and compressor of least predicted
    step time (docs/concepts/auto-strategy.md).

    ``compressors``: what groups may use; lossy ones (fp16, bf16, powersgd) change the
    numbers, so only ``none`` unless you allow them. ``rows``: parameters may go to
    parameter servers as rows (needs an optimizer with a sparse rule: SGD, Adagrad, Adam,
    AdamW without weight decay on them). ``detect_sparse``: measured row-sparse gradients
    count as sparse, not only declared ones. ``batch_size``: samples per worker when no
    sample batch is given to calibrate with. Inside a job with a sample batch (AutoDist
    plans in every worker): ``probe`` measures the links instead of trusting the spec's
    figures, and ``trials`` candidates (the best predicted, plus the best built-in) are
    timed for a few real steps and the fastest kept; 0 turns trials off. ``servers``:
    parameter servers may be used; False keeps to all-reduce strategies (what an
    in-process elastic job can rescale; AutoDist sets it there). ``max_zero_stage``: the
    highest ZeRO stage Auto may shard with under a memory limit (1-3); an in-process
    elastic job gets 2 (AutoDist sets it there): its stage-3 rescale gathers the whole
    parameters and optimizer state on every worker, more than ZeRO-2's step peak, so a
    model that needs stage 3 to fit could not rescale.
    """

    compressors: tuple[str, ...] = ("none",)
    rows: bool = True
    detect_sparse: bool = True
    batch_size: int = 32
    probe: bool = True
    trials: int = 3
    servers: bool = True
    max_zero_stage: int = 3

    def __post_init__(self) -> None:
        if not self.compressors:
            raise StrategyError("Auto needs at least one compressor",
                                fix='pass compressors=("none",)')
        for c in self.compressors:
            check_compressor(c)
        if not isinstance(self.trials, int) or self.trials < 0:
            raise StrategyError(f"trials must be an integer >= 0, got {self.trials!r}",
                                fix="pass the number of candidates to time, e.g. "
                                    "trials=3 (0: none)")
        if self.max_zero_stage not in (1, 2, 3) or isinstance(self.max_zero_stage, bool):
            raise StrategyError(
                f"max_zero_stage must be 1, 2 or 3, got {self.max_zero_stage!r}",
                fix="pass the highest ZeRO stage Auto may use under a memory limit, e.g. "
                    "max_zero_stage=2")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise StrategyError(f"batch_size must be an integer >= 1, got {self.batch_size!r}",
                                fix="pass the samples per worker, e.g. batch_size=32")

    def build(self, profile: ModelProfile, spec: ResourceSpec) -> Strategy:
        if not _PLANNER:
            raise StrategyError("the Auto builder needs the planner, which is not loaded",
                                where="strategy builder Auto",
                                fix="import stratagem.planner (AutoDist and `stratagem plan` "
                                    "do) before building")
        return _PLANNER[0](self, profile, spec)
