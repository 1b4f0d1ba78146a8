"""``skyformer hf-eval``: swap the attention of the pretrained MiniLM-L6 without fine-tuning.

KDEformer (Zandieh et al., 2023) measures what a pretrained model loses when its
attention is replaced by an approximation with no fine-tuning. This experiment does that
for the sentence-embedding model all-MiniLM-L6-v2 (shipped offline) on real text, in two
settings:

- ``short``: the text's sentences, in padded batches (masks matter);
- ``long``: the text's tokens cut into inputs of ``seq_len`` (512) tokens, where
  attention is a large share of the cost.

Per method and feature count: cosine similarity of each text's embedding (mean-pooled,
L2-normalised, as sentence-transformers pools them, without its 256-token truncation) to
the exact model's, agreement of
nearest-neighbour retrieval among the texts (recall@1 against the exact model's nearest
neighbours), forward time (median) and peak memory (fresh process on CPU) of one batch.

Two kinds of method are not drop-ins, and rows say so (``drop_in`` False, ``note``):
Gaussian-target methods (``kernelized``, ``skyformer`` and its ``_adaptive`` and
``_multipole`` variants) replace softmax by a Gaussian kernel, a different function;
methods with learned parameters (e.g. Linformer's projections) start them from their
initialisation, not from pretrained weights. Neither is expected to keep a
softmax-pretrained model's embeddings without fine-tuning. A variant with a ``scale`` of
its own other than the model's (``softmax[scale=0.5]``) computes another function than
the model's attention, and its row says so too.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ...checks import check_positive_int, check_positive_ints
from ...devices import parse_device
from ...io import environment
from ...registry import CapabilityError, get_method, list_methods
from ...registry.variants import refuse_swept_option
from ...seeds import check_seed
from ..data.qkv import load_model, max_positions
from ..data.text import read_text, sentences
from ..measure.memory import CallJob, peak_memory_or_reason
from ..measure.timing import CLOCKS, median_seconds
from ..methods import refuse_repeated_methods, refuse_repeats
from ..methods import setting_name as _named

SETTINGS = ("short", "long")
NOT_DROP_IN_GAUSSIAN = "Gaussian kernel, not a drop-in"
NOT_DROP_IN_LEARNED = "untrained learned projections, not a drop-in"
NOT_DROP_IN_SCALE = "scale {scale:g}, not the model's {model:g}: not a drop-in"
BASELINE = "sdpa"  # transformers' own exact attention


@dataclass(frozen=True)
class HFEvalConfig:
    """Settings of ``skyformer hf-eval``.

    methods: registered methods to evaluate (``None`` = all).
    features: ``num_features`` values swept for approximate methods.
    settings: ``"short"`` (sentences) and/or ``"long"`` (``seq_len``-token inputs).
    layers: layers whose attention is replaced (``None`` = all).
    max_texts: at most this many texts per setting.
    batch_size: texts per forward pass.
    time_batch: texts in the timed and memory-measured forward pass (the setting's first
        texts); ``None`` = ``batch_size`` sentences (short) or one input (long).
    """

    methods: tuple[str, ...] | None = None
    features: tuple[int, ...] = (32, 64, 128)
    settings: tuple[str, ...] = SETTINGS
    layers: tuple[int, ...] | None = None
    seq_len: int = 512
    max_texts: int = 128
    batch_size: int = 16
    time_batch: int | None = None
    seed: int = 0
    repeats: int = 3
    memory: bool = True
    text: str | None = None  # UTF-8 text file; None = shipped public-domain text
    model: str | None = None  # local model folder; None = pretrained MiniLM-L6
    device: str = "cpu"
    clock: str = "wall"  # "wall" or "cpu" (process CPU time, for shared CPUs; CPU device only)

    def validate(self) -> None:
        """Fail in a sentence naming the setting and its ``skyformer hf-eval`` flag."""
        for name in ("seq_len", "max_texts", "batch_size", "time_batch", "repeats"):
            value = getattr(self, name)
            if not (name == "time_batch" and value is None):  # None: batch_size's
                check_positive_int(_named(name), value)
        check_seed(_named("seed"), self.seed)
        if self.seq_len < 8:
            raise ValueError(f"{_named('seq_len')} must be at least 8, got {self.seq_len}.")
        if self.max_texts < 2:  # retrieval ranks a text among the others
            raise ValueError(f"{_named('max_texts')} must be at least 2 (retrieval needs two "
                             f"texts), got {self.max_texts}.")
        check_positive_ints(_named("features"), self.features)
        unknown = sorted(set(self.settings) - set(SETTINGS))
        if unknown or not self.settings:
            raise ValueError(f"{_named('settings')} must be chosen from {', '.join(SETTINGS)}, "
                             f"got {self.settings!r}.")
        for name in ("features", "settings", "layers"):
            refuse_repeats(_named(name), getattr(self, name))
        refuse_repeated_methods(self.methods)
        for m in self.methods or ():
            if m == BASELINE:  # its row comes with every run
                raise ValueError(f"{_named('methods')}: {BASELINE!r} is the unchanged model, "
                                 f"whose row every run has as the baseline; name the "
                                 f"library's methods alone (softmax is its exact one).")
            method = get_method(m)  # unknown names fail before any work
            if method.budget_changes_output():  # the sweep sets num_features on it
                refuse_swept_option(method.name, method.preset, "num_features",
                                    "hf-eval (--features)")
            if "causal" in dict(method.preset):  # as set_attention would, row after row
                from ...hf.layers import refuse_causal_option

                refuse_causal_option(method, {})
        device = parse_device(self.device)
        if self.clock not in CLOCKS:
            raise ValueError(f"{_named('clock')} must be one of {', '.join(CLOCKS)}, got "
                             f"{self.clock!r}.")
        if self.clock == "cpu" and device.type != "cpu":
            raise ValueError("the cpu clock (process CPU time) measures CPU work only; use "
                             "the wall clock (--clock wall) on a GPU.")


def check_seq_len(model: nn.Module, seq_len: int) -> None:
    """Refuse ``seq_len`` beyond the model's learned positions (``max_positions``: 512 for
    both BERT and RoBERTa), which would fail inside the embeddings with an index error."""
    limit = max_positions(model)
    if limit is not None and seq_len > limit:
        raise ValueError(f"seq_len {seq_len} exceeds the {limit} positions of this model; "
                         f"pass --seq-len {limit} or less.")


@dataclass
class HFEvalResult:
    config: HFEvalConfig
    model: str
    texts: dict[str, dict[str, Any]]
    rows: list[dict[str, Any]]
    environment: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": dataclasses.asdict(self.config),
            "model": self.model,
            "texts": self.texts,
            "environment": self.environment,
            "rows": self.rows,
        }


@dataclass(frozen=True)
class Inputs:
    """Token ids of one setting: ``ids[i]`` is the i-th text, ``[CLS] ... [SEP]``."""

    setting: str
    ids: list[list[int]]

    def batches(self, size: int) -> list[tuple[list[int], dict[str, Tensor]]]:
        """(text indices, padded batch), texts grouped by length to limit padding."""
        order = sorted(range(len(self.ids)), key=lambda i: len(self.ids[i]))
        return [
            (chunk, pad_batch([self.ids[i] for i in chunk]))
            for chunk in (order[s : s + size] for s in range(0, len(order), size))
        ]


def pad_batch(ids: list[list[int]], pad_id: int = 0) -> dict[str, Tensor]:
    """Right-padded ``input_ids`` and ``attention_mask`` ``[B, max length]``."""
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, x in enumerate(ids):
        input_ids[row, : len(x)] = torch.tensor(x, dtype=torch.long)
        mask[row, : len(x)] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


def build_inputs(tokenizer: Any, text: str, setting: str, *, seq_len: int,
                 max_texts: int, too_few: str = "pass a longer --text FILE, or --settings "
                                                "long") -> Inputs:
    """Token ids of the ``short`` (sentences) or ``long`` (``seq_len``-token) setting,
    each text once (the first ``max_texts`` distinct ones: a repeated text's exact
    embedding ties with its copy, and recall@1 counted a method that found the other
    copy as a miss); ``too_few``: what the sentence for a text of fewer than two
    sentences advises."""
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    if setting == "short":
        ids = _distinct((tokenizer(s, truncation=True, max_length=seq_len)["input_ids"]
                         for s in sentences(text)), max_texts)
        if len(ids) < 2:
            raise ValueError(
                f"the text has {len(ids)} distinct sentence(s) (one ends at . ! or ? before a "
                f"capital or a digit, not after a title or a dotted abbreviation such as U.S., "
                f"or at a CJK full stop, and has at least 4 words); the short "
                f"setting needs at least 2 for retrieval: {too_few}."
            )
        return Inputs(setting, ids)
    from ..data.qkv import _quiet_transformers

    with _quiet_transformers():  # the whole text is longer than the model's limit on purpose
        stream = tokenizer(text, add_special_tokens=False)["input_ids"]
    body = seq_len - 2
    chunks = len(stream) // body
    ids = _distinct(([cls, *stream[i * body : (i + 1) * body], sep]
                     for i in range(chunks)), max_texts)
    if len(ids) < 2:
        repeated = f" ({chunks} inputs, {len(ids)} distinct: the text repeats)" \
            if chunks >= 2 else ""
        raise ValueError(
            f"the text has {len(stream)} tokens{repeated}; the long setting needs at least 2 "
            f"distinct inputs of {seq_len} tokens ({2 * body} tokens of text): pass a longer "
            f"--text FILE, a shorter --seq-len, or --settings short."
        )
    return Inputs(setting, ids)


def _distinct(texts: Iterable[list[int]], limit: int) -> list[list[int]]:
    """The first ``limit`` distinct token-id lists of ``texts``, in their order (read no
    further than needed)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for ids in texts:
        if len(out) == limit:
            break
        if tuple(ids) not in seen:
            seen.add(tuple(ids))
            out.append(ids)
    return out


