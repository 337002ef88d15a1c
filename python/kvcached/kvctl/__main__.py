"""``python -m kvcached.kvctl``: the same as the ``kvctl`` command (:mod:`kvcached.cli.kvctl`)."""

import sys

from kvcached.cli.kvctl import main

sys.exit(main())
