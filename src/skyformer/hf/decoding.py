"""``DecodingCache``: transformers' generation with constant-memory attention states.

Pass one to ``generate`` (or to a forward) of a decoder whose attention runs through
skyformer::

    model = AutoModelForCausalLM.from_config(config, attn_implementation="skyformer:skyformer")
    skyformer.hf.set_attention(model, "skyformer", num_features=64, seed=0)
    out = model.generate(ids, cache=skyformer.hf.DecodingCache(model), ...)

Each layer keeps its method's decoding state (``skyformer.decoding``): for ``linear``,
``performer``, ``skyformer`` and ``nystrom_softmax`` its memory does not grow with the
generated length (it records which positions are real up to the last padded one, a byte
a position, which a later step's mask must agree with); the layers that run exact
attention (``softmax``, ``kernelized``, layers left exact) keep their keys and values as
transformers' ``DynamicCache`` does.
Tokens equal those of the full causal forward over the whole sequence with the same
random key (a layer ``seed``) and, for ``skyformer`` and ``nystrom_softmax`` without a
``landmark_stride``, the stride of the prompt (ceil(n / m) for its n real tokens, where
a forward without a cache takes that of the whole sequence); in beam search a state
keeps its sequence's landmark draws when the sequence changes rows, where a forward
without a cache draws by row (docs/causal.md, "Decoding").

Assisted generation (``assistant_model=...``, ``prompt_lookup_num_tokens=...``) works
too: transformers switches on ``activate_past_recording`` and, after checking the
drafted tokens, drops the rejected ones with ``crop``. A state cannot subtract
positions from its sums, so while recording each layer keeps the state as it was
before its last step (the step replaces the state's tensors rather than writing into
them, so this costs no copy) and that step's inputs; ``crop`` puts the state back and
steps it again with the positions that stay (generation in eval mode: in training mode
a Performer layer may redraw its features in place between steps). While recording,
the replaced tensors of the state before the last step stay alive until the next step
or ``crop``, with that step's inputs: up to about twice the state's memory.
Assisted generation cannot continue a used cache: transformers feeds the whole input
again at its first step, over the cached positions; a padded one is refused
(``check_reaches``), an unpadded one cannot be told from a continuation.

How it plugs in: the cache's ``update`` records the new keys and values and hands them
back unchanged; the skyformer attention function of that layer recognises them (the
very tensors: ``claimed_step``) and runs a decoding step instead of attention over a key
cache. Any number of caches may be alive for one model (two conversations, a copy of a
prompt's cache made with ``copy.deepcopy`` to continue it twice): each step is found from
the keys that its own cache handed back.

A cache holds the sequences of one generation: ``generate`` continues it from those
sequences given whole (the earlier output, then the new tokens), as transformers' caches;
for new prompts make a new cache or call ``cache.reset()``. A step of other sequences is
refused with a sentence where the cache can tell (``_check_batch``, ``check_reaches``).

A cache serves the model it was made for, with the attention its layers ran at its first
step: its states and kept keys hold the positions so far under that attention. A step
of another model, after ``restore_exact`` or another implementation, or in a layer whose
method, options, seed or per-layer state changed since (``set_attention``) is refused
with a sentence; start a new cache then. So is a forward with ``use_cache=False``
(``generate`` would feed the whole sequence at every step). A step refused or failed
before any layer took its positions is undone (the cache goes on as before it); one
that failed after some layers took them leaves the layers holding different positions,
and every later step is refused, naming that failure (``cache_steps.StepProgress``).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, CacheLayerMixin

from ..masks import allowed_entries
from ..registry.autocast import as_autocast_hands_them
from .cache_steps import StepProgress, StepReadings
from .layers import EXACT, STATE_NAME, LayerAttention, attention_modules, is_cross_attention

# The steps that updates handed back and no attention function has taken yet:
# id(keys) -> (the keys, their layer), both weakly held (nothing lives longer for it).
_PENDING: dict[int, tuple[weakref.ref, weakref.ref]] = {}


class DecodingLayer(CacheLayerMixin):
    """One layer of ``DecodingCache``: its decoding state, or its keys and values when
    the layer runs exact attention."""

    is_compileable = False
    is_sliding = False

    def __init__(self, modules: tuple[nn.Module, ...] | None = None,
                 readings: StepReadings | None = None,
                 progress: StepProgress | None = None) -> None:
        """``modules``: the attention modules of this layer index in the model the cache
        is made for (weakly held; ``None``: any module); ``readings`` and ``progress``:
        the mask readings and the progress shared by the cache's layers (``None``: the
        layer's own)."""
        super().__init__()
        self.readings = readings if readings is not None else StepReadings()
        self.progress = progress if progress is not None else StepProgress()
        self.modules = None if modules is None else tuple(weakref.ref(m) for m in modules)
        self.runs: tuple | None = None  # what the layer ran at the first step (_runs)
        self.state = None  # skyformer.decoding.DecodingState, made at the first step
        self.seen = 0  # positions given to update
        # [B, p]: which of the first p positions stepped are real, p just past the last
        # padded one (every later position is real); None: every position is
        self.valid: Tensor | None = None
        self.pending: Tensor | None = None  # the keys of the step not yet attended
        self.new = 0  # the positions of the last update
        self.took = False  # whether that step stepped the state or kept its keys
        self.record_past = False  # keep what crop needs (transformers switches it on)
        self.rollback: tuple | None = None  # (state before the last step, its inputs)

    @property
    def is_croppable(self) -> bool:
        """Whether ``crop`` can drop positions: while recording (module docstring)."""
        return self.record_past

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """From now on keep the state before each step, so that ``crop`` can undo it.

        ``recurrent_states_to_keep`` (transformers 5.25 on: how many recent positions a
        crop may drop): no states per position are kept here, since ``crop`` steps the
        state again from before the last step; any count within that step is undone."""
        self.record_past = True

    def step(self, q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None) -> Tensor:
        """The decoding state's step (``DecodingState.step``); while recording, first
        keep the state as it is (a shallow copy: steps replace tensors, never write
        into them) and the step's inputs (put back as they were if the step fails).
        The layer takes the step's positions once the state has: a step the state
        refuses or fails leaves it as it was (``fail`` then undoes the step where no
        other layer took it)."""
        rollback = self.rollback
        if self.record_past:  # the inputs as the state takes them: a crop steps them
            q, k, v = as_autocast_hands_them(q, k, v)  # again, maybe outside autocast
            self.rollback = (copy.copy(self.state), q, k, v, key_valid)
        try:
            out = self.state.step(q, k, v, key_valid)
        except BaseException:
            self.rollback = rollback
            raise
        self._take()
        self._record_valid(key_valid, q.shape[0], k.shape[2])
        return out

    def past_valid(self) -> Tensor | None:
        """``[B, positions stepped]`` bool, True = real (what a step's mask must show
        for them: ``masks.decoding_key_valid``), or None where every one is real."""
        if self.valid is None or self.state is None:
            return None
        return self._valid_of(self.state.length, self.valid.shape[0], self.valid.device)

    def _record_valid(self, key_valid: Tensor | None, batch: int, new: int) -> None:
        """Record which of a step's ``new`` positions are real: kept up to the last
        padded position only, so that decoding after the prompt (every position real)
        adds nothing and the layer's memory stays constant."""
        if key_valid is None or bool(key_valid.all()):
            return
        past = self._valid_of(self.state.length - new, batch, key_valid.device)
        self.valid = _up_to_last_padding(torch.cat([past, key_valid], dim=1))

    def _valid_of(self, positions: int, batch: int, device: torch.device) -> Tensor:
        """The record of the first ``positions`` positions as ``[B, positions]`` bool
        (the positions past ``valid`` are real)."""
        kept = self.valid.to(device) if self.valid is not None else \
            torch.ones(batch, 0, dtype=torch.bool, device=device)
        rest = torch.ones(batch, positions - kept.shape[1], dtype=torch.bool, device=device)
        return torch.cat([kept, rest], dim=1)

    def follow(self, module: nn.Module, layer: LayerAttention) -> None:
        """Refuse a step of a module of another model, or of a layer whose attention
        changed since this cache's first step (its state or kept keys hold the positions
        so far under the other one); the first step records what the layer runs."""
        if self.modules is not None and not any(ref() is module for ref in self.modules):
            raise ValueError(
                "DecodingCache: this cache was made for another model; make one from the "
                "model that generates (DecodingCache(model)), one per generation.")
        runs = _runs(module, layer)
        if self.runs is None:
            self.runs = runs
        elif runs != self.runs:
            where = type(module).__name__ if layer.index is None else \
                f"attention layer {layer.index}"
            now, before = runs[0], self.runs[0]
            if now == before:
                now, before = (f"{now} with other options, seed or per-layer state",
                               f"{before} setting")
            raise ValueError(
                f"DecodingCache: {where} runs {now} now, not the {before} it ran when this "
                f"cache took its first step (set_attention or set_attn_implementation "
                f"since), and the cache holds the positions so far under that one; start a "
                f"new cache (DecodingCache(model)).")

    def check_reaches(self, attention_mask: Tensor | None, new: int) -> None:
        """Refuse a step whose mask shows real cached tokens but none of its ``new``
        positions as a real token in any sequence: generate pads a mask shorter than the
        cache's positions and the step's with padding, as when it gets a new prompt over
        a used cache (it feeds the input's positions past the cache's length). A step of
        padding after cached padding alone (a prompt padded to a fixed width, fed in
        parts) goes on."""
        if not isinstance(attention_mask, Tensor) or self.seen == new:
            return
        self.once_per_step("reaches", attention_mask, new, lambda: self._reaches(
            attention_mask, new))

    def _reaches(self, attention_mask: Tensor, new: int) -> None:
        """``check_reaches``' test, one host read."""
        shown = allowed_entries(attention_mask)
        new_shown, past_shown, last_shown = torch.stack(  # one read
            [shown[..., -new:].any(), shown[..., :-new].any(), shown[..., -1].any()]).tolist()
        if self.record_past and past_shown and not last_shown:
            self._refuse_assisted_over_a_used_cache(new)
        if past_shown and not new_shown:
            held = self.seen - new
            whole = (f" If the cache held this whole input already ({held} positions, a "
                     f"prompt prefilled by hand and then given to generate), generate fed "
                     f"it all again: prefill all but its last token (a padded prompt with "
                     f"generate's position_ids, (mask.cumsum(-1) - 1).clamp_min(0)), or "
                     f"give generate the prompt with a new cache." if held == new else "")
            raise ValueError(
                f"DecodingCache: none of this step's {new} positions is a real token in "
                f"its attention mask, in any sequence, after the {self.seen - new} "
                f"positions the cache holds: the mask ends before them, as when generate "
                f"gets a new prompt over a used cache (it feeds the input's positions past "
                f"the cache's length). generate continues a cache only from the sequences "
                f"it holds, given whole (the earlier output, then the new tokens, with their "
                f"mask); for a new prompt make a new cache (DecodingCache(model)) or call "
                f"cache.reset().{whole}")

    def _refuse_assisted_over_a_used_cache(self, new: int) -> None:
        """A step that ends in padding in every sequence while recording: transformers'
        assisted generation feeds its whole input at its first step, also over a used
        cache, whose mask then ends before the step does (it reads the logits of the
        step's last positions, padded rows here)."""
        raise ValueError(
            f"DecodingCache: this step's last position is padding in every sequence, after "
            f"the {self.seen - new} positions the cache holds, while it records for "
            f"assisted generation: transformers' assisted generation (assistant_model=..., "
            f"prompt_lookup_num_tokens=...) feeds the whole input again at its first step, "
            f"over the positions of a used cache, so it cannot continue one (a second turn). "
            f"Give each assisted generate call a new cache (DecodingCache(model)) with the "
            f"whole conversation, or call cache.reset() first.")

    def once_per_step(self, name: str, attention_mask: Tensor | None, new: int,
                      read: Callable[[], Any]) -> Any:
        """``read()`` (a reading of the step's ``attention_mask`` that waits for its values
        on the host), once per model step for all the cache's layers (``StepReadings``)."""
        return self.readings.once(name, attention_mask, (self.seen, new), read)

    def _take(self) -> None:
        """Note that this layer takes the step's positions (it cannot be undone now)."""
        self.took = True
        self.progress.taken_at = (self.seen, self.new)

    def fail(self, where: str, error: BaseException) -> None:
        """The step this layer claimed failed in ``where``'s attention call with
        ``error``. Where no layer took its positions (a refusal before any change: the
        attention changed since the first step, a mask the state cannot follow) the step
        is undone and the cache takes the next one as if it never came; else the layers
        hold different positions and every later step is refused, naming ``error``."""
        if not self.took and self.progress.taken_at != (self.seen, self.new):
            self.seen -= self.new
            self.progress.front = self.seen
            if self.state is not None and self.state.length == 0:  # made for this step
                self.state = None
            return
        cause = f"{type(error).__name__}: {error}".splitlines()[0]
        self.progress.failure = (
            f"an earlier step failed in {where} ({cause[:300]}) after some layers had "
            f"taken its positions")

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs
               ) -> tuple[Tensor, Tensor]:
        """Record the step's keys; return them unchanged (the attention function decodes).

        Refuses every step once one was never taken by skyformer's attention function:
        that step attended to its own positions only (its output was right only as the
        first step of the cache, the prompt), and the state never took its positions."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_batch(key_states.shape[0])
        self.progress.check(self.seen, key_states.shape[-2])
        if self.pending is not None:
            raise RuntimeError(
                "DecodingCache: the keys this cache handed back at an earlier step never "
                "reached skyformer's attention function, so that step attended to its own "
                "positions only and the cache lacks them; start a new cache. This happens "
                "when the model changes the keys after cache.update (e.g. repeats them for "
                "its grouped-query heads), when its forward runs under torch.compile, or "
                "when that forward failed; for such a model use transformers' DynamicCache.")
        self.pending = key_states
        for ident, (keys, layer) in list(_PENDING.items()):  # steps no function took
            if keys() is None or layer() is None:
                _PENDING.pop(ident, None)
        _PENDING[id(key_states)] = (weakref.ref(key_states), weakref.ref(self))
        self.new, self.took = key_states.shape[-2], False
        self.seen += self.new
        self.progress.front = max(self.progress.front, self.seen)
        return key_states, value_states

    def held_sequences(self) -> int | None:
        """The number of sequences held (None before the first step). Not named
        ``batch_size``: transformers' ``Cache.batch_size`` reads that attribute of each
        layer as a number."""
        if self.state is not None:
            return self.state.batch_size()
        return self.keys.shape[0] if self.keys is not None else None

    def _check_batch(self, batch: int) -> None:
        """Refuse a step of another number of sequences than the layer holds, before any
        layer changes: the cache holds an earlier generation's sequences."""
        held = self.held_sequences()
        if held is not None and batch != held:
            raise ValueError(
                f"DecodingCache: this step has {batch} sequences, the cache holds {held} "
                f"(those of an earlier generate or forward); generate continues a cache "
                f"only for the sequences it holds, given whole (the earlier output, then the "
                f"new tokens). For new prompts make a new cache (DecodingCache(model)) or "
                f"call cache.reset(); to go on with some of the sequences, or each several "
                f"times, call cache.batch_select_indices(...) or "
                f"cache.batch_repeat_interleave(...) first.")

    def claim(self, key: Tensor) -> bool:
        """Whether ``key`` is this step's keys (then the step is taken)."""
        if self.pending is not key:
            return False
        self.pending = None
        return True

    def keep(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """For a layer run exactly: every key and value so far, as a ``DynamicLayer``."""
        self._take()
        self.keys = key if self.keys is None else torch.cat([self.keys, key], dim=-2)
        self.values = value if self.values is None else torch.cat([self.values, value], dim=-2)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(positions so far and the step's, 0)``; a step of no positions over a used
        cache is refused: generate slices a new prompt at most half the cache's length
        to nothing (the model fails on it next)."""
        if query_length == 0 and self.seen:
            raise ValueError(
                f"DecodingCache: a step of no positions after the {self.seen} the cache "
                f"holds: generate takes the input to continue them and slices off as many "
                f"positions, which leaves nothing of a new prompt at most half as long. "
                f"generate continues a cache only from the sequences it holds, given whole "
                f"(the earlier output, then the new tokens); for a new prompt make a new "
                f"cache (DecodingCache(model)) or call cache.reset().")
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.readings.clear()
        self.progress.reset()
        self.state, self.seen, self.pending, self.rollback = None, 0, None, None
        self.new, self.took = 0, False
        self.runs = None
        self.valid = None
        self.keys = self.values = None

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        self.readings.clear()  # the positions' record follows the sequences
        if self.rollback is not None:  # the kept state and inputs follow the sequences
            state, *inputs = self.rollback  # the state is the rollback's own copy
            state.reorder(indices)
            index = indices.to(inputs[0].device)
            self.rollback = (state, *(None if t is None else t.index_select(0, index)
                                      for t in inputs))
        if self.state is not None:
            self.state.reorder(indices)
        if self.valid is not None:
            self.valid = self.valid.index_select(0, indices.to(self.valid.device))
        if self.keys is not None:
            self.keys = self.keys.index_select(0, indices.to(self.keys.device))
            self.values = self.values.index_select(0, indices.to(self.values.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        batch = self.held_sequences()
        if batch is not None:
            device = self.keys.device if self.keys is not None else None
            index = torch.arange(batch, device=device).repeat_interleave(repeats)
            self.batch_select_indices(index)

    def check_crop(self, tokens_to_remove: int) -> None:
        """Raises the sentence ``crop(tokens_to_remove)`` would, changing nothing."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes minus the number of positions to drop (as "
                             f"transformers' caches do), got {tokens_to_remove}.")
        remove = -tokens_to_remove
        if remove == 0 or not self.is_initialized:  # a layer never given positions
            return
        if remove > self.seen:
            raise ValueError(f"cannot drop {remove} positions: the cache holds {self.seen}.")
        if self.state is None:
            return
        if self.rollback is None:
            raise ValueError(
                "DecodingCache can drop positions only of the step it recorded: call "
                "cache.activate_past_recording() before that step (transformers' assisted "
                "generation does), and crop before the next step.")
        last = self.rollback[1].shape[2]
        if remove > last:
            raise ValueError(f"DecodingCache can drop at most the {last} positions of its "
                             f"last step (a state sums over the earlier ones), got {remove}.")

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (transformers' convention: a
        negative count; 0 only releases what was kept for a crop). A decoding state can
        drop positions of its last step only, and only while recording; a refused crop
        changes nothing."""
        self.check_crop(tokens_to_remove)
        self.readings.clear()
        remove = -tokens_to_remove
        rollback, self.rollback = self.rollback, None
        if remove == 0 or not self.is_initialized:
            return
        if self.state is not None:
            state, q, k, v, key_valid = rollback
            if state.length == 0:  # the first step again: with the key it drew
                state.generator = self.state.key
            stay = q.shape[2] - remove
            if stay:  # the positions that stay, stepped again
                try:
                    state.step(q[:, :, :stay], k[:, :, :stay], v[:, :, :stay],
                               None if key_valid is None else key_valid[:, :stay])
                except BaseException:
                    self.rollback = rollback  # the state is as it was: a crop may come again
                    raise
            self.state = state
            if self.valid is not None:  # up to the last padded position that stays
                self.valid = _up_to_last_padding(self.valid[:, : state.length])
        if self.keys is not None:
            self.keys = self.keys[..., : self.keys.shape[-2] - remove, :]
            self.values = self.values[..., : self.values.shape[-2] - remove, :]
        self.seen -= remove
        self.progress.front, self.progress.taken_at = self.seen, None

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    def nbytes(self) -> int:
        """Bytes held: the decoding state, any kept keys and values, and the record of
        real positions (a byte a position, once a sequence has padding)."""
        total = self.state.nbytes() if self.state is not None else 0
        for t in (self.keys, self.values, self.valid):
            if t is not None:
                total += t.numel() * t.element_size()
        return total


def _runs(module: nn.Module, layer: LayerAttention) -> tuple:
    """What a layer computes, as a cache's states depend on it: the method, its options,
    the seed and the per-layer state module (weakly held, compared by identity: a new one
    has other parameters)."""
    if layer.method == EXACT:
        return (EXACT,)
    state = module._modules.get(STATE_NAME)
    return (layer.method, layer.config, layer.seed,
            None if state is None else weakref.ref(state))


def _up_to_last_padding(valid: Tensor) -> Tensor | None:
    """``valid [B, p]`` cut just past its last padded position (the positions after it
    are real), or None where every position is real."""
    padded = (~valid).any(dim=0).nonzero()
    return valid[:, : int(padded[-1]) + 1].contiguous() if len(padded) else None


class DecodingCache(Cache):
    """A transformers ``Cache`` of skyformer decoding states for ``model`` (module
    docstring). ``model`` is a decoder-only transformers model loaded with
    ``attn_implementation="skyformer:<method>"`` (or ``"skyformer"`` with per-layer
    settings); one cache per generation."""

    def __init__(self, model: nn.Module) -> None:
        from .attention import is_skyformer_implementation
        from .model import _implementation

        implementation = _implementation(model)
        if not is_skyformer_implementation(implementation):
            raise ValueError(
                f"DecodingCache needs a model whose attention runs through skyformer, but "
                f"this one uses attn_implementation={implementation!r}; load it with "
                f"attn_implementation='skyformer:<method>' or call "
                f"skyformer.hf.set_attention(model, '<method>') first.")
        modules = [(i, m) for i, name, m in attention_modules(model)
                   if not is_cross_attention(m, name)]
        if any(is_cross_attention(m, name) for _, name, m in attention_modules(model)):
            raise ValueError("DecodingCache is for decoder-only models; this model has "
                             "cross-attention (use transformers' EncoderDecoderCache).")
        self.model = weakref.ref(model)  # weakly: a cache does not keep a model alive
        readings, progress = StepReadings(), StepProgress()
        super().__init__(layers=[DecodingLayer(tuple(m for j, m in modules if j == i),
                                               readings, progress)
                                 for i in range(max(i for i, _ in modules) + 1)])

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[Tensor, Tensor]:
        self._check_model()
        if layer_idx >= len(self.layers):
            raise ValueError(
                f"DecodingCache: attention layer {layer_idx} asks for its state, but this "
                f"cache was made for a model with {len(self.layers)} attention layers; make "
                f"the cache from the model that generates (DecodingCache(model)).")
        _refuse_use_cache_false(kwargs)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_model(self) -> None:
        """Refuse a step once the model this cache was made for is gone or no longer runs
        skyformer's attention functions (which alone take the cache's steps)."""
        from .attention import is_skyformer_implementation
        from .model import _implementation

        model = self.model()
        if model is None:
            raise ValueError(
                "DecodingCache: the model this cache was made for no longer exists; make "
                "one from the model that generates (DecodingCache(model)).")
        implementation = _implementation(model)
        if not is_skyformer_implementation(implementation):
            raise ValueError(
                f"DecodingCache: the model this cache was made for runs "
                f"attn_implementation={implementation!r} now, not skyformer (restore_exact "
                f"or set_attn_implementation since the cache was made), so its states cannot "
                f"take this step; start a new cache once it runs skyformer again, or use "
                f"transformers' DynamicCache for its own attention.")

    @property
    def batch_size(self) -> int:
        """The number of sequences held, -1 before the first step (transformers'
        ``Cache.batch_size``; the layers hold the same number: ``_check_batch``)."""
        held = [n for layer in self.layers if (n := layer.held_sequences()) is not None]
        return held[0] if held else -1

    def crop(self, tokens_to_remove: int) -> None:
        """``DecodingLayer.crop`` on every layer, after checking them all: a refused crop
        leaves every layer as it was."""
        for layer in self.layers:
            layer.check_crop(tokens_to_remove)
        super().crop(tokens_to_remove)

    def nbytes(self) -> int:
        """Bytes held by every layer's state (``DecodingLayer.nbytes``)."""
        return sum(layer.nbytes() for layer in self.layers)


