"""A membership change as an event: what every member runs around a new process group.

Before the old group goes away (:func:`before_change`, collective over the old members,
leavers included): every job state's ``sync()`` (e.g. pending Accumulator updates) and
every participant's ``before_membership_change()``.

After the new group exists (:func:`after_change`, collective over the new members, the
same collectives in the same order everywhere): when someone joined, rank 0 hands every
shared job state to the newcomers; then each participant re-binds itself through its own
``on_membership_change`` callback -- AutoDist rebuilds strategy, plan and synchronizers
(broadcasting rank 0's parameters), the adaptive loop restarts its statistics, loaders
re-plan the epoch for the new world. The lifecycle layer knows none of them by type.
"""

from __future__ import annotations

from stratagem.distributed.process_group import rank_world
from stratagem.elastic import wire
from stratagem.elastic.context import JobContext, MembershipChange
from stratagem.elastic.state import export_state, import_state


def before_change(ctx: JobContext) -> None:
    """In the old group, before anyone leaves (collective)."""
    for state in list(ctx.states.values()):
        state.sync()
    for participant in ctx.participants():
        participant.before_membership_change()


def after_change(ctx: JobContext, change: MembershipChange) -> None:
    """In the new group (collective): hand over the job state, then notify participants."""
    if change.joiners:
        transfer_states(ctx, change.newcomer, change.world_size)
    for participant in ctx.participants():
        participant.on_membership_change(change)


def transfer_states(ctx: JobContext, newcomer: bool, world: int) -> None:
    """Rank 0's shared states (all but the model's, whose tensors its participant
    broadcasts, and per-rank ones) to every member; the newcomers load them, or keep them
    pending for states they create later (``load_state`` takes them)."""
    if world == 1:
        return
    states = dict(ctx.states)
    payload = None
    if rank_world()[0] == 0:
        payload = {name: export_state(s) for name, s in states.items()
                   if not s.per_rank and not name.startswith("model")}
    received = wire.broadcast_state(payload)
    if newcomer:
        for name, value in received.items():
            if name in states:
                import_state(states[name], value)
            else:
                ctx.pending[name] = value
