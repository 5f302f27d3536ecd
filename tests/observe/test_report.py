"""``stratagem report``: the plots exist, are PNGs and show the data; the HTML page links
them and summarises the run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")
import matplotlib.image as mpimg  # noqa: E402

from stratagem.cli import main  # noqa: E402
from stratagem.cli.report import PLOTS, render  # noqa: E402

BLUE = np.array([0x1F, 0x77, 0xB4]) / 255  # tab:blue, the left series
ORANGE = np.array([0xFF, 0x7F, 0x0E]) / 255  # tab:orange, the right series


def _pixels_of(png: Path, colour: np.ndarray) -> int:
    image = mpimg.imread(png)[..., :3]
    return int((np.abs(image - colour).max(axis=-1) < 0.02).sum())


def _write_run(directory: Path, steps: int = 40) -> None:
    directory.mkdir(parents=True)
    with open(directory / "metrics.jsonl", "w") as fh:
        for i in range(1, steps + 1):
            batch = 32 if i <= steps // 2 else 64
            fh.write(json.dumps({
                "step": i, "epoch": (i - 1) // 10, "elapsed_s": 0.1 * i, "time": 1e9 + i,
                "batch_size": batch, "replicas": 2, "lr_factor": batch / 32,
                "adaptive": True, "loss": 10.0 / i, "samples_per_s": 1000.0 + i,
                "step_time_s": 0.05, "comm_wait_s": 0.01, "allreduce_bytes": 4096.0,
                "efficiency": 1.0 if batch == 32 else 0.8, "noise_scale": 100.0}) + "\n")


def test_plots_and_page_from_a_known_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _write_run(run)
    page = render(run)
    assert page == run / "report" / "report.html"
    for name in PLOTS:
        png = run / "report" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # Both series were drawn: pixels of each line's colour (not just axes and text).
        assert _pixels_of(png, BLUE) > 100, name
        assert _pixels_of(png, ORANGE) > 100, name
    text = page.read_text()
    assert all(f'src="{name}.png"' in text for name in PLOTS)
    assert "<td>40</td>" in text and "10 / 0.25" in text and "<td>4</td>" in text


def test_a_run_without_loss_says_so_instead_of_drawing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(
        {"step": 1, "elapsed_s": 0.1, "batch_size": 8, "lr_factor": 1.0}) + "\n")
    render(run)
    assert _pixels_of(run / "report" / "loss_throughput.png", BLUE) == 0


def test_cli_report_and_missing_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                    ) -> None:
    run = tmp_path / "run"
    _write_run(run, steps=5)
    assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "report.html").is_file()
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "no metrics file" in capsys.readouterr().err


def _figure(records: list[dict]) -> tuple:  # noqa: ANN001
    import matplotlib.pyplot as plt

    from stratagem.cli.report import _planning_spans, _series, _smooth, panel

    xs, rate = _series(records, "samples_per_s")
    fig, ax = plt.subplots()
    panel(ax, _series(records, "loss"), (xs, _smooth(rate)),
          ("loss (running median of 9)", "samples/s (running median)"),
          "Loss and throughput", smooth_left=True, spans=_planning_spans(records))
    return fig, ax


def test_no_loss_leaves_no_note_over_the_line_and_no_unlabelled_axis() -> None:
    """Issue 49: "no loss recorded" was drawn across the throughput line, and the empty
    loss axis stayed unlabelled. The throughput takes the labelled left axis; the title
    says the loss is missing and how to record it."""
    records = [{"step": i, "elapsed_s": 0.1 * i, "samples_per_s": 500.0 + i}
               for i in range(1, 30)]
    fig, ax = _figure(records)
    assert len(fig.axes) == 1  # no second, empty scale
    assert ax.get_ylabel() == "samples/s (running median)"
    assert [t.get_text() for t in ax.texts] == []  # nothing drawn over the data
    assert "no loss recorded" in ax.get_title() and "log_metrics(loss=" in ax.get_title()
    assert max(ax.lines[-1].get_ydata()) > 500


def test_auto_planning_gap_is_shaded_and_named() -> None:
    """Issue 49: an Auto run has no steps while it plans; the plot says why."""
    records = [{"step": 1, "elapsed_s": 6.0, "step_time_s": 5.5, "auto_plan_s": 5.2,
                "samples_per_s": 10.0, "loss": 1.0}]
    records += [{"step": i, "elapsed_s": 6.0 + 0.1 * i, "samples_per_s": 900.0,
                 "loss": 1.0 / i} for i in range(2, 30)]
    fig, ax = _figure(records)
    (span,) = [p for p in ax.patches if p.get_label().startswith("Auto planning")]
    x0, x1 = span.get_x(), span.get_x() + span.get_width()
    assert (x0, x1) == pytest.approx((0.5, 6.0))
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(t.startswith("Auto planning (5.2 s)") for t in legend)


def _record(i: int, **values: object) -> str:
    record = {"step": i, "elapsed_s": 0.1 * i, "loss": 1.0, "samples_per_s": 10.0,
              "step_time_s": 0.1, "comm_wait_s": 0.01, "batch_size": 8}
    record.update(values)
    return json.dumps(record)


@pytest.mark.parametrize(("name", "content", "problem"), [
    ("non-utf8", b"\xff\xfe" + _record(1).encode() + b"\n" + _record(2).encode() + b"\n",
     "line 1 is not a metrics record"),
    ("deep", ('{"a":' * 5000 + "1" + "}" * 5000 + "\n" + _record(2) + "\n").encode(),
     "line 1 is not a metrics record"),
    ("long", (_record(1, note="x" * 70_000) + "\n" + _record(2) + "\n").encode(),
     "line 1 is not a metrics record (line longer than"),
])
def test_hostile_metrics_files_are_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             name: str, content: bytes, problem: str) -> None:
    run = tmp_path / name
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(content)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert problem in err and "Traceback" not in err and len(err) < 2000


def test_extreme_and_odd_values_are_left_out_of_the_plots(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A diverged loss of 1e308, float-max times, zero step times and strings where numbers
    belong: the report is drawn from what can be drawn."""
    run = tmp_path / "odd"
    run.mkdir()
    lines = [_record(i, loss=1e308 if i % 2 else 2.0) for i in range(1, 20)]
    lines += [_record(20, elapsed_s=1.7976931348623157e308, samples_per_s=1e308)]
    lines += [_record(21, step_time_s=0.0, elapsed_s="y", loss="abc", epoch="z")]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["report", str(run)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "Warning" not in captured.err
    page = (run / "report" / "report.html").read_text()
    assert "<td>2 / 1</td>" in page  # the plottable losses only (1e308 and "abc" left out)
    assert _pixels_of(run / "report" / "loss_throughput.png", BLUE) > 100


def test_unwritable_out_is_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_run(tmp_path / "run")
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["report", str(tmp_path / "run"), "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert "cannot write the report" in err and "--out" in err and "Traceback" not in err
