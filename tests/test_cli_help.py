"""``aioengine --help`` and each subcommand's: every option says what it does and,
when it takes a value, its default; each section appears once; no secret from the
environment is printed."""

from __future__ import annotations

import argparse

import pytest

from aioengine.entrypoints.cli import build_parser, says_default


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_of_every_subcommand_has_help_text():
    missing = [
        f"{name} {action.option_strings[0]}"
        for name, sub in subcommands(build_parser()).items()
        for action in sub._actions
        if action.option_strings and action.help is None
    ]
    assert not missing, f"options without help text: {missing}"
    serve = subcommands(build_parser())["serve"].format_help()
    assert "0.0.0.0 for every interface" in serve and "auto (the default)" in serve


def test_every_option_with_a_value_shows_its_default():
    missing = []
    for name, sub in subcommands(build_parser()).items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.option_strings or action.nargs == 0 or action.help == argparse.SUPPRESS:
                continue
            shown = formatter._expand_help(action) if action.help else ""
            if not says_default(shown):
                missing.append(f"{name} {action.option_strings[0]}")
    assert not missing, f"options whose --help shows no default: {missing}"
    generate = subcommands(build_parser())["generate"].format_help()
    assert "(default: 16)" in generate.replace("\n", " ")  # --block-size's, added
    assert "(default: 64)" in " ".join(generate.split())  # --max-num-seqs's


def test_each_help_section_appears_once():
    for name, sub in subcommands(build_parser()).items():
        titles = [g.title for g in sub._action_groups if g._group_actions]
        assert len(titles) == len(set(titles)), f"{name}: sections {titles}"
    serve = subcommands(build_parser())["serve"]
    server = next(g for g in serve._action_groups if g.title == "server")
    flags = {a.option_strings[0] for a in server._group_actions}
    assert {"--host", "--port", "--web-dir", "--log-level"} <= flags


@pytest.mark.parametrize("name", ["serve", "chat", "generate"])
def test_help_never_prints_the_api_key_from_the_environment(monkeypatch, name):
    monkeypatch.setenv("AIOENGINE_API_KEY", "sk-do-not-print-me")
    sub = subcommands(build_parser()).get(name)
    if sub is None:
        pytest.skip(f"no {name} subcommand")
    assert "sk-do-not-print-me" not in sub.format_help()
