"""Worker script of test_probe_vcluster.py: probe the links of the job, rank 0 writes them
(and the link model they make) as JSON to ``argv[1]``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import stratagem as sg
from stratagem.planner import measured_links

ad = sg.AutoDist(verbose=False)
links, probe = measured_links(ad.resource_spec)
if ad.rank == 0:
    Path(sys.argv[1]).write_text(json.dumps({"probe": probe.to_dict() if probe else None,
                                             "nic_bps": list(links.nic_bps),
                                             "machine_bps": links.machine_bps,
                                             "group_period_s": links.group_period_s}))
