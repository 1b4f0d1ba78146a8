"""Drop-in attention for Hugging Face transformers models (optional extra ``hf``).

Importing this module registers every skyformer method with transformers'
attention-function registry as ``"skyformer:<method>"``::

    import skyformer.hf
    model = AutoModel.from_pretrained(path, attn_implementation="skyformer:nystrom_softmax")
    skyformer.hf.set_attention(model, "nystrom_softmax", layers=[0, 1], num_features=64, seed=0)
    skyformer.hf.restore_exact(model)

``set_attention`` is the one route for options and per-layer choice; ``describe`` lists
what each layer runs. ``model.save_pretrained(path)`` records that in the saved config
(``skyformer.hf.record``) and ``skyformer.hf.from_pretrained(path)`` sets it up again.
Masks, causal flags, the model's logit scaling and dropout are handled as documented in
``skyformer.hf.attention`` and docs/hf.md; what a method cannot honour fails with a
sentence. Gaussian-target methods (``kernelized``, ``skyformer``, ``skyformer_adaptive``,
``skyformer_multipole``) compute a different function from softmax attention, and
methods with learned parameters (``linformer``) start them untrained: in a
softmax-pretrained model neither is a drop-in without fine-tuning.
"""

from __future__ import annotations

try:
    import transformers
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    if getattr(error, "name", None) == "transformers":  # not installed
        raise ImportError(
            "skyformer.hf needs transformers: pip install 'skyformer[hf]'."
        ) from None
    # installed, but its own import failed (a module of the caller's named like one of
    # its dependencies, a broken dependency): that error, not an advice to install it
    raise ImportError(f"skyformer.hf: importing transformers failed ({error}); it is "
                      f"installed, so the cause is in its import, not a missing "
                      f"package.") from error

from ..versions import major_minor

# The attention and mask registries with the mask-builder signature used here
# (q_length, kv_length, q_offset, kv_offset) are those of transformers 5.4 and later.
MIN_TRANSFORMERS = (5, 4)

if major_minor(transformers.__version__) < MIN_TRANSFORMERS:
    raise ImportError(
        f"skyformer.hf needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))}, found "
        f"{transformers.__version__}: pip install 'skyformer[hf]' (or "
        f"pip install 'transformers>=5.4,<6')."
    )

from ..masks import ResolvedMask, UnsupportedMaskError, resolve_mask  # noqa: E402
from .attention import (  # noqa: E402
    PER_LAYER,
    implementation_name,
    refuse_models_with_their_own_attention,
    register_methods,
)
from .decoding import DecodingCache  # noqa: E402
from .layers import EXACT, LayerAttention, attention_modules  # noqa: E402
from .loading import from_pretrained, load_state  # noqa: E402
from .model import describe, restore_exact, set_attention  # noqa: E402
from .record import record_settings_when_saving  # noqa: E402

register_methods()
refuse_models_with_their_own_attention()
record_settings_when_saving()

__all__ = [
    "EXACT",
    "PER_LAYER",
    "DecodingCache",
    "LayerAttention",
    "ResolvedMask",
    "UnsupportedMaskError",
    "attention_modules",
    "describe",
    "from_pretrained",
    "implementation_name",
    "load_state",
    "register_methods",
    "resolve_mask",
    "restore_exact",
    "set_attention",
]
