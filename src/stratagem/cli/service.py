"""``stratagem submit|ls|logs|delete|cluster``: the cluster service from the command line.

Every command takes ``--dir`` (default ``$STRATAGEM_CLUSTER_DIR``, else
``~/.stratagem/cluster``): the cluster's working directory (state database, logs,
checkpoints, the control plane's address and token).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from stratagem import env
from stratagem.errors import StratagemError

ENV_DIR = env.CLUSTER_DIR


def default_dir() -> str:
    return env.cluster_dir() or str(Path.home() / ".stratagem" / "cluster")


def _dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=None, metavar="DIR",
                   help=f"cluster working directory (default: ${ENV_DIR} or "
                        "~/.stratagem/cluster)")


def _client(args: argparse.Namespace):
    from stratagem.service.api import ServiceClient

    return ServiceClient(args.dir or default_dir())


def cmd_submit(args: argparse.Namespace) -> int:
    print(f"submitted {_client(args).submit(args.job_file, replace=args.replace)}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    print(_client(args).table())
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from stratagem.service.store import FINAL

    client, offset, after = _client(args), 0, 0
    while True:
        got = client.logs(args.name, args.rank, offset, after)
        for event_id, t, text in got["events"]:
            print(f"[{time.strftime('%H:%M:%S', time.localtime(t))}] {text}")
            after = event_id
        sys.stdout.write(got["log"])
        sys.stdout.flush()
        offset = got["offset"]
        if not args.follow or (got["state"] in FINAL and not got["log"]):
            return 0
        time.sleep(1.0)


def cmd_delete(args: argparse.Namespace) -> int:
    was = _client(args).delete(args.name)
    print(f"{args.name}: {'deleting' if was not in ('succeeded', 'failed', 'deleted') else was}")
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    from stratagem.service import cluster

    d = args.dir or default_dir()
    if args.action == "up":
        rec = cluster.up(d, args.address, args.num_cpus, args.gpus, args.gpu_resource,
                         args.policy, args.interval, args.host, args.token_file,
                         args.node_cost, args.max_nodes, min_runtime=args.min_runtime)
        if rec.get("restarted"):
            print(f"scheduler restarted (pid {rec['scheduler_pid']}) on the running Ray at "
                  f"{rec['address']}; it takes over the jobs")
        else:
            print(f"cluster up: Ray at {rec['address']}, scheduler pid "
                  f"{rec['scheduler_pid']}, dir {Path(d).resolve()}")
    elif args.action == "drain":
        if not args.node:
            raise StratagemError("drain needs --node ID", where="stratagem cluster drain",
                                 fix="'stratagem cluster status' lists the node ids")
        moved = cluster.ServiceClient(d).drain(args.node)
        print(f"drained {args.node[:12]}: moved {', '.join(moved) or 'no jobs'}")
    elif args.action == "down":
        done = cluster.down(d, args.grace)
        print("cluster down: " + ", ".join(f"{k} {v}" for k, v in done.items()))
    else:
        info = cluster.status(d)
        print(f"Ray at {info['address']}; accelerator resource {info['gpu_resource']!r}")
        for n in info["nodes"]:
            res = ", ".join(f"{k}={v:g}" for k, v in sorted(n["resources"].items()))
            print(f"  node {n['id'][:12]} {n['ip']}: {res}"[:80])
    return 0


def _grace(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 3600:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r}: seconds from 0 to 3600")
    return value


def add_service_parsers(sub: argparse._SubParsersAction) -> None:
    """Register submit, ls, logs, delete and cluster."""
    p = sub.add_parser("submit", help="submit a job file to the cluster service")
    p.add_argument("job_file", help="YAML job file (docs/reference/cluster-service.md)")
    p.add_argument("--replace", action="store_true",
                   help="the name already ran: remove that run (events, logs, checkpoints "
                        "the service keeps) and start anew")
    _dir_arg(p)
    p.set_defaults(handler=cmd_submit)
    p = sub.add_parser("ls", help="list the cluster's jobs: state, replicas, batch, goodput")
    _dir_arg(p)
    p.set_defaults(handler=cmd_ls)
    p = sub.add_parser("logs", help="a job's events and its rank's output")
    p.add_argument("name")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    p.add_argument("--rank", type=int, default=0, help="which replica's output (default 0)")
    _dir_arg(p)
    p.set_defaults(handler=cmd_logs)
    p = sub.add_parser("delete", help="stop a job and remove it from the schedule")
    p.add_argument("name")
    _dir_arg(p)
    p.set_defaults(handler=cmd_delete)
    p = sub.add_parser("cluster", help="start, stop or show the Ray cluster and scheduler",
                       description="up: start a local Ray head (or use --address) and the "
                                   "scheduler; down: stop what up started; status: nodes; "
                                   "drain --node ID: checkpoint and move the jobs there.")
    p.add_argument("action", choices=("up", "down", "status", "drain"))
    p.add_argument("--node", help="drain: the node id (a preemption notice)")
    _dir_arg(p)
    p.add_argument("--address", help="existing Ray cluster (HOST:PORT) instead of a local one")
    p.add_argument("--num-cpus", type=int, help="local head's CPUs (default: all)")
    p.add_argument("--gpus", type=int, default=0,
                   help="local head's accelerators (fake ones with --gpu-resource)")
    p.add_argument("--gpu-resource", default="GPU",
                   help="Ray resource that counts as an accelerator (default GPU)")
    p.add_argument("--policy", default="pollux", help="pollux, tiresias, optimus or fifo")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between decisions")
    p.add_argument("--host", default="127.0.0.1",
                   help="control plane address (default loopback; others need --token-file)")
    p.add_argument("--token-file", help="file holding the control plane's token")
    p.add_argument("--node-cost", type=float,
                   help="autoscale: request nodes from Ray's autoscaler while one more adds "
                        "at least this much speedup (default: no autoscaling)")
    p.add_argument("--max-nodes", type=int, default=16, help="autoscale: at most this many")
    p.add_argument("--min-runtime", type=_grace, default=60.0,
                   help="up: seconds a job keeps the replicas it was given before the "
                        "policy may change them (default 60)")
    p.add_argument("--grace", type=_grace, default=5.0,
                   help="down: seconds the jobs and Ray get to stop (they checkpoint on "
                        "SIGTERM) before they are killed (default 5)")
    p.set_defaults(handler=cmd_cluster)
