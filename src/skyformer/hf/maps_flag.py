"""Whether a call asked its attention module for attention maps, where the model keeps
``output_attentions`` to that module's own ``forward`` (Falcon's attention takes it as an
argument and hands the attention function neither the flag nor a recorder of
transformers' to read): a forward pre-hook on such a module keeps the flag of the call
on the module for the attention function (``hf/attention.py``), and a forward hook that
runs also when the call fails takes it off again.

The hooks go on when a layer gets its setting (``layers.install_layer``): a layer set on
its first forward (the ``attn_implementation`` route without ``from_pretrained``) reads the
flag from its second call on. Inside ``torch.compile`` the flag is a Python constant of
the call, traced as such. One module called on two threads at once with different flags
would share one.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import nn

FLAG_NAME = "_skyformer_maps_asked"
HOOKS_NAME = "_skyformer_maps_flag_hooks"


def follow_maps_flag(module: nn.Module) -> None:
    """Keep ``output_attentions`` of ``module``'s calls on it, once, where its
    ``forward`` takes it by name."""
    if HOOKS_NAME in module.__dict__ or "output_attentions" not in _arguments(type(module)):
        return
    module.__dict__[HOOKS_NAME] = (
        module.register_forward_pre_hook(_keep, with_kwargs=True),
        module.register_forward_hook(_drop, always_call=True))


def maps_asked(module: nn.Module) -> bool:
    """Whether the current call of ``module`` passed ``output_attentions=True``."""
    return bool(module.__dict__.get(FLAG_NAME, False))


@functools.cache
def _arguments(cls: type) -> tuple[str, ...]:
    """The names of ``cls.forward``'s arguments after ``self``, in order."""
    try:
        names = list(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):  # a forward without a signature: nothing to read
        return ()
    return tuple(names[1:])


def _keep(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if "output_attentions" in kwargs:
        value = kwargs["output_attentions"]
    else:
        position = _arguments(type(module)).index("output_attentions")
        value = args[position] if position < len(args) else False
    module.__dict__[FLAG_NAME] = bool(value)


def _drop(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    module.__dict__.pop(FLAG_NAME, None)
