"""``python -m shardserve.cli``: the ``shardserve`` command."""

import sys

from shardserve.cli import main

sys.exit(main())
