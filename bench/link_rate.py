#!/usr/bin/env python3
"""Measure what a virtual cluster's shaped link delivers between node 0 and node 1.

Three bounded measurements on a fresh 2-node cluster (tools/vcluster.py; needs root):
  * TCP goodput node 0 -> node 1 (Python sender/receiver, --mb MB or --seconds, whichever first);
  * TCP round-trip time (1-byte ping-pong, TCP_NODELAY), which shows the emulated delay;
  * a gloo all_reduce of a --mb MB float32 tensor, one process per node (tcp:// init on node 0).
Prints Gbit/s and writes JSON to bench/results/link_rate.json.

    sudo python bench/link_rate.py [--bandwidth 1gbit] [--delay 0.1ms] [--mb 100]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import vcluster  # noqa: E402

PORT_TCP, PORT_RTT, PORT_GLOO = 5201, 5202, 29533
TIMEOUT = 120  # seconds any one helper may take
# tbf counts whole Ethernet frames; TCP goodput is what is left after the headers.
FRAME_BYTES = 1500 + 14  # MTU + Ethernet header
PAYLOAD_BYTES = 1500 - 20 - 32  # minus IPv4 and TCP-with-timestamps headers


# -- helpers run inside the nodes -------------------------------------------------------------
def _listen(port: int) -> socket.socket:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(1)
    srv.settimeout(TIMEOUT)
    print("ready", flush=True)
    return srv


def _connect(host: str, port: int) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection((host, port), timeout=TIMEOUT)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def role_recv(args: argparse.Namespace) -> None:
    """Count bytes until the sender closes; time from first to last byte."""
    conn, _ = _listen(args.port).accept()
    buf, total, first = bytearray(1 << 20), 0, 0.0
    while n := conn.recv_into(buf):
        if not total:
            first = time.perf_counter()
        total += n
    seconds = time.perf_counter() - first
    print(json.dumps({"bytes": total, "seconds": seconds,
                      "gbit_s": total * 8 / seconds / 1e9}), flush=True)


def role_send(args: argparse.Namespace) -> None:
    conn, chunk = _connect(args.host, args.port), bytes(1 << 20)
    start, sent = time.perf_counter(), 0
    while sent < args.mb * 1e6 and time.perf_counter() - start < args.seconds:
        conn.sendall(chunk)
        sent += len(chunk)
    conn.close()


def role_echo(args: argparse.Namespace) -> None:
    conn, _ = _listen(args.port).accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(1):
        conn.sendall(data)


def role_ping(args: argparse.Namespace) -> None:
    conn = _connect(args.host, args.port)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(args.count):
        t = time.perf_counter()
        conn.sendall(b"x")
        conn.recv(1)
        rtts.append((time.perf_counter() - t) * 1e6)
    conn.close()
    print(json.dumps({"count": len(rtts), "median_us": statistics.median(rtts),
                      "min_us": min(rtts)}), flush=True)


def role_allreduce(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.host}:{args.port}",
                            rank=args.rank, world_size=2)
    x = torch.ones(int(args.mb * 1e6) // 4)
    dist.all_reduce(torch.ones(1024))
    dist.all_reduce(x)  # warm-up at full size: connections and buffers
    times = []
    for _ in range(args.iters):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t)
    dist.destroy_process_group()
    if args.rank == 0:
        nbytes = x.numel() * 4
        best = statistics.median(times)
        algbw = nbytes * 8 / best / 1e9
        print(json.dumps({"bytes": nbytes, "iters": len(times), "seconds": times,
                          "median_s": best, "algbw_gbit_s": algbw,
                          "busbw_gbit_s": algbw * 2 * (2 - 1) / 2}), flush=True)


# -- driver -----------------------------------------------------------------------------------
def _helper(vc: vcluster.VirtualCluster, node: int, role: str, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, str(Path(__file__).resolve()), "--role", role, *extra]
    return vc.run(node, argv, stdout=subprocess.PIPE, text=True)


def _last_json(proc: subprocess.Popen) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=TIMEOUT)
    if proc.returncode:
        raise RuntimeError(f"helper failed (exit {proc.returncode}): {out}")
    return json.loads(out.strip().splitlines()[-1])


def _pair(vc: vcluster.VirtualCluster, server: list[str], client: list[str],
          report: str) -> dict[str, Any]:
    """Start the server on node 1, wait for 'ready', run the client on node 0; return the
    JSON that ``report`` ("server" or "client") prints."""
    srv = _helper(vc, 1, *server)
    assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
    cli = _helper(vc, 0, *client)
    result = _last_json(srv if report == "server" else cli)
    for proc in (srv, cli):
        proc.wait(timeout=TIMEOUT)
    return result


def measure(args: argparse.Namespace) -> dict[str, Any]:
    bandwidth = None if args.bandwidth == "none" else args.bandwidth
    delay = None if args.delay == "none" else args.delay
    with vcluster.VirtualCluster(2, bandwidth=bandwidth, delay=delay, prefix="sgbench") as vc:
        peer = vc.addresses[1]
        common = ["--port", str(PORT_TCP), "--host", peer]
        tcp = _pair(vc, ["recv", *common],
                    ["send", *common, "--mb", str(args.mb), "--seconds", str(args.seconds)],
                    report="server")
        common = ["--port", str(PORT_RTT), "--host", peer]
        rtt = _pair(vc, ["echo", *common], ["ping", *common, "--count", "1000"],
                    report="client")
        gloo = ["--host", vc.addresses[0], "--port", str(PORT_GLOO), "--mb", str(args.mb),
                "--iters", str(args.iters)]
        ranks = [_helper(vc, r, "allreduce", *gloo, "--rank", str(r)) for r in (0, 1)]
        allreduce = _last_json(ranks[0])
        ranks[1].wait(timeout=TIMEOUT)
        qdisc = subprocess.run(["tc", "-n", vc.namespace(0), "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout.strip()
        rate = vc.rate_bps
        return {
            "config": {"bandwidth": args.bandwidth, "delay": args.delay, "mb": args.mb,
                       "delay_applied": vc.delay_applied, "qdisc_node0_eth0": qdisc},
            "host": {"kernel": platform.release(), "cpus": os.cpu_count()},
            "expected_tcp_goodput_gbit_s":
                None if rate is None else rate / 1e9 * PAYLOAD_BYTES / FRAME_BYTES,
            "tcp": tcp, "rtt": rtt, "allreduce": allreduce,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bandwidth", default="1gbit", help="per link, tc units, or 'none'")
    p.add_argument("--delay", default="0.1ms", help="one-way per link, or 'none'")
    p.add_argument("--mb", type=float, default=100, help="MB sent by TCP and all-reduced")
    p.add_argument("--seconds", type=float, default=10, help="cap on the TCP transfer")
    p.add_argument("--iters", type=int, default=3, help="timed all_reduce iterations")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "link_rate.json"))
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--host", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role:
        roles = {"recv": role_recv, "send": role_send, "echo": role_echo, "ping": role_ping,
                 "allreduce": role_allreduce}
        roles[args.role](args)
        return 0
    ok, reason = vcluster.VirtualCluster.available()
    if not ok:
        print(f"link_rate: {reason}", file=sys.stderr)
        return 1
    result = measure(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    ar = result["allreduce"]
    print(f"link {args.bandwidth}, delay {args.delay} per link"
          f"{'' if result['config']['delay_applied'] else ' (NOT applied: no netem)'}")
    print(f"  TCP goodput node0->node1: {result['tcp']['gbit_s']:.3f} Gbit/s "
          f"({result['tcp']['bytes'] / 1e6:.0f} MB in {result['tcp']['seconds']:.2f} s; "
          f"expected {result['expected_tcp_goodput_gbit_s'] or float('nan'):.3f})")
    print(f"  TCP RTT (1 byte): median {result['rtt']['median_us']:.0f} us, "
          f"min {result['rtt']['min_us']:.0f} us")
    print(f"  gloo all_reduce {ar['bytes'] / 1e6:.0f} MB x2 ranks: median {ar['median_s']:.3f} s, "
          f"algbw {ar['algbw_gbit_s']:.3f} Gbit/s, busbw {ar['busbw_gbit_s']:.3f} Gbit/s")
    print(f"  -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
