"""What a run shows and records: the metrics file and the progress display.

Low in the stack (it knows no model or loader): the adaptive loop feeds it plain numbers.
"""

from stratagem.observe.logs import logger, redirect_to_log_dir
from stratagem.observe.metrics import METRICS_FILE, MetricsFile, read_metrics
from stratagem.observe.progress import ProgressDisplay, ProgressFields

__all__ = ["METRICS_FILE", "MetricsFile", "ProgressDisplay", "ProgressFields", "logger",
           "read_metrics", "redirect_to_log_dir"]
