"""A user's module that registers a method when imported, for ``bench`` runs that name
the method and one of the module's functions in one ``--methods`` list."""

from __future__ import annotations

import dataclasses

import torch

from skyformer.registry import Capabilities, register


@dataclasses.dataclass(frozen=True)
class _FirstKeysConfig:
    num_features: int = 4


@register("first_keys_mean", _FirstKeysConfig, Capabilities(target="softmax", mask=False),
          summary="mean of the first num_features values (a test method)")
def first_keys_mean(q, k, v, config, *, key_padding_mask=None, generator=None):
    mean = v[:, :, : config.num_features].mean(2, keepdim=True)
    return mean.expand(*q.shape[:3], v.shape[-1])


def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)
