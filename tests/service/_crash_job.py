"""A job that crashes at once (exit status 3), without importing torch: the scheduler's
back-off and failure path is what is tested, not how long a replica takes to start."""

import sys

print("crashing on purpose", flush=True)
sys.exit(3)
