"""Every command's ``--help`` renders: argparse expands ``%`` in help strings, so a literal one (``50%``) must be
written ``%%`` or the help crashes (``kvloop bench load --help`` did, on its shapes' descriptions)."""

from __future__ import annotations

import argparse

from kvloop.app.cli import build_parser


def subparsers(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += subparsers(sub, f"{path} {name}")
    return found


def test_every_commands_help_renders() -> None:
    commands = subparsers(build_parser(), "kvloop")
    assert len(commands) > 10
    for path, parser in commands:
        assert parser.format_help(), path
