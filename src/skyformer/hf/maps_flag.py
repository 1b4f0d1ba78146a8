"""Whether a call asked its attention module for attention maps, where the model keeps
``output_attentions`` to that module's own ``forward`` (Falcon's attention takes it as an
argument and hands the attention function neither the flag nor a recorder of
transformers' to read): a forward pre-hook on such a module records the flag of each call
for the attention function (``hf/attention.py``), on the thread that runs it.

The hook goes on when a layer gets its setting (``layers.install_layer``): a layer set on
its first forward (the ``attn_implementation`` route without ``from_pretrained``) reads the
flag from its second call on. Inside ``torch.compile`` nothing is recorded (a compiled
model asks for maps through the flag or the recorder, which the function reads itself).
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any

import torch
from torch import nn

HOOK_NAME = "_skyformer_maps_flag_hook"
_CALLS = threading.local()  # id(module) -> the output_attentions of its current call


def follow_maps_flag(module: nn.Module) -> None:
    """Record ``output_attentions`` for ``module``'s calls, once, where its ``forward``
    takes it by name."""
    if HOOK_NAME in module.__dict__ or "output_attentions" not in _arguments(type(module)):
        return
    module.__dict__[HOOK_NAME] = module.register_forward_pre_hook(_record, with_kwargs=True)


def maps_asked(module: nn.Module) -> bool:
    """Whether the current call of ``module`` passed ``output_attentions=True``."""
    return bool(getattr(_CALLS, "flags", {}).get(id(module), False))


@functools.cache
def _arguments(cls: type) -> tuple[str, ...]:
    """The names of ``cls.forward``'s arguments after ``self``, in order."""
    try:
        names = list(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):  # a forward without a signature: nothing to read
        return ()
    return tuple(names[1:])


def _record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if torch.compiler.is_compiling():
        return
    if "output_attentions" in kwargs:
        value = kwargs["output_attentions"]
    else:
        position = _arguments(type(module)).index("output_attentions")
        value = args[position] if position < len(args) else False
    if not hasattr(_CALLS, "flags"):
        _CALLS.flags = {}
    _CALLS.flags[id(module)] = bool(value)
