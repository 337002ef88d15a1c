"""Exceptions raised by kvcached.

Every failure of a driver call becomes :class:`DriverError` carrying the
backend, the call, the driver's numeric code and its own message. Running out
of memory is always a :class:`MemoryError` subclass, so ``except MemoryError``
catches it whether the device or a kvcached limit said no. Every exception
kvcached defines (the integrations' too) derives from :class:`KvcachedError`
and keeps the built-in base callers would expect (``ValueError``,
``RuntimeError``, ``FileNotFoundError``, ...).
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


class InvalidArgumentError(KvcachedError, ValueError):
    """A call broke a rule (bad size, unknown or repeated id, state conflict); nothing was changed.

    Raised by the C++ core for every misuse; still a :class:`ValueError`, so
    ``except ValueError`` keeps working.
    """


class InvalidTypeError(KvcachedError, TypeError):
    """An argument of the wrong type (a device that is not a string, a dtype that is not one, ...)."""


class IntegrationError(KvcachedError, RuntimeError):
    """An engine integration met the engine in a state it was not written for; nothing was patched
    further. The message says what happened; unsetting ``KVCACHED_ENABLE`` runs the engine without kvcached."""


class DemoError(KvcachedError, RuntimeError):
    """``kvcached demo``: an engine process failed, exited or did not finish in time."""


class ServeConfigError(KvcachedError, ValueError):
    """``kvcached serve``'s configuration cannot be used; the message names the key and what is expected."""


class ServeError(KvcachedError, RuntimeError):
    """``kvcached serve`` could not start or keep its engines; the message says which and why."""


class ConfigurationError(KvcachedError, ValueError):
    """A ``KVCACHED_*`` setting cannot be used; the message names the variable, its value and what is expected."""


class BackendUnavailableError(KvcachedError, RuntimeError):
    """The requested backend or device cannot be used here; the message says why."""


class RegistryError(KvcachedError, RuntimeError):
    """The shared device registry cannot do what was asked; the message says why and what to do."""


class RegistryNotFoundError(RegistryError, FileNotFoundError):
    """No registry exists for the device (no engine has registered on it) and none was to be created."""


class RegistryAccessError(RegistryError, PermissionError):
    """The access-control model refuses the registry file or its directory to this user.

    The message names the file and ``KVCACHED_REGISTRY_GROUP``; ``docs/security.md``
    describes the model.
    """


class RegistryUnusableError(RegistryError):
    """The file cannot serve as the device's registry.

    It is not a registry, an old-style one still in use, damaged, a symbolic
    link, or it was truncated, removed or replaced while this process used it
    (then this process takes no more memory through it until restarted).
    """


__all__ = [
    "KvcachedError",
    "DriverError",
    "OutOfMemoryError",
    "DeviceOutOfMemoryError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "ConfigurationError",
    "IntegrationError",
    "DemoError",
    "ServeConfigError",
    "ServeError",
    "BackendUnavailableError",
    "RegistryError",
    "RegistryNotFoundError",
    "RegistryAccessError",
    "RegistryUnusableError",
]