def _refuse_use_cache_false(update_kwargs: dict[str, Any]) -> None:
    """Refuse a step of a forward called with ``use_cache=False`` (transformers passes
    the layer's keyword arguments on to ``update`` as ``kwargs``, with ``use_cache``
    where the model forwards it): ``generate`` then feeds the whole sequence at every
    step, and the cache would take those positions again after the ones it holds."""
    forwarded = update_kwargs.get("kwargs")
    if isinstance(forwarded, dict) and forwarded.get("use_cache") is False:
        raise ValueError(
            "DecodingCache: this forward has use_cache=False, under which generate feeds "
            "the whole sequence again at every step, and the cache would add those "
            "positions after the ones it holds (wrong tokens, in silence). Leave "
            "use_cache=False out to decode with the cache, or the cache out to recompute "
            "the causal forward at every step.")


def claimed_step(key: Tensor) -> DecodingLayer | None:
    """The ``DecodingLayer`` whose ``update`` returned ``key`` (the very tensor), if any:
    the step is then taken (a second call answers None). None in traced code: the
    cache is not compileable (``DecodingLayer.is_compileable``), and Dynamo 2.11
    cannot take the ``id`` of a tensor made in the traced function."""
    if torch.compiler.is_compiling():
        return None
    entry = _PENDING.get(id(key))
    if entry is None or entry[0]() is not key:
        return None
    _PENDING.pop(id(key), None)
    layer = entry[1]()
    return layer if layer is not None and layer.claim(key) else None
