"""Train a small CNN on synthetic CIFAR-like images, written against AdaptDL.

AdaptDL's pytorch-cifar example in miniature (no downloads): the imports are the only lines
that differ from the adaptdl version of this script. Test hooks: ``--out DIR`` logs the
sample ids and device of every step (``ids-<rank>-<pid>.jsonl``), each epoch's synchronized
statistics (``stats.jsonl``) and the final model (``final.pt``); ``--stop-at S`` parks every
replica inside global step S (file ``ready-<rank>`` holding its pid) until the file ``go``
appears, so that a SIGTERM sent meanwhile lands mid-epoch.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from cifar_models import Net, SyntheticImages
from torch.optim.lr_scheduler import MultiStepLR

import stratagem.adaptdl.torch as adl
from stratagem import adaptdl
from stratagem.adaptdl.checkpoint import State, load_state
from stratagem.adaptdl.torch.scaling_rules import AdaScale

try:
    from torch.utils.tensorboard import SummaryWriter
except ImportError:  # no tensorboard installed: keep the scalars in a JSON-lines file

    class SummaryWriter:
        def __init__(self, logdir):
            os.makedirs(logdir, exist_ok=True)
            self.f = open(os.path.join(logdir, f"scalars-{os.getpid()}.jsonl"), "a")  # noqa: SIM115

        def add_scalar(self, tag, value, step):
            self.f.write(json.dumps({"tag": tag, "value": float(value), "step": step}) + "\n")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()


parser = argparse.ArgumentParser(description="Small CNN on synthetic CIFAR-like images")
parser.add_argument("--bs", default=16, type=int, help="batch size")
parser.add_argument("--lr", default=0.1, type=float, help="learning rate")
parser.add_argument("--epochs", default=4, type=int, help="number of epochs")
parser.add_argument("--samples", default=96, type=int, help="training images")
parser.add_argument("--autoscale-bsz", dest="autoscale_bsz", default=False,
                    action="store_true", help="autoscale batchsize")
parser.add_argument("--out", default="/tmp/cifar-style", type=str, help="log directory")
parser.add_argument("--stop-at", dest="stop_at", default=0, type=int, help="park at step")
parser.add_argument("--workers", default=0, type=int, help="data loader worker processes")
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"


class StepCounter(State):
    """The global step, checkpointed AdaptDL-style (save/load on a file object)."""

    def __init__(self):
        super().__init__("step-counter")
        self.step = 0

    def save(self, fileobj):
        fileobj.write(json.dumps({"step": self.step}).encode())

    def load(self, fileobj):
        self.step = json.loads(fileobj.read().decode())["step"]


os.makedirs(args.out, exist_ok=True)
adaptdl.torch.init_process_group("nccl" if torch.cuda.is_available() else "gloo")

if adaptdl.env.replica_rank() == 0:
    trainset = SyntheticImages(args.samples, seed=1)
    trainloader = adl.AdaptiveDataLoader(trainset, batch_size=args.bs, shuffle=True,
                                         drop_last=True, num_workers=args.workers)
    dist.barrier()  # the other replicas wait for rank 0 (e.g. to download the data)
else:
    dist.barrier()
    trainset = SyntheticImages(args.samples, seed=1)
    trainloader = adl.AdaptiveDataLoader(trainset, batch_size=args.bs, shuffle=True,
                                         drop_last=True, num_workers=args.workers)

if args.autoscale_bsz:
    trainloader.autoscale_batch_size(256, local_bsz_bounds=(4, 64), gradient_accumulation=True)

validset = SyntheticImages(32, seed=2)
validloader = adl.AdaptiveDataLoader(validset, batch_size=16, shuffle=False)

torch.manual_seed(0)
net = Net().to(device)
criterion = nn.CrossEntropyLoss()
optimizer = optim.SGD([{"params": [param]} for param in net.parameters()],
                      lr=args.lr, momentum=0.9, weight_decay=5e-4)
lr_scheduler = MultiStepLR(optimizer, [2, 3], 0.1)
net = adl.AdaptiveDataParallel(net, optimizer, lr_scheduler, scaling_rule=AdaScale())

counter = StepCounter()
load_state(counter)
rank = adaptdl.env.replica_rank()
ids_log = open(os.path.join(args.out, f"ids-{rank}-{os.getpid()}.jsonl"), "a")  # noqa: SIM115


def park(step):
    with open(os.path.join(args.out, f"ready-{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(args.out, f"ready-{rank}.tmp"), os.path.join(args.out, f"ready-{rank}"))
    while not os.path.exists(os.path.join(args.out, "go")):
        time.sleep(0.01)


def train(epoch):
    net.train()
    stats = adl.Accumulator()
    for inputs, targets, ids in trainloader:
        inputs, targets = inputs.to(device), targets.to(device)
        counter.step += 1
        ids_log.write(json.dumps({"step": counter.step, "epoch": epoch, "rank": rank,
                                  "world": adaptdl.env.num_replicas(),
                                  "device": str(inputs.device), "ids": ids.tolist()}) + "\n")
        ids_log.flush()
        optimizer.zero_grad()
        outputs = net(inputs)
        loss = criterion(outputs, targets)
        loss.backward()
        if counter.step == args.stop_at:
            park(counter.step)
        optimizer.step()

        stats["loss_sum"] += loss.item() * targets.size(0)
        _, predicted = outputs.max(1)
        stats["total"] += targets.size(0)
        stats["correct"] += predicted.eq(targets).sum().item()

    trainloader.to_tensorboard(writer, epoch, tag_prefix="AdaptDL/Data/")
    net.to_tensorboard(writer, epoch, tag_prefix="AdaptDL/Model/")
    with stats.synchronized():
        stats["loss_avg"] = stats["loss_sum"] / stats["total"]
        stats["accuracy"] = stats["correct"] / stats["total"]
        writer.add_scalar("Loss/Train", stats["loss_avg"], epoch)
        writer.add_scalar("Accuracy/Train", stats["accuracy"], epoch)
        print("Train:", stats)
        if rank == 0:
            with open(os.path.join(args.out, "stats.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "phase": "train", **stats}) + "\n")


def valid(epoch):
    net.eval()
    stats = adl.Accumulator()
    with torch.no_grad():
        for inputs, targets, _ in validloader:
            inputs, targets = inputs.to(device), targets.to(device)
            outputs = net(inputs)
            loss = criterion(outputs, targets)

            stats["loss_sum"] += loss.item() * targets.size(0)
            _, predicted = outputs.max(1)
            stats["total"] += targets.size(0)
            stats["correct"] += predicted.eq(targets).sum().item()

    with stats.synchronized():
        stats["loss_avg"] = stats["loss_sum"] / stats["total"]
        stats["accuracy"] = stats["correct"] / stats["total"]
        writer.add_scalar("Loss/Valid", stats["loss_avg"], epoch)
        writer.add_scalar("Accuracy/Valid", stats["accuracy"], epoch)
        print("Valid:", stats)
        if rank == 0:
            with open(os.path.join(args.out, "stats.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "phase": "valid", **stats}) + "\n")


tensorboard_dir = os.path.join(args.out, "tensorboard", adaptdl.env.job_id() or "standalone")
with SummaryWriter(tensorboard_dir) as writer:
    for epoch in adl.remaining_epochs_until(args.epochs):
        train(epoch)
        valid(epoch)
        lr_scheduler.step()

if rank == 0:
    torch.save({"model": net.module.state_dict(), "optimizer": optimizer.state_dict(),
                "steps": counter.step}, os.path.join(args.out, "final.pt"))
