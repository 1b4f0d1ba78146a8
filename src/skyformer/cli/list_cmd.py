"""``skyformer list``: registered methods, their defaults and capabilities."""

from __future__ import annotations

import argparse
import dataclasses

from ..io import json_text
from ..registry import get_method, list_methods
from ..registry.capabilities import mask_forms

NAME = "list"
HELP = "list the attention methods with their default options and capabilities"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def describe() -> list[dict]:
    """Every method: summary, default options, capabilities (with ``scale``: whether it
    takes a logit/kernel scale) and what each SDPA argument does with it."""
    out = []
    for name in list_methods():
        spec = get_method(name)
        caps = {**dataclasses.asdict(spec.capabilities),
                "scale": "scale" in spec.option_names()}
        out.append({"name": name, "summary": spec.summary, "defaults": spec.defaults(),
                    "capabilities": caps, "sdpa": _sdpa_support(caps)})
    return out


def _sdpa_support(caps: dict) -> dict[str, str]:
    """How ``skyformer.scaled_dot_product_attention`` serves each argument."""
    return {
        "attn_mask": "any" if caps["attn_mask"] else _mask_forms(caps),
        "is_causal": "yes" if caps["causal"] else "no",
        "scale": "yes" if caps["scale"] else "no",
        "dropout_p": "on weights" if caps["weight_dropout"] else "on output",
        "enable_gqa": "yes" if caps["gqa"] else "no",
        "varlen": "yes" if caps["varlen"] else "no",
    }


def _mask_forms(caps: dict) -> str:
    """The forms of ``attn_mask`` a method without ``attn_mask`` takes: key padding (with
    ``mask``) and causal (with ``causal``); "none" for neither."""
    return " / ".join(mask_forms(caps["mask"], caps["causal"])) or "none"


def run(args: argparse.Namespace) -> int:
    methods = describe()
    if args.json:
        print(json_text(methods, indent=2))  # strict: an infinite default as null
        return 0
    for m in methods:
        caps = m["capabilities"]
        flags = [k for k, v in caps.items() if v is True]
        print(f"{m['name']}: {m['summary'] or '(no summary: register(..., summary=...))'}")
        print(f"    target: {caps['target']}; capabilities: {', '.join(flags) or 'none'}")
        sdpa = "; ".join(f"{k}: {v}" for k, v in m["sdpa"].items())
        print(f"    scaled_dot_product_attention: {sdpa}")
        defaults = ", ".join(f"{k}={v!r}" for k, v in m["defaults"].items()) or "none"
        print(f"    options: {defaults}")
    return 0
