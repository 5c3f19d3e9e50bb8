"""``python -m dbtrigger.cli``: the same as the ``dbtrigger`` console script."""

from __future__ import annotations

import sys

from dbtrigger.cli.main import main

sys.exit(main())
