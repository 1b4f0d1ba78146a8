"""GloVe-format reading, on tiny files written by the tests."""

from __future__ import annotations

import pytest
import torch

from skyformer.eval.data.glove import read_glove


def write_glove(path, rows, header=None):
    lines = [header] if header else []
    lines += [f"w{i} " + " ".join(f"{x:.4f}" for x in row) for i, row in enumerate(rows)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_reads_the_first_vectors(tmp_path):
    rows = torch.arange(30.0).reshape(10, 3).tolist()
    path = write_glove(tmp_path / "g.txt", rows)
    x = read_glove(path, 4)
    assert x.shape == (4, 3) and x.dtype == torch.float64
    assert torch.equal(x, torch.tensor(rows[:4], dtype=torch.float64))


def test_word2vec_header_and_words_with_spaces(tmp_path):
    path = tmp_path / "g.txt"
    path.write_text("3 2\nhello 1 2\nat name@x.com 3 4\n. 5 6\n", encoding="utf-8")
    assert read_glove(path, 3).tolist() == [[1, 2], [3, 4], [5, 6]]


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_glove(tmp_path / "missing.txt", 1)
    with pytest.raises(IsADirectoryError, match="is a folder; pass --glove FILE"):
        read_glove(tmp_path, 1)
    short = write_glove(tmp_path / "short.txt", [[1.0, 2.0]] * 3)
    with pytest.raises(ValueError, match="holds 3 vectors, 5 are needed"):
        read_glove(short, 5)
    bad = tmp_path / "bad.txt"
    bad.write_text("a 1 2\nb 1\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 2 has 1 numbers, the first vector has 2"):
        read_glove(bad, 2)
    words = tmp_path / "words.txt"
    words.write_text("a 1 2\nb x y\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 2 is not in GloVe format"):
        read_glove(words, 2)
    lonely = tmp_path / "lonely.txt"
    lonely.write_text("a\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no numbers after the word"):
        read_glove(lonely, 1)
