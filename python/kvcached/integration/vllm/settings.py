"""The vLLM integration's settings: the shared ones of :mod:`kvcached.integration.common.settings`."""

from kvcached.integration.common.settings import DEFAULT_PAGE_BYTES, Settings, is_enabled

__all__ = ["DEFAULT_PAGE_BYTES", "Settings", "is_enabled"]
