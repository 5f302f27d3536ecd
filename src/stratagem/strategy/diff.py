"""What differs between two strategies, in lines a person reads in a log.

Used where a run meets a strategy it did not plan (a checkpoint's ``strategy.json``): the
ids are content hashes, so equal ids mean the same plan and nothing is said; otherwise these
lines say which replicas and which parameters' synchronizers changed.
"""

from __future__ import annotations

from stratagem.strategy.schema import NodeConfig, Strategy, sync_text

SHOWN = 5  # parameters named one by one; the rest are counted


def _config_text(nc: NodeConfig | None) -> str:
    if nc is None:
        return "absent"
    if nc.partitioner is None:
        return sync_text(nc.synchronizer)
    parts = "; ".join(sync_text(p.synchronizer) for p in nc.part_config)
    return f"partitioned {nc.partitioner} -> {parts}"


def differences(old: Strategy, new: Strategy, shown: int = SHOWN) -> list[str]:
    """The changes from ``old`` to ``new`` (empty when their content is the same)."""
    if old.id == new.id:
        return []
    out = []
    if old.graph_config.replicas != new.graph_config.replicas:
        a, b = old.graph_config.replicas, new.graph_config.replicas
        out.append(f"replicas: {len(a)} -> {len(b)}" if len(a) != len(b)
                   else f"replicas: {', '.join(a)} -> {', '.join(b)}")
    before = {nc.var_name: nc for nc in old.node_config}
    after = {nc.var_name: nc for nc in new.node_config}
    changed = [name for name in dict.fromkeys([*before, *after])
               if before.get(name) != after.get(name)]
    for name in changed[:shown]:
        out.append(f"{name}: {_config_text(before.get(name))} -> "
                   f"{_config_text(after.get(name))}")
    if len(changed) > shown:
        out.append(f"and {len(changed) - shown} more parameters")
    if not out:
        out.append("the order of the parameters' configs")
    return out
