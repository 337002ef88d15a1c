"""Shows an integration's log records in its engine's log stream, under kvcached's own logger names.

Every kvcached logger is named after its module, under ``kvcached`` (the vLLM
integration logs as ``kvcached.integration.vllm...``), so one
``logging.getLogger("kvcached")`` configures them all. An engine user still
expects kvcached's messages among the engine's, in its format: vLLM writes
through handlers on its ``vllm`` logger, which does not propagate to the root.
:func:`route_to_engine_log` hands each record of an integration's logger to the
engine logger's handlers as well, skipping any handler the record reaches
anyway (the root's), so nothing is printed twice, and makes the logger follow
the engine logger's level, read at each use (vLLM sets it when it configures its
logging, after plugins may have loaded), unless a level is set on it.
"""

from __future__ import annotations

import logging


class EngineLogForwarder(logging.Handler):
    """Passes records to the handlers an engine logger writes through (its own and its parents')."""

    def __init__(self, engine_logger: logging.Logger) -> None:
        super().__init__()
        self.engine_logger = engine_logger

    def emit(self, record: logging.LogRecord) -> None:
        reached_anyway = _handlers_reached_by(logging.getLogger(record.name))
        for handler in _handlers_reached_by(self.engine_logger):
            if handler in reached_anyway or handler is self or record.levelno < handler.level:
                continue
            handler.handle(record)


def _handlers_reached_by(logger: logging.Logger) -> list[logging.Handler]:
    """The handlers a record logged on ``logger`` goes through, in order (as ``Logger.callHandlers``)."""
    handlers: list[logging.Handler] = []
    current: logging.Logger | None = logger
    while current is not None:
        handlers.extend(current.handlers)
        current = current.parent if current.propagate else None  # type: ignore[assignment]
    return handlers


class EngineLevelLogger(logging.Logger):
    """A logger whose level, unless one is set on it, is its engine logger's own level.

    ``level`` is read at each use (children read it too when they look for their
    effective level), so kvcached says as much as the engine does whenever the
    engine sets its level; NOTSET while the engine has none, as any logger.
    """

    engine_logger: logging.Logger
    own_level: int

    @property  # type: ignore[override]
    def level(self) -> int:
        return self.own_level if self.own_level != logging.NOTSET else self.engine_logger.level

    @level.setter
    def level(self, value: int) -> None:
        self.own_level = value


def route_to_engine_log(logger: logging.Logger, engine_logger_name: str) -> None:
    """Make ``logger``'s records (and its children's) also appear in the engine's log stream,
    at the engine's level unless ``logger`` has a level of its own. Idempotent."""
    engine_logger = logging.getLogger(engine_logger_name)
    if not isinstance(logger, EngineLevelLogger):
        own_level = logger.level
        logger.__class__ = EngineLevelLogger  # the same object: a Logger plus one property
        logger.engine_logger = engine_logger
        logger.setLevel(own_level)  # also drops the levels isEnabledFor cached
    logger.engine_logger = engine_logger
    if not any(isinstance(h, EngineLogForwarder) and h.engine_logger is engine_logger for h in logger.handlers):
        logger.addHandler(EngineLogForwarder(engine_logger))
