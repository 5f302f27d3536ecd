"""``python -m stratagem.elastic serve --port P [--host H] [--token T]``: host the store of
an in-process elastic job (see :func:`stratagem.elastic.rescale.main`)."""

import sys

from stratagem.elastic.rescale import main

sys.exit(main())
