"""``skyformer check METHOD``: the contract checks of ``skyformer.registry.check_method``,
for a method of one's own (``skyformer --plugin my_methods check local_window``)."""

from __future__ import annotations

import argparse

from ..eval.methods import refuse_repeated_methods
from ..registry import get_method
from ..registry.contract import check_method, checked_variant

NAME = "check"
HELP = ("check a method against the contract every method keeps (shapes, padding, "
        "causality, gradients, ...) on tiny inputs")
DESCRIPTION = (HELP[0].upper() + HELP[1:] + ". A method with num_features is checked at "
               "num_features=8 unless its brackets give one (fewer features than rows, "
               "where its draws matter); each method's first line names the variant that ran. "
               "Exit status: 0 when every check passes, 1 when one fails, 2 for a name or "
               "option refused before any check.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("methods", nargs="+", metavar="METHOD",
                        help="registered names, options in brackets as a variant's "
                        "(local_window[num_features=4]); with --plugin, your own")


def run(args: argparse.Namespace) -> int:
    # every name before any check: a typo in the last one was refused after the others ran
    refuse_repeated_methods(args.methods, "METHOD")
    for method in args.methods:
        get_method(method)
    # every setting before any check: an unknown option, or a max_seq_len too short
    checked = {method: checked_variant(method) for method in args.methods}
    failed: dict[str, int] = {}
    for method in args.methods:
        results = check_method(method)
        said = checked[method]
        print(method if said == method else f"{method} (checked as {said})")
        for result in results:
            word = {True: "ok", False: "FAILED", None: "skipped"}[result.passed]
            print(f"  {word:7s} {result.name}: {result.detail}")
            if result.passed is False:
                failed[method] = failed.get(method, 0) + 1
    if failed:
        print(f"{sum(failed.values())} check(s) failed: "
              + ", ".join(f"{method} ({count})" for method, count in failed.items()))
    return 1 if failed else 0
