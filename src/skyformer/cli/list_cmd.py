"""``skyformer list``: registered methods, their defaults and capabilities."""

from __future__ import annotations

import argparse
import dataclasses
import json

from ..registry import get_method, list_methods

NAME = "list"
HELP = "list the attention methods with their default options and capabilities"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def describe() -> list[dict]:
    out = []
    for name in list_methods():
        spec = get_method(name)
        out.append(
            {
                "name": name,
                "summary": spec.summary,
                "defaults": spec.defaults(),
                "capabilities": dataclasses.asdict(spec.capabilities),
            }
        )
    return out


def run(args: argparse.Namespace) -> int:
    methods = describe()
    if args.json:
        print(json.dumps(methods, indent=2))
        return 0
    for m in methods:
        caps = m["capabilities"]
        flags = [k for k, v in caps.items() if v is True]
        print(f"{m['name']}: {m['summary']}")
        print(f"    target: {caps['target']}; capabilities: {', '.join(flags) or 'none'}")
        defaults = ", ".join(f"{k}={v!r}" for k, v in m["defaults"].items()) or "none"
        print(f"    options: {defaults}")
    return 0
