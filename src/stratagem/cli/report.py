"""``stratagem report RUN_DIR``: PNG plots and an HTML summary page from a run's metrics
file (docs/reference/metrics.md), so a run can be looked at rather than read."""

from __future__ import annotations

import html
import math
import statistics
from pathlib import Path
from typing import Any

from stratagem.errors import StratagemError
from stratagem.observe import read_metrics

PLOTS = ("loss_throughput", "batch_lr", "efficiency_noise", "communication")
PLOT_LIMIT = 1e100  # larger magnitudes (a diverged loss of 1e308) are left out of the plots


def _number(value: Any) -> float | None:
    """``value`` as a plottable float: a finite number within :data:`PLOT_LIMIT`, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer beyond float range
        return None
    return number if math.isfinite(number) and abs(number) <= PLOT_LIMIT else None


def _x(record: dict[str, Any]) -> float | None:
    x = _number(record.get("elapsed_s"))
    return x if x is not None else _number(record.get("step", 0))


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(elapsed seconds, values) of the records that have a plottable ``key`` and time."""
    xs, ys = [], []
    for r in records:
        x, value = _x(r), _number(r.get(key))
        if x is not None and value is not None:
            xs.append(x)
            ys.append(value)
    return xs, ys


def _smooth(values: list[float], window: int = 9) -> list[float]:
    """Running median (step throughput is noisy; the median keeps its level)."""
    half = window // 2
    return [statistics.median(values[max(0, i - half):i + half + 1])
            for i in range(len(values))]


def _comm_share(records: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        x, step, wait = _x(r), _number(r.get("step_time_s")), _number(r.get("comm_wait_s"))
        if x is not None and step is not None and wait is not None and step > 0:
            xs.append(x)
            ys.append(100.0 * min(max(wait / step, 0.0), 1.0))
    return xs, ys


Series = tuple[list[float], list[float]]
MISSING_HINT = {"loss (running median of 9)": "ad.log_metrics(loss=...) records it"}


def _planning_spans(records: list[dict[str, Any]]) -> list[tuple[float, float, float]]:
    """(start, end, seconds) of each Auto planning (calibration, link probe, trial steps):
    the step whose record carries ``auto_plan_s`` took that long more than a step."""
    out = []
    for r in records:
        plan = r.get("auto_plan_s")
        end = r.get("elapsed_s")
        if isinstance(plan, (int, float)) and isinstance(end, (int, float)) and plan > 0:
            length = float(r.get("step_time_s") or plan)
            out.append((max(float(end) - max(length, plan), 0.0), float(end), float(plan)))
    return out


def panel(ax: Any, left: Series, right: Series, labels: tuple[str, str], title: str,
          smooth_left: bool = False, spans: list[tuple[float, float, float]] | None = None
          ) -> bool:
    """Two series on one time axis (left and right scales); False when both are empty.

    A series with no values leaves no axis behind: the other takes the left axis and the
    title says what was not recorded (no note drawn over the data). ``spans``: Auto's
    planning, shaded and named in the legend (the gap in the steps it explains)."""
    colours = ["tab:blue", "tab:orange"]
    missing = [label for (xs, _), label in zip((left, right), labels, strict=True) if not xs]
    if not left[0] and right[0]:  # the right series moves onto the left axis
        left, right, labels, smooth_left = right, ([], []), (labels[1], labels[0]), False
        colours.reverse()
    handles = []
    if left[0]:
        if smooth_left and len(left[1]) > 9:  # raw values faint, running median bold
            ax.plot(*left, color=colours[0], alpha=0.25, linewidth=0.8)
            handles += ax.plot(left[0], _smooth(left[1]), color=colours[0], label=labels[0])
        else:
            handles += ax.plot(*left, color=colours[0], label=labels[0],
                               drawstyle="steps-post")
        ax.set_ylabel(labels[0], color=colours[0])
    else:
        ax.set_yticks([])
        ax.text(0.5, 0.5, "nothing recorded", transform=ax.transAxes, ha="center",
                color="gray")
    if right[0]:
        other = ax.twinx()
        handles += other.plot(*right, color=colours[1], label=labels[1], linestyle="--",
                              drawstyle="steps-post")
        other.set_ylabel(labels[1], color=colours[1])
    for i, (start, end, seconds) in enumerate(spans or []):
        handles.append(ax.axvspan(start, end, color="tab:gray", alpha=0.2, linewidth=0,
                                  label=None if i else
                                  f"Auto planning ({seconds:.1f} s): calibration, link "
                                  "probe, trial steps; no steps run"))
    if spans:
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16),
                  fontsize=8, frameon=False, ncol=2)  # below the axes: over no data
    if missing and len(missing) < 2:
        hint = MISSING_HINT.get(missing[0])
        title += f"\n(no {missing[0].split(' (')[0]} recorded" + (f": {hint})" if hint
                                                                  else ")")
    ax.set_xlabel("seconds since start")
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    return bool(left[0] or right[0])


