"""``python -m kvcached.kvtop``: the same as the ``kvtop`` command (:mod:`kvcached.cli.kvtop`)."""

import sys

from kvcached.cli.kvtop import main

sys.exit(main())
