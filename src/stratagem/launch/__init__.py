"""Launching workers: local torchrun, multi-node fan-out, supervision, the env contract.

``stratagem run`` calls :func:`run_job`; :func:`plan_job` gives the plan without starting it.
"""

from stratagem.launch.job import AgentLaunch, JobOptions, LaunchPlan
from stratagem.launch.launcher import plan_job, run_job

__all__ = ["AgentLaunch", "JobOptions", "LaunchPlan", "plan_job", "run_job"]
