"""``aioengine --help`` and each subcommand's: every option says what it does."""

from __future__ import annotations

import argparse

from aioengine.entrypoints.cli import build_parser


def test_every_option_of_every_subcommand_has_help_text():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        f"{name} {action.option_strings[0]}"
        for name, sub in subparsers.choices.items()
        for action in sub._actions
        if action.option_strings and action.help is None
    ]
    assert not missing, f"options without help text: {missing}"
    serve = subparsers.choices["serve"].format_help()
    assert "0.0.0.0 for every interface" in serve and "auto (the default)" in serve
