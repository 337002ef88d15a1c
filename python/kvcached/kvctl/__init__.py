"""Keeps ``python -m kvcached.kvctl`` working: the ``kvctl`` command lives in :mod:`kvcached.cli.kvctl`."""
