"""``skyformer check METHOD``: the contract checks of ``skyformer.registry.check_method``,
for a method of one's own (``skyformer --plugin my_methods check local_window``)."""

from __future__ import annotations

import argparse

from ..eval.methods import refuse_repeated_methods
from ..registry import get_method
from ..registry.contract import check_method

NAME = "check"
HELP = ("check a method against the contract every method keeps (shapes, padding, "
        "causality, gradients, ...) on tiny inputs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("methods", nargs="+", metavar="METHOD",
                        help="registered names, options in brackets as a variant's "
                        "(local_window[num_features=4]); with --plugin, your own")


def run(args: argparse.Namespace) -> int:
    # every name before any check: a typo in the last one was refused after the others ran
    refuse_repeated_methods(args.methods, "METHOD")
    for method in args.methods:
        get_method(method)
    failed = 0
    for method in args.methods:
        results = check_method(method)  # an unknown name or option: refused before a line
        print(method)
        for result in results:
            word = {True: "ok", False: "FAILED", None: "skipped"}[result.passed]
            print(f"  {word:7s} {result.name}: {result.detail}")
            failed += result.passed is False
    if failed:
        print(f"{failed} check(s) failed")
    return 1 if failed else 0
