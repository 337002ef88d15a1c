"""Exceptions raised by kvcached.

Every failure of a driver call becomes :class:`DriverError` carrying the
backend, the call, the driver's numeric code and its own message. Running out
of memory is always a :class:`MemoryError` subclass, so ``except MemoryError``
catches it whether the device or a kvcached limit said no.
"""

from __future__ import annotations


class KvcachedError(Exception):
    """Base class of every kvcached-specific exception."""


class DriverError(KvcachedError, RuntimeError):
    """A driver (or OS) call failed.

    Attributes are filled in by the extension module: ``backend`` ("host",
    "cuda", "hip"), ``call`` (the driver function), ``code`` (its numeric
    result) and ``driver_message`` (the driver's own text).
    """

    backend: str = ""
    call: str = ""
    code: int = 0
    driver_message: str = ""


class OutOfMemoryError(KvcachedError, MemoryError):
    """Not enough memory: a kvcached limit, the shared budget, or the device."""


class DeviceOutOfMemoryError(DriverError, OutOfMemoryError):
    """The device itself (or the host backend's capacity) has no memory left."""


class BackendUnavailableError(KvcachedError, RuntimeError):
    """The requested backend or device cannot be used here; the message says why."""


__all__ = [
    "KvcachedError",
    "DriverError",
    "OutOfMemoryError",
    "DeviceOutOfMemoryError",
    "BackendUnavailableError",
]