def embed(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """all-MiniLM-L6-v2 sentence embeddings: mean over real tokens, L2-normalised ``[B, D]``."""
    hidden = model(**batch).last_hidden_state  # [B, N, D]
    weight = batch["attention_mask"][..., None].to(hidden.dtype)
    pooled = (hidden * weight).sum(1) / weight.sum(1).clamp_min(1.0)
    return torch.nn.functional.normalize(pooled, dim=-1)


@torch.no_grad()
def embed_all(model: nn.Module, inputs: Inputs, batch_size: int) -> Tensor:
    """Embeddings of every text of ``inputs`` in their original order, ``[T, D]``."""
    device = next(model.parameters()).device
    parts: dict[int, Tensor] = {}
    for indices, batch in inputs.batches(batch_size):
        out = embed(model, {k: v.to(device) for k, v in batch.items()}).float().cpu()
        parts.update(zip(indices, out, strict=True))
    return torch.stack([parts[i] for i in range(len(inputs.ids))])


def nearest_neighbours(embeddings: Tensor) -> Tensor:
    """Index of each text's most similar other text (cosine), ``[T]``; -1 for a text
    whose embedding is not finite, which is no text's neighbour either (argmax would
    take a NaN similarity for the largest)."""
    finite = torch.isfinite(embeddings).all(dim=-1)  # [T]
    sims = embeddings @ embeddings.T
    sims = torch.where(finite[:, None] & finite[None, :], sims, -math.inf)
    sims.fill_diagonal_(-math.inf)
    return torch.where(finite, sims.argmax(dim=1), -1)


def quality(embeddings: Tensor, exact: Tensor) -> dict[str, float]:
    """Cosine similarity to the exact embeddings and recall@1 of the exact neighbours."""
    cos = torch.nn.functional.cosine_similarity(embeddings, exact, dim=-1)
    found = nearest_neighbours(embeddings)
    agree = (found == nearest_neighbours(exact)) & (found >= 0)  # a NaN text finds none
    return {
        "cosine_mean": cos.mean().item(),
        "cosine_min": cos.min().item(),
        "recall_at_1": agree.float().mean().item(),
    }


def timed_texts(config: HFEvalConfig, setting: str) -> int:
    """How many texts the timed forward pass takes in ``setting``."""
    if config.time_batch is not None:
        return config.time_batch
    return config.batch_size if setting == "short" else 1


def _configurations(config: HFEvalConfig) -> list[tuple[str, int | None]]:
    """(method, num_features or None) pairs in table order."""
    out = []
    for name in config.methods or tuple(list_methods()):
        if get_method(name).budget_changes_output():  # linear's is inert: run once
            out.extend((name, f) for f in config.features)
        else:
            out.append((name, None))
    return out


def memory_probe(model_dir: str | None, method: str, options: dict[str, Any],
                 layers: list[int] | None, seed: int, input_ids: list[list[int]],
                 threads: int | None = None, device: str = "cpu") -> Callable[[], None]:
    """Memory-job setup (a fresh process on CPU): the model with ``method`` and the
    forward pass of one batch, ready to call."""
    if threads:
        torch.set_num_threads(threads)
    model, _, _ = load_model(model_dir)
    model.to(device)
    if method != BASELINE:
        from ...hf import set_attention

        set_attention(model, method, layers=layers, seed=seed, **options)
    batch = {k: v.to(device) for k, v in pad_batch(input_ids).items()}

    def forward() -> None:
        with torch.no_grad():
            model(**batch)

    return forward


def _learns(method: str) -> bool:
    """Whether ``method`` (a variant included) runs with learned weights: declared by its
    capabilities, or held by its per-layer state for these options (Nystromformer's
    ``conv_kernel`` convolution), which starts from its initialisation here."""
    spec = get_method(method)
    if spec.capabilities.learned_parameters:
        return True
    if spec.state is None:
        return False
    state = spec.state(spec.bind().config, 1, 1)  # whether it has weights, not their shape
    return any(True for _ in state.parameters())


def _seeded(method: str) -> bool:
    """Whether ``method``'s output depends on the seed: it draws at random, or it runs
    with per-layer weights initialised under the seed (``_learns``)."""
    if method == BASELINE:
        return False
    return get_method(method).capabilities.randomized or _learns(method)


def model_scale(model: nn.Module) -> float:
    """The attention logit scale of ``model``'s first attention module: its ``scaling``,
    else 1/sqrt(head dim) (what ``set_attention`` passes to the methods)."""
    from ...hf.layers import attention_modules, heads_and_dim, model_scaling

    _, _, module = attention_modules(model)[0]
    scaling = model_scaling(module)
    if scaling is not None:
        return scaling
    _, head_dim = heads_and_dim(module)
    return float(head_dim or model.config.hidden_size // model.config.num_attention_heads
                 ) ** -0.5


def _row(setting: str, method: str, features: int | None, inputs: Inputs, *,
         seed: int, model_scale: float) -> dict[str, Any]:
    """The row of one configuration, metrics unset; ``seed`` is recorded where the
    method's output depends on it (``None`` otherwise); a variant's own ``scale`` other
    than ``model_scale`` (the model's) makes it no drop-in."""
    note = ""
    if method == BASELINE:
        target, exact = "softmax", True
    else:
        spec = get_method(method)
        caps = spec.capabilities
        target, exact = caps.target, caps.exact
        scale = dict(spec.preset).get("scale")
        if caps.target != "softmax":
            note = NOT_DROP_IN_GAUSSIAN
        elif scale is not None and not math.isclose(scale, model_scale, rel_tol=1e-6):
            note = NOT_DROP_IN_SCALE.format(scale=scale, model=model_scale)
        elif _learns(method):
            note = NOT_DROP_IN_LEARNED
    return {
        "setting": setting, "method": method, "target": target, "exact": exact,
        "drop_in": not note, "note": note, "num_features": features,
        "seed": seed if _seeded(method) else None, "texts": len(inputs.ids),
        "cosine_mean": None, "cosine_min": None, "recall_at_1": None, "time_ms": None,
        "peak_mib": None, "error": None,
    }


def hf_eval_steps(config: HFEvalConfig) -> int:
    """Runs ``evaluate`` makes: per setting, the exact model and every configuration."""
    return len(config.settings) * (1 + len(_configurations(config)))


def evaluate(config: HFEvalConfig = HFEvalConfig(),
             progress: Callable[[str], None] | None = None) -> HFEvalResult:
    """Run the evaluation; rows are in (setting, method, features) order."""
    from ...hf import restore_exact, set_attention
    from ...hf.model import check_layers

    config.validate()
    text = read_text(config.text)
    model, tokenizer, name = load_model(config.model)
    device = parse_device(config.device)
    model.to(device)
    check_layers(model, config.layers)  # before any work, not as a row per configuration
    # as Python ints: the memory measurement's process takes them as JSON
    layers = None if config.layers is None else [operator.index(i) for i in config.layers]
    check_seq_len(model, config.seq_len)
    scale = model_scale(model)
    rows: list[dict[str, Any]] = []
    described: dict[str, dict[str, Any]] = {}
    # every setting's inputs before any row: a text too short for the long setting
    # fails at once, not after the short setting's rows have run
    settings = {setting: build_inputs(tokenizer, text, setting, seq_len=config.seq_len,
                                      max_texts=config.max_texts)
                for setting in config.settings}
    for setting, inputs in settings.items():
        lengths = [len(x) for x in inputs.ids]
        described[setting] = {
            "count": len(lengths), "min_tokens": min(lengths),
            "mean_tokens": sum(lengths) / len(lengths), "max_tokens": max(lengths),
            "timed_texts": min(timed_texts(config, setting), len(lengths)),
        }
        timed_ids = [list(x) for x in inputs.ids[: timed_texts(config, setting)]]
        timed = pad_batch(timed_ids)
        timed_device = {k: v.to(device) for k, v in timed.items()}
        restore_exact(model)
        exact = embed_all(model, inputs, config.batch_size)
        for method, features in [(BASELINE, None), *_configurations(config)]:
            row = _row(setting, method, features, inputs, seed=config.seed, model_scale=scale)
            options = {} if features is None else {"num_features": features}
            if progress:
                progress(f"{setting}: {method}" + (f" ({features} features)" if features else ""))
            try:
                if method != BASELINE:
                    set_attention(model, method, layers=layers, seed=config.seed, **options)
                row.update(quality(embed_all(model, inputs, config.batch_size), exact))

                def forward(batch: dict[str, Tensor] = timed_device) -> None:
                    with torch.no_grad():
                        model(**batch)

                row["time_ms"] = 1e3 * median_seconds(
                    forward, device=device, warmup=1, repeats=config.repeats,
                    clock=config.clock)
                if config.memory:
                    job = CallJob("skyformer.eval.hf.run:memory_probe", {
                        "model_dir": config.model, "method": method, "options": options,
                        "layers": layers, "seed": config.seed,
                        "input_ids": timed_ids,  # padded there, with their mask
                        "threads": torch.get_num_threads(), "device": str(device),
                    }, methods=() if method == BASELINE else (method,))
                    peak, reason = peak_memory_or_reason(job, device)
                    if peak is None:  # the row keeps its metrics and time
                        row["note"] = "; ".join(filter(None, (row["note"], reason)))
                    else:
                        row["peak_mib"] = peak / 2**20
            except (CapabilityError, ValueError) as err:  # e.g. no mask support: say why
                row["error"] = str(err)
            finally:
                restore_exact(model)
            rows.append(row)
    return HFEvalResult(config, name, described, rows, environment(device))
