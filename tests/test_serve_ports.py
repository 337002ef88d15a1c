"""Engines of one serve never share a port: the kernel may name a port again until its engine
listens on it, so engines started together were once both given one (and vLLM's server, binding
with SO_REUSEPORT, would share it, splitting one model's requests between two engines)."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("httpx", reason="kvcached serve needs the serve extra: pip install '.[serve]'")

import kvcached.serve.ports as ports  # noqa: E402
from kvcached.errors import ServeError  # noqa: E402
from kvcached.serve.ports import PortBook  # noqa: E402
from test_serve_supervisor import make_supervisor  # noqa: E402


def kernel_naming(monkeypatch, *first: int) -> None:
    """The kernel names ``first`` in turn, then real free ports."""
    named = iter(first)
    real = ports.free_port
    monkeypatch.setattr(ports, "free_port", lambda host: next(named, None) or real(host))


def test_a_port_the_kernel_names_again_is_not_handed_to_a_second_engine(monkeypatch):
    kernel_naming(monkeypatch, 40001, 40001, 40002)
    book = PortBook()
    assert (book.take("127.0.0.1"), book.take("127.0.0.1")) == (40001, 40002)
    assert book.taken == {40001, 40002}


def test_a_port_given_back_may_be_handed_out_again(monkeypatch):
    kernel_naming(monkeypatch, 40001, 40001)
    book = PortBook()
    assert book.take("127.0.0.1") == 40001
    book.give_back(40001)
    assert book.take("127.0.0.1") == 40001 and book.taken == {40001}


def test_a_kernel_that_names_only_ports_held_is_an_error_not_a_shared_port(monkeypatch):
    book = PortBook()
    kernel_naming(monkeypatch, 40001)
    book.take("127.0.0.1")
    monkeypatch.setattr(ports, "free_port", lambda host: 40001)
    with pytest.raises(ServeError, match="only ports other engines hold"):
        book.take("127.0.0.1")
    assert book.taken == {40001}


def test_engines_started_together_get_ports_of_their_own(tmp_path, monkeypatch):
    # Both engines' probes name the same free port, as the kernel did for two engines of a serve
    # started at once: without the book both were launched on it and the second could not bind.
    port = ports.free_port("127.0.0.1")
    kernel_naming(monkeypatch, *itertools.repeat(port, 2))
    supervisor = make_supervisor(tmp_path, monkeypatch)
    supervisor.start()
    try:
        assert supervisor.wait_ready(lambda: False) is None
        given = {name: engine.port for name, engine in supervisor.engines.items()}
    finally:
        supervisor.stop()
    assert port in given.values() and len(set(given.values())) == 2, given
