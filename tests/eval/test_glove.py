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


@pytest.mark.parametrize("before", ["\ufeff", "\n", "\ufeff \n\n"])
def test_a_header_after_a_byte_order_mark_or_blank_lines_is_skipped(tmp_path, before):
    """A byte-order mark or a blank line before the word2vec header hid it: the header
    was read as a word with one number, and the next line refused as inconsistent."""
    path = tmp_path / "g.txt"
    path.write_text(before + "2 2\nhello 1 2\nworld 3 4\n", encoding="utf-8")
    assert read_glove(path, 2).tolist() == [[1, 2], [3, 4]]
    path.write_text(before + "2 1\n7 3\n8 4\n", encoding="utf-8")  # words that are numbers
    assert read_glove(path, 2).tolist() == [[3], [4]]  # only the first line is a header


def test_a_word_of_unicode_spaces_is_one_field(tmp_path):
    """GloVe splits at spaces and tabs only: a word that is or holds NBSP or U+3000 was
    split by str.split() and the file refused as inconsistent."""
    path = tmp_path / "g.txt"
    path.write_text("the 1 2\n\u00a0 3 4\nx\u30001 5 6\ntab\t7\t8\n", encoding="utf-8")
    assert read_glove(path, 4).tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]]


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


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
@pytest.mark.parametrize("line", [1, 3])
def test_a_non_finite_value_is_refused_naming_file_and_line(tmp_path, value, line):
    """It was read, and approx then failed in an SVD naming neither."""
    rows = [[0.5, 1.0, 2.0]] * 4
    lines = [f"w{i} " + " ".join(map(str, row)) for i, row in enumerate(rows)]
    lines[line - 1] = f"w{line - 1} 0.5 {value} 2.0"
    path = tmp_path / "g.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"g.txt' line {line} holds '{value}', not a "
                                         r"finite number; .*fix or remove that line"):
        read_glove(path, 4)


def test_a_line_wider_than_the_file_is_refused_not_cut_to_its_last_numbers(tmp_path):
    """32 numbers in a 16-d file gave the last 16."""
    path = write_glove(tmp_path / "g.txt", [[0.25] * 16] * 4)
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[2] = "w2 " + " ".join(["1.0"] * 32)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"g.txt' line 3 has 32 numbers after the word, the "
                                         r"first vector has 16; the file is not a consistent"):
        read_glove(path, 4)
    assert read_glove(path, 2).shape == (2, 16)  # the lines before it still read


def test_words_with_spaces_and_words_that_are_numbers(tmp_path):
    """The vector is the run of numbers at the end after the first field: a spaced word
    (glove.840B's ". . .") on any line, line 1 included, and a word that is a number."""
    path = tmp_path / "g.txt"
    path.write_text("new york 1 2\n. . . 3 4\n2010 5 6\nat name@x.com 7 8\n",
                    encoding="utf-8")
    assert read_glove(path, 4).tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]]
    spaced = tmp_path / "spaced.txt"
    spaced.write_text("a 1 2\nroute 66 3 4\n", encoding="utf-8")  # ambiguous: a 3-d vector
    with pytest.raises(ValueError, match="line 2 has 3 numbers after the word, the first "
                                         "vector has 2"):
        read_glove(spaced, 2)
