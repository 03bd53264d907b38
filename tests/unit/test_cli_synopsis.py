"""docs/cli.md's synopsis names every option each command takes (issue 29 found record's missing
--nvml-hz, --host-hz, --remote and --nvml-replay), and every positional argument has its help."""

from __future__ import annotations

import argparse

import pytest

from gpu_trace.cli import build_parser
from tests.conftest import REPO


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _synopsis(command: str) -> str:
    text = (REPO / "docs" / "cli.md").read_text().split("```", 2)[1]
    lines = [ln for ln in text.splitlines() if ln.startswith(f"gpu-trace {command} ")]
    assert lines, f"docs/cli.md's synopsis has no line for {command}"
    return " ".join(lines)


@pytest.mark.parametrize("command", sorted(_commands()))
def test_the_synopsis_names_every_option(command: str) -> None:
    synopsis = _synopsis(command)
    words = set(synopsis.replace("[", " ").replace("]", " ").replace("|", " ").split())
    missing = [
        max(a.option_strings, key=len)
        for a in _commands()[command]._actions
        if a.option_strings and a.dest != "help" and not words & set(a.option_strings)
    ]
    assert not missing, f"docs/cli.md's {command} synopsis lacks {missing}"


@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_positional_argument_says_what_it_is(command: str) -> None:
    bare = [
        a.metavar or a.dest
        for a in _commands()[command]._actions
        if not a.option_strings and not a.help
    ]
    assert not bare, f"gpu-trace {command} --help leaves {bare} undescribed"
