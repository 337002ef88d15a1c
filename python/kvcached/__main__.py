"""``python -m kvcached``: same as the ``kvcached`` command."""

from kvcached.cli import main

raise SystemExit(main())
