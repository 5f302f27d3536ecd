"""``python -m stratagem``: the same as the ``stratagem`` command."""

import sys

from stratagem.cli import main

sys.exit(main())
