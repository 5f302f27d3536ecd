"""The ``stratagem`` command: a small dispatcher, one function per subcommand.

To add a subcommand, write ``add_<name>_parser(subparsers)`` that registers its options and
sets ``handler=cmd_<name>``, and ``cmd_<name>(args) -> int``; append the former to
``SUBCOMMANDS``. Keep the work itself in the subsystem's package, not here.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from stratagem.errors import StratagemError

EXIT_USAGE = 2


# -- run ------------------------------------------------------------------------------------
def add_run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", allow_abbrev=False,
        help="launch a training script on this machine or on a resource spec's nodes",
        description="Start one worker process per replica through torch elastic (torchrun): "
                    "on this machine, or on every node of --resource-spec (remote nodes "
                    "through ssh or --remote-shell). Stops every worker on the first "
                    "failure, Ctrl-C or SIGTERM; with --max-restarts, starts a failed job "
                    "again from its newest checkpoint.")
    p.add_argument("--resource-spec", metavar="FILE",
                   help="YAML resource spec (default: this machine alone)")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="worker processes on this machine (default: the spec's worker count, "
                        "or one per GPU, or 1)")
    p.add_argument("--strategy", metavar="NAME|FILE",
                   help="strategy builder name or strategy file; overrides the script's")
    p.add_argument("--remote-shell", metavar="TEMPLATE",
                   help="command prefix that runs a command on node {address}, e.g. "
                        "'docker exec {address}' (default: env STRATAGEM_REMOTE_SHELL, "
                        "else ssh from the spec)")
    p.add_argument("--rdzv-port", type=int, metavar="P",
                   help="rendezvous port on the chief (default: a free port when the chief "
                        "is this machine, else 29400)")
    p.add_argument("--job-id", metavar="ID",
                   help="job id (STRATAGEM_JOB_ID, torch elastic's rendezvous id; "
                        "default: random)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and each node's command, start nothing")
    p.add_argument("--run-dir", metavar="DIR",
                   help="where rank 0 writes metrics.jsonl (default: STRATAGEM_RUN_DIR, the "
                        "checkpoint directory, else $TMPDIR/stratagem-runs/JOB_ID)")
    p.add_argument("--log-dir", metavar="DIR",
                   help="write each rank's stdout/stderr to DIR/rank<R>.{stdout,stderr}.log; "
                        "the console then shows rank 0's only")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="rank 0 also writes every step's metrics as TensorBoard scalars to "
                        "DIR (needs the tensorboard package)")
    p.add_argument("--max-restarts", type=int, metavar="N",
                   help="restart the whole job up to N times after a worker, agent or node "
                        "fails, from its newest checkpoint, with exponential backoff "
                        "(default: 3 with a checkpoint directory, else 0: fail at once)")
    p.add_argument("--restart-backoff", type=float, default=1.0, metavar="SECONDS",
                   help="wait before the first restart; doubled after each failure that "
                        "made no new checkpoint, up to 30 s (default 1)")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="the job's checkpoint directory, shared by every node "
                        "(STRATAGEM_CHECKPOINT_DIR): saved on SIGTERM and periodically, "
                        "restored on every start")
    p.add_argument("--checkpoint-steps", type=int, metavar="K",
                   help="also save the job state every K training steps "
                        "(STRATAGEM_CHECKPOINT_STEPS): a killed worker costs at most K steps")
    p.add_argument("--checkpoint-seconds", type=float, metavar="T",
                   help="also save the job state at the first step after T seconds since "
                        "the last save (STRATAGEM_CHECKPOINT_SECONDS)")
    p.add_argument("--checkpoint-sync", action="store_true",
                   help="write periodic checkpoints synchronously, stalling training for the "
                        "whole write (default: in the background after an in-memory "
                        "snapshot; STRATAGEM_CHECKPOINT_ASYNC=0)")
    p.add_argument("--stop-grace", type=float, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, wait this long for the workers to finish the "
                        "save in flight and save the job state before killing them "
                        "(STRATAGEM_STOP_GRACE_S; default: twice the last save plus 10 s, "
                        "at least 30 s)")
    p.add_argument("--nnodes", metavar="MIN:MAX",
                   help="elastic node count (needs --resource-spec listing up to MAX nodes): "
                        "start on the reachable nodes if at least MIN are; when a node is "
                        "lost, continue on the survivors from the checkpoint; grow back when "
                        "it (or a node added to the spec) answers again")
    p.add_argument("--node-probe-seconds", type=float, default=10.0, metavar="SECONDS",
                   help="with --nnodes below MAX: how often to probe the missing nodes "
                        "(default 10)")
    level = p.add_mutually_exclusive_group()
    level.add_argument("-q", "--quiet", action="store_true",
                       help="only warnings and errors from Stratagem (STRATAGEM_LOG_LEVEL)")
    level.add_argument("-v", "--verbose", action="store_true",
                       help="Stratagem's debug messages too")
    p.add_argument("script", nargs="?", help="training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="arguments for the script")
    p.set_defaults(handler=cmd_run, parser=p)


def cmd_run(args: argparse.Namespace) -> int:
    from stratagem.launch import JobOptions, run_job

    if args.script is None:
        args.parser.error("the following argument is required: script")
    return run_job(JobOptions(
        script=args.script, script_args=tuple(args.script_args),
        resource_spec=args.resource_spec, nproc=args.nproc, strategy=args.strategy,
        remote_shell=args.remote_shell, rdzv_port=args.rdzv_port, job_id=args.job_id,
        dry_run=args.dry_run, run_dir=args.run_dir, log_dir=args.log_dir,
        log_level="WARNING" if args.quiet else "DEBUG" if args.verbose else None,
        tensorboard=args.tensorboard, max_restarts=args.max_restarts,
        restart_backoff=args.restart_backoff, checkpoint_dir=args.checkpoint_dir,
        checkpoint_steps=args.checkpoint_steps, checkpoint_seconds=args.checkpoint_seconds,
        checkpoint_sync=args.checkpoint_sync, stop_grace=args.stop_grace,
        nnodes=args.nnodes, node_probe_seconds=args.node_probe_seconds))


# -- plan -----------------------------------------------------------------------------------
def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="show the strategy and per-rank plan for a model, without training",
        description="Profile a model, build and validate its strategy for a resource spec, "
                    "and print it (optionally with rank 0's compiled plan); --out saves it "
                    "for hand editing.")
    p.add_argument("script", nargs="?", metavar="SCRIPT.py",
                   help="a training script: run until its ad.distribute(...), as rank 0 of "
                        "the spec's job without joining anything (or use --model)")
    p.add_argument("--model", metavar="MODULE:CALLABLE",
                   help="callable that returns the nn.Module, e.g. examples/models.py:mlp")
    p.add_argument("--resource-spec", metavar="FILE", help="YAML resource spec")
    p.add_argument("--nproc", type=int, metavar="N", help="workers on this machine (no spec)")
    p.add_argument("--strategy", metavar="NAME|FILE", help="builder name or strategy file")
    p.add_argument("--out", metavar="FILE", help="save the strategy (.json/.yaml)")
    p.add_argument("--show-plan", action="store_true", help="also print rank 0's plan")
    p.add_argument("--sample", metavar="MODULE:CALLABLE",
                   help="callable returning one worker's batch: the planner measures the "
                        "model on it (Auto, and predicted step times)")
    p.add_argument("--batch-size", type=int, metavar="N",
                   help="samples per worker when no --sample is given (default 32)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--picture", metavar="FILE.png",
                   help="also draw the strategy (parameters by size, coloured by synchronizer; "
                        ".png, .svg or .pdf; needs matplotlib)")
    p.set_defaults(handler=cmd_plan, parser=p)


def cmd_plan(args: argparse.Namespace) -> int:
    from stratagem.cli.plan import explain, explain_script

    if (args.script is None) == (args.model is None):
        args.parser.error("give a training script or --model MODULE:CALLABLE (one of them)")
    if args.script is not None:
        print(explain_script(args.script, args.resource_spec, args.strategy, args.nproc,
                             args.out, args.show_plan, as_json=args.json,
                             picture=args.picture))
        return 0
    print(explain(args.model, args.resource_spec, args.strategy, args.nproc, args.out,
                  args.show_plan, sample_target=args.sample, batch_size=args.batch_size,
                  as_json=args.json, picture=args.picture))
    return 0


# -- report ---------------------------------------------------------------------------------
def add_report_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report", help="plot a run's metrics file (PNG) and write an HTML summary page",
        description="Read RUN_DIR/metrics.jsonl (written by rank 0 of every run with a run "
                    "directory) and render loss and throughput, batch size and LR factor, "
                    "efficiency and noise scale, and the communication share of the step.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (or metrics file)")
    p.add_argument("--out", metavar="DIR", help="where to write (default: RUN_DIR/report)")
    p.set_defaults(handler=cmd_report, parser=p)


def cmd_report(args: argparse.Namespace) -> int:
    from stratagem.cli.report import render

    print(render(args.run_dir, args.out))
    return 0


# -- simulate (parser and handler in stratagem.cli.simulate) -----------------------------------
from stratagem.cli.service import add_service_parsers  # noqa: E402 - ditto
from stratagem.cli.simulate import add_simulate_parser  # noqa: E402 - light: imports on use

# -- dispatcher -----------------------------------------------------------------------------
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_run_parser,
                                                                   add_plan_parser,
                                                                   add_report_parser,
                                                                   add_simulate_parser,
                                                                   add_service_parsers]


def build_parser() -> argparse.ArgumentParser:
    from stratagem import __version__

    parser = argparse.ArgumentParser(
        prog="stratagem",
        description="Train a single-device PyTorch script across processes and machines.")
    parser.add_argument("--version", action="version", version=f"stratagem {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stratagem`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.handler(args))
    except StratagemError as exc:
        print(f"stratagem: error: {exc.render()}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("stratagem: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `stratagem ls | head`: the reader left; not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes at exit
        return 0
