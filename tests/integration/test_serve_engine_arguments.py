"""The arguments ``kvcached serve`` sets for an engine, checked against the engine's own parser: no
option of vLLM or SGLang is taken for one of them unless it is one, none of them has a short alias,
and what serve refuses as an abbreviation the parser would indeed read as the flag serve set."""

from __future__ import annotations

import argparse

import pytest

from kvcached.serve.engines import OWNED_ARGUMENTS
from kvcached.serve.owned_arguments import owned_flag


def check_parser(parser: argparse.ArgumentParser, owned: tuple[str, ...]) -> None:
    for action in parser._actions:
        for option in action.option_strings:
            assert owned_flag(option, owned) == (option if option in owned else None), option
        if set(action.option_strings) & set(owned):
            assert all(o.startswith("--") for o in action.option_strings), action.option_strings


@pytest.mark.vllm
def test_vllms_parser_agrees_with_what_serve_refuses():
    pytest.importorskip("vllm", reason="checks vLLM's own parser")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    check_parser(parser, OWNED_ARGUMENTS["vllm"])
    for word, dest in (("--hos", "host"), ("--por", "port"), ("--served_model_name", "served_model_name")):
        assert owned_flag(word, OWNED_ARGUMENTS["vllm"]) is not None
        parsed = parser.parse_args(["--model", "m", "--host", "127.0.0.1", "--port", "8001", word, "9999"])
        assert str(getattr(parsed, dest)) in ("9999", "['9999']"), (word, getattr(parsed, dest))


@pytest.mark.sglang
def test_sglangs_parser_agrees_with_what_serve_refuses():
    from kvcached.testing.sglang_env import require_sglang

    require_sglang()
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    check_parser(parser, OWNED_ARGUMENTS["sglang"])
    for word, dest in (("--hos", "host"), ("--model-pa", "model_path"), ("--served-model", "served_model_name")):
        assert owned_flag(word, OWNED_ARGUMENTS["sglang"]) is not None
        parsed = parser.parse_args(["--model-path", "m", "--host", "127.0.0.1", "--port", "8001", word, "9999"])
        assert str(getattr(parsed, dest)) == "9999", (word, getattr(parsed, dest))
