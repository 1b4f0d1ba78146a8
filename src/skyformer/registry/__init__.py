"""The one place method names live, and the one way to call a method.

- ``capabilities``: what a method can do, as data (``Capabilities``, ``CapabilityError``).
- ``methods``: the registry (``register``, ``get_method``, ``list_methods``,
  ``attention``), one ``Method`` per name.
- ``signature``: a method's public function (options as keyword arguments) generated
  from its core and config dataclass.
- ``binding``: ``Method.bind`` -> ``BoundMethod``, how every caller runs a method.
- ``contract``: ``check_method``, the contract every method keeps, checked on tiny inputs.
"""

from .binding import BoundMethod
from .capabilities import Capabilities, CapabilityError, Target
from .contract import CheckResult, check_method
from .methods import _REGISTRY as _REGISTRY  # the registry itself, for tests to patch
from .methods import (
    Method,
    attention,
    check_capabilities,
    exact_method,
    get_method,
    list_methods,
    methods_taking,
    methods_that_can,
    register,
    with_options,
)
from .signature import AttentionFunction

__all__ = [
    "AttentionFunction",
    "BoundMethod",
    "Capabilities",
    "CapabilityError",
    "CheckResult",
    "Method",
    "Target",
    "attention",
    "check_capabilities",
    "check_method",
    "exact_method",
    "get_method",
    "list_methods",
    "methods_taking",
    "methods_that_can",
    "register",
    "with_options",
]
