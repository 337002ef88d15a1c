"""An engine whose ranks each compute on their own CPUs populates host pages on touch
(``kvcached.integration.common.host_populate``), unless the user chose."""

from __future__ import annotations

import logging

import pytest

from kvcached import config
from kvcached.integration.common.host_populate import populate_on_touch_beside_sibling_ranks

logger = logging.getLogger("test_host_populate_choice")


@pytest.fixture
def unset(monkeypatch):
    monkeypatch.delenv("KVCACHED_HOST_POPULATE", raising=False)
    return monkeypatch


def test_one_rank_keeps_the_default(unset):
    assert populate_on_touch_beside_sibling_ranks(1, logger) is False
    assert config.get("host_populate") == "background"


def test_several_ranks_choose_on_touch_and_say_so(unset, caplog):
    with caplog.at_level(logging.INFO, logger=logger.name):
        assert populate_on_touch_beside_sibling_ranks(2, logger) is True
    assert config.get("host_populate") == "on_touch"  # what the host backend reads when it opens
    assert "2 ranks" in caplog.text and "on_touch" in caplog.text


@pytest.mark.parametrize("chosen", ["background", "on_touch"])
def test_the_users_choice_stands(unset, chosen):
    unset.setenv("KVCACHED_HOST_POPULATE", chosen)
    assert populate_on_touch_beside_sibling_ranks(2, logger) is False
    assert config.get("host_populate") == chosen