def render(run_dir: Path, out: Path | None = None) -> Path:
    """Write the plots and ``report.html`` to ``out`` (default ``RUN_DIR/report``); returns
    the HTML page's path."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise StratagemError("stratagem report needs matplotlib", where="stratagem report",
                             fix="pip install 'stratagem[plot]'") from None
    records = read_metrics(Path(run_dir))
    if not records:
        raise StratagemError("the metrics file has no steps", where=str(run_dir),
                             fix="report a run that took at least one optimizer step")
    base = Path(run_dir) if Path(run_dir).is_dir() else Path(run_dir).parent
    out = Path(out) if out is not None else base / "report"
    try:
        return _render(plt, records, run_dir, out)
    except OSError as exc:  # unwritable or full --out
        raise StratagemError(f"cannot write the report: {exc.strerror or exc}",
                             where=str(out), fix="pass --out DIR, a directory you can "
                                                 "write") from None


def _render(plt: Any, records: list[dict[str, Any]], run_dir: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    xs, rate = _series(records, "samples_per_s")
    panels = {
        "loss_throughput": (_series(records, "loss"), (xs, _smooth(rate)),
                            ("loss (running median of 9)", "samples/s (running median)"),
                            "Loss and throughput"),
        "batch_lr": (_series(records, "batch_size"), _series(records, "lr_factor"),
                     ("global batch size", "LR factor"), "Batch size and learning rate"),
        "efficiency_noise": (_series(records, "efficiency"), _series(records, "noise_scale"),
                             ("statistical efficiency", "gradient noise scale"),
                             "Efficiency and noise scale"),
        "communication": (_comm_share(records), _series(records, "allreduce_bytes"),
                          ("communication wait, % of step", "all-reduce bytes per step"),
                          "Communication share of the step"),
    }
    spans = _planning_spans(records)
    for name, (left, right, labels, title) in panels.items():
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        panel(ax, left, right, labels, title, smooth_left=name == "loss_throughput",
              spans=spans if name == "loss_throughput" else None)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png")
        plt.close(fig)
    page = out / "report.html"
    page.write_text(_html(run_dir, records), encoding="utf-8")
    return page


def _html(run_dir: Path, records: list[dict[str, Any]]) -> str:
    last = records[-1]
    _, rate = _series(records, "samples_per_s")
    losses = _series(records, "loss")[1]
    rows = [("steps", str(last.get("step", len(records)))),
            ("epochs", str(int(_number(last.get("epoch")) or 0) + 1)),
            ("wall time", f"{_x(last) or 0.0:.1f} s"),
            ("median samples/s", f"{statistics.median(rate):.4g}" if rate else "-"),
            ("replicas", str(last.get("replicas", "-"))),
            ("final batch size", str(last.get("batch_size", "-"))),
            ("adaptive", "yes" if last.get("adaptive") else "no")]
    if losses:
        rows.append(("loss first / last", f"{losses[0]:.4g} / {losses[-1]:.4g}"))
    table = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                      for k, v in rows)
    images = "\n".join(f'<figure><img src="{name}.png" alt="{name}"></figure>'
                       for name in PLOTS)
    return (f"<!doctype html>\n<html><head><meta charset='utf-8'><title>Stratagem run "
            f"{html.escape(str(run_dir))}</title><style>body{{font-family:sans-serif;"
            f"margin:2em}}th{{text-align:left;padding-right:1em}}img{{max-width:100%}}"
            f"</style></head><body>\n<h1>Run {html.escape(str(run_dir))}</h1>\n"
            f"<table>\n{table}\n</table>\n{images}\n</body></html>\n")
