"""Shared by the deploy tests: the files under deploy/ and `genserve serve`'s own parser."""

from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def serve_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv`` (starting with ``serve``) with genserve's real ``serve`` parser: an
    unknown flag or a bad value fails (SystemExit), as it would in the container."""
    from service.cli import _serve_parser

    parser = argparse.ArgumentParser(prog="genserve")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    return parser.parse_args(argv)


def serve_defaults() -> argparse.Namespace:
    return serve_args(["serve"])
