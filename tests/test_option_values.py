"""One grammar per kind of option value: ASCII only, whitespace ignored alike, every refusal names the variable."""

from __future__ import annotations

import pytest

from kvcached import config
from kvcached.errors import ConfigurationError, KvcachedError

ARABIC_THREE = "\u0663"  # '٣': a digit to str.isdigit(), not to kvcached


def _refused(monkeypatch, name: str, text: str) -> ConfigurationError:
    env = config.OPTIONS[name].env
    monkeypatch.setenv(env, text)
    with pytest.raises(ConfigurationError) as info:
        config.get(name)
    message = str(info.value)
    assert message.startswith(f"{env}="), message
    assert "\n" not in message
    assert isinstance(info.value, KvcachedError) and isinstance(info.value, ValueError)
    return info.value


# ---- sizes -------------------------------------------------------------------------------


def test_a_page_size_out_of_range_names_the_variable_and_the_range(monkeypatch):
    error = _refused(monkeypatch, "page_bytes", "4GB")
    assert "KVCACHED_PAGE_BYTES='4GB' is invalid" in str(error)
    assert "a multiple of 4KiB, from 4KiB to 1GiB" in str(error)


def test_a_three_byte_page_is_refused_whatever_the_spaces(monkeypatch):
    assert "KVCACHED_PAGE_BYTES=' 3 '" in str(_refused(monkeypatch, "page_bytes", " 3 "))


def test_a_three_byte_host_capacity_is_refused_like_any_other_size(monkeypatch):
    assert "at least 4KiB" in str(_refused(monkeypatch, "host_capacity_bytes", " 3 "))


def test_a_zero_zero_chunk_is_refused_naming_the_variable(monkeypatch):
    assert "KVCACHED_ZERO_CHUNK_BYTES='0'" in str(_refused(monkeypatch, "zero_chunk_bytes", "0"))


def test_zero_keeps_its_documented_meaning_where_it_has_one(monkeypatch):
    for name in ("page_bytes", "virtual_capacity_bytes", "idle_cache_bytes", "host_heap_keep_bytes"):
        monkeypatch.setenv(config.OPTIONS[name].env, "0")
        assert config.get(name) == 0


# ---- counts ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [name for name in config.OPTIONS if name.endswith("_pages")])
def test_a_page_count_beyond_two_to_the_32_is_refused_naming_the_variable(monkeypatch, name):
    assert "out of range" in str(_refused(monkeypatch, name, str(2**64)))
    monkeypatch.setenv(config.OPTIONS[name].env, str(2**32 - 1))
    assert config.get(name) == 2**32 - 1


@pytest.mark.parametrize("text", ["+3", "3.0", "1_000", "0x10", "1e3", ARABIC_THREE, "3" + ARABIC_THREE])
def test_counts_are_ascii_digits_only(monkeypatch, text):
    _refused(monkeypatch, "max_reserve_pages", text)


# ---- seconds, fractions, booleans, choices ----------------------------------------------


@pytest.mark.parametrize("text", ["1e3", "+5", "-1", "1_0", "inf", "nan", "0x1", ARABIC_THREE, "5s", "9" * 400])
def test_seconds_are_plain_ascii_decimals(monkeypatch, text):
    _refused(monkeypatch, "rank_ack_timeout_s", text)


@pytest.mark.parametrize("text, value", [("2.5", 2.5), (".5", 0.5), ("7.", 7.0), ("120", 120.0)])
def test_seconds_accept_plain_decimals(monkeypatch, text, value):
    monkeypatch.setenv("KVCACHED_RANK_ACK_TIMEOUT_S", text)
    assert config.get("rank_ack_timeout_s") == value


@pytest.mark.parametrize("text", ["1e-1", "+0.5", ARABIC_THREE, "0.5" + ARABIC_THREE, "1_0"])
def test_fractions_are_plain_ascii_decimals(monkeypatch, text):
    _refused(monkeypatch, "gpu_utilization", text)


