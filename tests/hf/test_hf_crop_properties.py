"""Property: a ``DecodingCache`` stepped by a GPT-2 decoder in steps of any sizes, with
crops of any part of each step (assisted generation's rollback: the whole step, part of
it, the prompt included, or nothing) and reorders of the sequences (beam search's, rows
repeated too) at any step, gives at every step the logits of the full causal forward
over the positions it kept. A row's random landmarks follow its sequence: they are
those of the batch row the sequence started in (``origin``), as a decoding state's
reorder keeps them (``tests/decoding/test_decoding_properties.py``), except where a
crop steps the first step again: its rows then draw them afresh, where they are now."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

import skyformer.hf as shf

METHODS = {
    "skyformer": {"num_features": 8, "landmark_stride": 4},
    "nystrom_softmax": {"num_features": 8, "landmark_stride": 4},
    "performer": {"num_features": 16},
    "linear": {},
}


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=512,
                        bos_token_id=0, eos_token_id=1)
    config._attn_implementation = "skyformer"
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


@st.composite
def _schedules(draw):
    """(method, layers, steps): each step (size, the reorder after it or None, the
    positions cropped after that), about 150 positions at most, so that the states absorb a
    64-position chunk and crops fall on both sides of its end."""
    method = draw(st.sampled_from(sorted(METHODS)))
    layers = draw(st.sampled_from([None, [1]]))  # [1]: layer 0 exact, keys kept
    steps, kept = [], 0
    for _ in range(draw(st.integers(1, 12))):
        size = draw(st.integers(1, min(40, 150 - kept)))
        crop = draw(st.one_of(st.just(0), st.integers(1, size)))
        reorder = draw(st.sampled_from([None, None, (1, 0), (0, 0), (1, 1)]))
        steps.append((size, reorder, crop))
        kept += size - crop
        if kept >= 140:
            break
    return method, layers, steps


def _full_forward(model, kept, origin):
    """Logits ``[B, n, V]`` of the full causal forward of each row's ``kept`` positions,
    run in the batch row ``origin[i]`` that holds the landmarks of its sequence."""
    rows = [model(kept[i].expand(len(origin), -1)).logits[o] for i, o in enumerate(origin)]
    return torch.stack(rows)


@torch.no_grad()
@settings(max_examples=15, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(_schedules(), st.integers(0, 2**16))
def test_steps_reorders_and_crops_give_the_full_forward_of_the_kept_positions(schedule,
                                                                              seed):
    method, layers, steps = schedule
    model = _gpt2()
    shf.set_attention(model, method, layers=layers, seed=0, **METHODS[method])
    g = torch.Generator().manual_seed(seed)
    kept, origin = torch.empty(2, 0, dtype=torch.long), [0, 1]
    cache = shf.DecodingCache(model)
    cache.activate_past_recording()
    for size, reorder, crop in steps:
        first = not kept.shape[1]
        new = torch.randint(2, 64, (2, size), generator=g)
        got = model(new, cache=cache).logits
        kept = torch.cat([kept, new], dim=1)
        torch.testing.assert_close(got, _full_forward(model, kept, origin)[:, -size:],
                                   atol=1e-4, rtol=1e-4)
        if reorder is not None:  # between the step and its crop: the kept state follows
            cache.reorder_cache(torch.tensor(reorder))
            kept, origin = kept[list(reorder)], [origin[i] for i in reorder]
        cache.crop(-crop)
        kept = kept[:, : kept.shape[1] - crop]
        if crop and first:  # the first step stepped again, in the rows it is in now
            origin = [0, 1]
        assert cache.get_seq_length() == kept.shape[1]
    if kept.shape[1]:  # one more position after the last crop
        new = torch.randint(2, 64, (2, 1), generator=g)
        got = model(new, cache=cache).logits
        want = _full_forward(model, torch.cat([kept, new], dim=1), origin)[:, -1:]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
