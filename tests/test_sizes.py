"""Sizes: one grammar, read the same by Python, every KVCACHED_* size variable and the host backend (C++)."""

from __future__ import annotations

import pytest

from kvcached import config, configured
from kvcached.sizes import MAX_SIZE_BYTES, format_bytes, format_bytes_short, parse_bytes

KIB, MIB, GIB, TIB, PIB = (1 << shift for shift in (10, 20, 30, 40, 50))

# (text, bytes): the documented grammar, docs/configuration.md "Sizes".
VALID = [
    ("0", 0),
    ("4096", 4096),
    ("4096B", 4096),
    ("007", 7),
    ("512K", 512 * KIB),
    ("512KiB", 512 * KIB),
    ("512ki", 512 * KIB),
    ("512kb", 512_000),
    ("8G", 8 * GIB),
    ("8 GiB", 8 * GIB),
    ("8g", 8 * GIB),
    ("2GB", 2 * 10**9),
    ("2 gb", 2 * 10**9),
    ("1.5G", 3 * GIB // 2),
    ("1.5 GiB", 3 * GIB // 2),
    ("0.5K", 512),
    ("3TB", 3 * 10**12),
    ("2T", 2 * TIB),
    ("7P", 7 * PIB),
    ("  64M  ", 64 * MIB),
    ("\t1M", MIB),
    (str(MAX_SIZE_BYTES), 2**63 - 1),
]

# (text, words the message must contain).
INVALID = [
    ("", "empty"),
    ("   ", "empty"),
    ("lots", "does not start with a number"),
    ("-1", "negative"),
    ("-4G", "negative"),
    ("+4G", "does not start with a number"),
    ("inf", "does not start with a number"),
    ("nan", "does not start with a number"),
    ("1e99", "exponents"),
    ("1E9", "exponents"),
    ("0.5", "whole number of bytes"),
    ("1.5", "whole number of bytes"),
    ("1.5B", "whole number of bytes"),
    ("1.", "decimal point"),
    ("1.2.3", "unexpected"),
    ("1_000", "unexpected"),
    ("1,000", "unexpected"),
    ("4X", "unknown unit"),
    ("4 GiBs", "unknown unit"),
    ("4Gb/s", "unexpected"),
    ("0x10", "unexpected"),
    (str(2**63), "too large"),
    ("8192P", "too large"),
    ("99999999999999999999999999999999999", "too large"),
    ("1." + "0" * 19, "digits after the point"),
    ("٣", "ASCII"),  # an Arabic-Indic digit: int() would take it, the grammar does not
]


@pytest.mark.parametrize("text, value", VALID)
def test_valid_sizes_parse_exactly(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text, words", INVALID)
def test_invalid_sizes_are_refused_with_the_reason(text, words):
    with pytest.raises(ValueError, match=words):
        parse_bytes(text)


def test_the_message_names_the_option_and_quotes_the_text():
    with pytest.raises(ValueError, match=r"^KVCACHED_PAGE_BYTES='4X' is not a size: unknown unit 'X'"):
        parse_bytes("4X", "KVCACHED_PAGE_BYTES")


HOST_PAGE_BYTES = 4 * KIB


@pytest.mark.parametrize("text, value", VALID)
def test_the_host_backend_reads_its_capacity_with_the_same_grammar(monkeypatch, text, value):
    monkeypatch.setenv("KVCACHED_HOST_CAPACITY_BYTES", text)
    if value < HOST_PAGE_BYTES:
        with pytest.raises(ValueError, match="KVCACHED_HOST_CAPACITY_BYTES=.*at least 4KiB"):
            configured.host_capacity_bytes()
    else:
        assert configured.host_capacity_bytes() == value


@pytest.mark.parametrize("text, words", [case for case in INVALID if case[0].strip() and case[0].isascii()])
def test_the_host_backend_refuses_what_python_refuses(monkeypatch, text, words):
    monkeypatch.setenv("KVCACHED_HOST_CAPACITY_BYTES", text)
    with pytest.raises(ValueError, match=f"KVCACHED_HOST_CAPACITY_BYTES=.*{words}"):
        configured.host_capacity_bytes()


def test_an_empty_host_capacity_means_the_default(monkeypatch):
    monkeypatch.setenv("KVCACHED_HOST_CAPACITY_BYTES", "")
    assert configured.host_capacity_bytes() > 0


@pytest.mark.parametrize("name", [name for name, option in config.OPTIONS.items() if option.env.endswith("_BYTES")])
def test_every_size_option_uses_the_grammar(monkeypatch, name):
    option = config.OPTIONS[name]
    if name != "page_bytes":  # a page is a multiple of 4 KiB up to 1 GiB (tests/test_option_values.py)
        monkeypatch.setenv(option.env, "4GB")
        assert config.get(name) == 4 * 10**9, "GB is decimal everywhere"
        monkeypatch.setenv(option.env, "4G")
        assert config.get(name) == 4 * GIB
    monkeypatch.setenv(option.env, "2M")
    assert config.get(name) == 2 * MIB
    for bad in ("1e99", "-1", "inf", "0.5", str(2**63)):
        monkeypatch.setenv(option.env, bad)
        with pytest.raises(ValueError, match=option.env):
            config.get(name)


def test_formatters_round_and_fit():
    assert format_bytes(None) == "-" and format_bytes(512) == "512 B"
    assert format_bytes(3 * GIB // 2) == "1.5 GiB" and format_bytes(2 * PIB) == "2.0 PiB"
    assert parse_bytes(format_bytes(3 * GIB // 2)) == 3 * GIB // 2, "what people read, the parser reads back"
    assert [format_bytes_short(n) for n in (None, 512, 512 * MIB, 7 * GIB // 2, 100 * TIB)] == [
        "-",
        "512B",
        "512M",
        "3.5G",
        "100T",
    ]
    assert all(len(format_bytes_short(n)) <= 5 for n in (0, 1023, 1024, 10 * MIB - 1, 999 * GIB, 2**63 - 1))
