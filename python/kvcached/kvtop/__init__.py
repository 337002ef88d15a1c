"""Keeps ``python -m kvcached.kvtop`` working: the ``kvtop`` command lives in :mod:`kvcached.cli.kvtop`."""
