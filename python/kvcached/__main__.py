"""``python -m kvcached``: same as the ``kvcached`` command."""

from kvcached.cli.main import main

raise SystemExit(main())