@pytest.mark.parametrize("name, text", [("zero_backing", "\uff59es"), ("host_memory", "\uff41nonymous")])
def test_booleans_and_choices_are_ascii(monkeypatch, name, text):
    _refused(monkeypatch, name, text)  # fullwidth letters, which str.lower() would not fold


# ---- whitespace, alike for every kind ----------------------------------------------------


@pytest.mark.parametrize(
    "name, text, value",
    [
        ("page_bytes", " 2M\t", 2 << 20),
        ("host_capacity_bytes", "\n64MiB ", 64 << 20),
        ("max_reserve_pages", " 8 ", 8),
        ("idle_release_s", " 2.5 ", 2.5),
        ("gpu_utilization", " 0.5 ", 0.5),
        ("zero_backing", " off ", False),
        ("host_memory", " Anonymous ", "anonymous"),
        ("registry_dir", " /run/kvcached ", "/run/kvcached"),
        ("name", " llama ", "llama"),
    ],
)
def test_surrounding_whitespace_is_ignored_by_every_kind(monkeypatch, name, text, value):
    monkeypatch.setenv(config.OPTIONS[name].env, text)
    assert config.get(name) == value


def test_only_whitespace_means_the_default(monkeypatch):
    monkeypatch.setenv("KVCACHED_MAX_RESERVE_PAGES", "  ")
    assert config.get("max_reserve_pages") == config.OPTIONS["max_reserve_pages"].default


@pytest.mark.parametrize("name", [name for name in config.OPTIONS if name != "name"])
def test_every_option_refuses_a_non_ascii_digit_naming_its_variable(monkeypatch, name):
    _refused(monkeypatch, name, ARABIC_THREE)


# ---- the registry group ------------------------------------------------------------------


@pytest.mark.parametrize("text", ["4294967295", "4294968298", "99999999999999999999999"])
def test_a_gid_out_of_range_is_refused_not_wrapped(monkeypatch, text):
    error = _refused(monkeypatch, "registry_group", text)
    assert "out of range" in str(error) and "4294967294" in str(error)


def test_an_unknown_group_name_is_one_line_naming_the_variable(monkeypatch):
    error = _refused(monkeypatch, "registry_group", "nosuch-kvcached-group")
    assert str(error).startswith("KVCACHED_REGISTRY_GROUP='nosuch-kvcached-group' is invalid: it names no group on")
    assert str(error).count("KVCACHED_REGISTRY_GROUP") == 1


def test_the_largest_gid_and_a_group_name_are_accepted(monkeypatch):
    import grp
    import os

    from kvcached import _core

    assert _core.resolve_registry_group("4294967294") == 4294967294
    assert _core.resolve_registry_group("0") == 0
    name = grp.getgrgid(os.getegid()).gr_name
    monkeypatch.setenv("KVCACHED_REGISTRY_GROUP", name)
    assert config.get("registry_group") == name
    assert _core.resolve_registry_group(name) == os.getegid()


def test_opening_a_registry_with_a_gid_out_of_range_changes_nothing(monkeypatch, tmp_path):
    from kvcached.registry import registry_for

    directory = tmp_path / "registries"
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(directory))
    monkeypatch.setenv("KVCACHED_REGISTRY_GROUP", "4294968298")
    with pytest.raises(ConfigurationError, match="KVCACHED_REGISTRY_GROUP='4294968298'"):
        registry_for("cpu", total_bytes=1 << 20)
    assert not directory.exists()


@pytest.mark.parametrize("text", ["+3", "--1", "1.0", "2147483648", "-2147483649", "٣", "- 1"])
def test_a_priority_is_a_signed_ascii_whole_number_in_range(monkeypatch, text):
    error = _refused(monkeypatch, "priority", text)
    assert "from -2147483648 to 2147483647" in str(error)


@pytest.mark.parametrize(("text", "value"), [("-5", -5), ("0", 0), (" 12 ", 12), ("-2147483648", -(2**31))])
def test_a_priority_may_be_negative(monkeypatch, text, value):
    monkeypatch.setenv("KVCACHED_PRIORITY", text)
    assert config.get("priority") == value
