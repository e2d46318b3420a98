"""Run `tpfuse diagnose` through the real entry point (tpfuse.cli.main.main), with the command
table narrowed to diagnose so these tests do not depend on other subcommands' modules."""

from __future__ import annotations

import json

from tpfuse.cli import main as cli_main


def run_cli(monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    monkeypatch.setattr(cli_main, "COMMANDS", ("diagnose",))
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps tables to the terminal width; keep rows on one line
    code = cli_main.main(["diagnose", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_cli_json(monkeypatch, capsys, *argv: str) -> tuple[int, dict, str]:
    code, out, err = run_cli(monkeypatch, capsys, "--json", *argv)
    return code, json.loads(out), err
