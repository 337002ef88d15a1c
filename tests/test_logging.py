"""One logger hierarchy under "kvcached"; integrations also write through their engine's handlers."""

from __future__ import annotations

import ast
import importlib
import logging
import pkgutil
from pathlib import Path

import pytest

import kvcached
from kvcached.integration.common.engine_log import EngineLogForwarder, route_to_engine_log

PACKAGE_DIR = Path(kvcached.__file__).parent


def get_logger_calls():
    """(file:line, argument source) of every logging.getLogger(...) call in kvcached's sources."""
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "getLogger":
                where = f"{path.relative_to(PACKAGE_DIR)}:{node.lineno}"
                yield where, ast.unparse(node.args[0]) if node.args else ""


def test_every_logger_is_named_after_its_module_or_under_kvcached():
    calls = list(get_logger_calls())
    assert len(calls) >= 10
    outside = []
    for where, argument in calls:
        named_by_module = argument == "__name__"
        under_kvcached = argument.strip("'\"") == "kvcached" or argument.strip("'\"").startswith("kvcached.")
        reads_the_root = argument == ""  # only to read the root's level, never to log
        # engine_log looks up the engine's logger (and a record's own) to hand records to their handlers.
        forwards = where.startswith("integration/common/engine_log.py:")
        if not (named_by_module or under_kvcached or reads_the_root or forwards):
            outside.append((where, argument))
    assert outside == []


def test_every_module_logger_lives_under_kvcached():
    loggers = {}
    for info in pkgutil.walk_packages(kvcached.__path__, prefix="kvcached."):
        if info.name.endswith("__main__"):
            continue  # running it is the CLI
        try:
            module = importlib.import_module(info.name)
        except ImportError as exc:
            if exc.name is None or exc.name.split(".")[0] == "kvcached":
                raise  # only a missing engine or optional dependency may stop an import
            continue
        for value in vars(module).values():
            if isinstance(value, logging.Logger):
                loggers[info.name] = value.name
    assert "kvcached.integration.vllm" in loggers and "kvcached.integration.sglang" in loggers
    assert {name for name in loggers.values() if name != "kvcached" and not name.startswith("kvcached.")} == set()


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def engine_and_root():
    """An engine logger that writes through its own handler and does not propagate (as vLLM's),
    and a handler on the root (as a user's logging.basicConfig)."""
    engine = logging.getLogger("test_engine")
    engine_handler, root_handler = Collect(), Collect()
    engine.addHandler(engine_handler)
    engine.propagate = False
    engine.setLevel(logging.INFO)
    logging.getLogger().addHandler(root_handler)
    integration = logging.getLogger("kvcached.integration.test_engine")
    yield integration, engine_handler, root_handler
    engine.removeHandler(engine_handler)
    logging.getLogger().removeHandler(root_handler)
    integration.handlers.clear()
    integration.setLevel(logging.NOTSET)
    engine.setLevel(logging.NOTSET)


def test_an_integration_logger_writes_through_the_engine_handlers_once(engine_and_root):
    integration, engine_handler, root_handler = engine_and_root
    route_to_engine_log(integration, "test_engine")
    route_to_engine_log(integration, "test_engine")  # idempotent
    assert sum(isinstance(h, EngineLogForwarder) for h in integration.handlers) == 1
    assert integration.level == logging.INFO  # the engine's, as kvcached has none of its own

    logging.getLogger("kvcached.integration.test_engine.v1.worker").info("kv space ready")
    assert engine_handler.messages == ["kv space ready"]
    assert root_handler.messages == ["kv space ready"]  # by propagation, not twice


def test_an_integration_logger_follows_the_engine_level_unless_it_has_its_own(engine_and_root):
    integration, engine_handler, _ = engine_and_root
    engine = logging.getLogger("test_engine")
    engine.setLevel(logging.NOTSET)  # the engine has not configured its logging yet
    route_to_engine_log(integration, "test_engine")
    worker = logging.getLogger("kvcached.integration.test_engine.v1.worker")
    worker.info("before the engine configured its logging")  # the root's WARNING applies
    engine.setLevel(logging.INFO)  # as vLLM does when it configures logging, after plugins loaded
    worker.info("kv space ready")
    engine.setLevel(logging.ERROR)
    worker.warning("dropped at the engine's level")
    integration.setLevel(logging.DEBUG)  # a level set on kvcached's logger wins
    worker.debug("asked for by the user")
    assert engine_handler.messages == ["kv space ready", "asked for by the user"]


def test_an_engine_propagating_to_the_root_is_not_written_twice(engine_and_root):
    integration, engine_handler, root_handler = engine_and_root
    logging.getLogger("test_engine").propagate = True
    try:
        route_to_engine_log(integration, "test_engine")
        integration.warning("pool exhausted")
    finally:
        logging.getLogger("test_engine").propagate = False
    assert engine_handler.messages == ["pool exhausted"]
    assert root_handler.messages == ["pool exhausted"]


def test_the_engine_integrations_are_routed_into_their_engines_logs():
    from kvcached.integration import sglang, vllm

    for module, engine in ((vllm, "vllm"), (sglang, "sglang")):
        forwarders = [h for h in module.logger.handlers if isinstance(h, EngineLogForwarder)]
        assert [h.engine_logger.name for h in forwarders] == [engine]
