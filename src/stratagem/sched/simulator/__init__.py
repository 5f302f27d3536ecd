"""A deterministic, trace-driven simulator of a GPU cluster under a scheduling policy.

``profile`` (application profiles, from the Pollux data set's format or a Stratagem job's
hints) and ``interpolate`` (step times of unmeasured placements); ``workload`` (job
arrivals); ``job`` (one job's progress, batch size and restarts); ``engine`` (the loop);
``report`` (metrics, CSV/JSON, plots, the summary table). See docs/concepts/scheduling.md.
"""
