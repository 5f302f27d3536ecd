"""``sg.adapt.rescale``: the in-process rescale API under its earlier, documented name.

The implementation is :mod:`stratagem.elastic.rescale`; ``python -m stratagem.adapt.rescale
serve`` still hosts a job's store.
"""

import sys

from stratagem.elastic.rescale import Change, active_group, main, request_leave, rescale_point

__all__ = ["Change", "active_group", "main", "request_leave", "rescale_point"]

if __name__ == "__main__":
    sys.exit(main())
