"""Each task's reader on a tiny fixture in the LRA release format, through the cache."""

from __future__ import annotations

import json

import numpy as np
import pytest

from skyformer.lra import load_cache, prepare
from skyformer.lra.cache import data_fingerprint
from skyformer.lra.readers.common import count_rows, tsv_rows
from skyformer.lra.vocab import LISTOPS_IDS
from tests.lra.release_files import (
    make_aan,
    make_cifar,
    make_imdb,
    make_listops_release,
    make_pathfinder_release,
    write_tsv,
)


def _tokens(split, i, segment=0):
    n = split.lengths[i, segment]
    return np.asarray(split.tokens[i, segment, :n])


def test_listops_tokens_drop_parentheses_and_keep_targets(tmp_path):
    rows = make_listops_release(tmp_path / "src")
    data = load_cache(prepare("listops", tmp_path / "src", tmp_path / "cache").parent, "listops")
    assert data.max_len == 2000 and data.task.segments == 1
    train = data.splits["train"]
    assert len(train) == 3 and len(data.splits["dev"]) == 1 and len(data.splits["test"]) == 2
    ids = [LISTOPS_IDS[t] for t in ("[MAX", "2", "9", "]")]
    assert _tokens(train, 0).tolist() == ids
    assert train.labels.tolist() == [t for _, t in rows["basic_train.tsv"]]
    assert np.all(np.asarray(train.tokens[0, 0, 4:]) == 0), "right padded with 0"
    assert data.splits["test"].lengths[0, 0] == 1  # a bare digit is a valid tree


def test_listops_reference_tokens_drop_closing_brackets_and_are_recorded(tmp_path):
    """The pipeline of the Skyformer code split on non-word characters: operators and
    digits only (14 ids), and the cache says which tokens it holds."""
    make_listops_release(tmp_path / "src")
    lra = load_cache(prepare("listops", tmp_path / "src", tmp_path / "a").parent, "listops")
    ref = load_cache(prepare("listops", tmp_path / "src", tmp_path / "b", tokens="reference"
                             ).parent, "listops")
    assert "tokens" not in lra.meta and ref.meta["tokens"] == "reference"
    for split in ("train", "dev", "test"):
        for i in range(len(lra.splits[split])):
            kept = [t for t in _tokens(lra.splits[split], i).tolist() if t != LISTOPS_IDS["]"]]
            assert _tokens(ref.splits[split], i).tolist() == kept
    assert _tokens(ref.splits["train"], 0).tolist() == [LISTOPS_IDS[t] for t in ("[MAX", "2", "9")]
    write_tsv(tmp_path / "src" / "basic_val.tsv", [["( ] )", "2"]], ["Source", "Target"])
    with pytest.raises(ValueError, match=r"basic_val.tsv line 2: Source \(column 1\) holds no "
                       r"ListOps token \(parentheses and '\]' do not count\)"):
        prepare("listops", tmp_path / "src", tmp_path / "c", tokens="reference")
    with pytest.raises(ValueError, match="ListOps tokens must be one of lra, reference, got 'tf'"):
        prepare("listops", tmp_path / "src", tmp_path / "c", tokens="tf")


def test_listops_errors_name_the_file_and_line(tmp_path):
    make_listops_release(tmp_path / "src")
    write_tsv(tmp_path / "src" / "basic_val.tsv", [["( [MAX 2 FOO ] )", "2"]], ["Source", "Target"])
    with pytest.raises(ValueError, match=r"basic_val.tsv line 2: unknown token 'FOO'"):
        prepare("listops", tmp_path / "src", tmp_path / "cache")
    assert not (tmp_path / "cache" / "listops").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [], "no partial cache left"
    write_tsv(tmp_path / "src" / "basic_val.tsv", [["[MAX 2 ]", "2", "x"]], ["Source", "Target"])
    with pytest.raises(ValueError, match="expected 2 tab-separated columns, got 3"):
        prepare("listops", tmp_path / "src", tmp_path / "cache")
    (tmp_path / "src" / "basic_val.tsv").write_bytes(b"Source\tTarget\n[MAX 2 ]\t2\xe9\n")
    with pytest.raises(ValueError, match=r"basic_val.tsv line 2: not UTF-8 \(byte 0xe9"):
        prepare("listops", tmp_path / "src", tmp_path / "cache")
    # a line of a non-ASCII blank is a row (counted as one), not skipped
    (tmp_path / "src" / "basic_val.tsv").write_text("Source\tTarget\n\u00a0\n[MAX 2 ]\t2\n")
    with pytest.raises(ValueError, match=r"basic_val.tsv line 2: expected 2 tab-separated"):
        prepare("listops", tmp_path / "src", tmp_path / "cache")
    for target in ("9.0", "", "10", "-1"):
        write_tsv(tmp_path / "src" / "basic_val.tsv", [["[MAX 2 ]", "2"], ["[MAX 2 ]", target]],
                  ["Source", "Target"])
        with pytest.raises(ValueError, match=r"basic_val.tsv line 3: Target \(column 2\) must be "
                           rf"a digit 0-9, got '{target}'\."):
            prepare("listops", tmp_path / "src", tmp_path / "cache")
    (tmp_path / "src" / "basic_test.tsv").unlink()
    with pytest.raises(FileNotFoundError, match=r"basic_test.tsv"):
        prepare("listops", tmp_path / "src", tmp_path / "cache")


@pytest.mark.parametrize("task", ["listops", "retrieval", "image", "text", "pathfinder"])
def test_an_archive_given_as_src_asks_for_the_unpacked_folder(tmp_path, task):
    """An archive (or one file of the release) as --src: "expected 'x' in F; looked for
    F/x" did not say that F was a file."""
    archive = tmp_path / "release.tar.gz"
    archive.write_bytes(b"\x1f\x8b")
    with pytest.raises(FileNotFoundError, match=r"release.tar.gz is a file; --src takes the "
                       r"folder holding .*unpack an archive first"):
        prepare(task, archive, tmp_path / "cache")


def test_a_damaged_generator_record_is_named(tmp_path):
    """A generator.json that is not JSON raised a bare JSONDecodeError naming no file."""
    make_listops_release(tmp_path / "src")
    (tmp_path / "src" / "generator.json").write_text('{"seed": 0,')
    with pytest.raises(ValueError, match=r"generator.json is damaged \(.*\): it records how "
                       r"`skyformer lra generate listops` made the files beside it"):
        prepare("listops", tmp_path / "src", tmp_path / "cache")


def test_count_rows_counts_the_rows_tsv_rows_reads(tmp_path):
    # The split length comes from count_rows and the rows from tsv_rows: they must agree on
    # the header, on blank lines (ASCII whitespace only, CRLF too) and on the line numbers.
    path = tmp_path / "rows.tsv"
    path.write_bytes(b"Source\tTarget\r\n\r\na\t1\r\n \t\x0b\n\xc2\xa0\tx\nb\t2\n\n")
    rows = list(tsv_rows(path, 2, header="Source"))
    assert rows == [(3, ["a", "1"]), (5, ["\u00a0", "x"]), (6, ["b", "2"])]
    assert count_rows(path, header="Source") == len(rows) == 3
    # without a header, or with one that does not match, the first line is a row
    assert count_rows(path) == len(list(tsv_rows(path, 2))) == 4
    assert count_rows(path, header="label") == 4
    path.write_bytes(b"a\t1\nb\t\xff\n")
    assert count_rows(path) == 2  # counting does not decode
    with pytest.raises(ValueError, match=r"rows.tsv line 2: not UTF-8 \(byte 0xff at column 3"):
        list(tsv_rows(path, 2))


def test_a_utf8_bom_opening_a_tsv_file_is_not_content(tmp_path):
    # an editor saving "UTF-8 with BOM" puts EF BB BF before the header (ListOps) or the
    # first row's label (AAN): the file's encoding mark, not part of its first field
    rows = make_listops_release(tmp_path / "listops")
    path = tmp_path / "listops" / "basic_train.tsv"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    data = load_cache(prepare("listops", tmp_path / "listops", tmp_path / "c").parent, "listops")
    assert data.splits["train"].labels.tolist() == [t for _, t in rows["basic_train.tsv"]]
    files = make_aan(tmp_path / "aan")
    path = files["new_aan_pairs.eval.tsv"]
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    data = load_cache(prepare("retrieval", tmp_path / "aan", tmp_path / "c").parent, "retrieval")
    assert data.splits["dev"].labels.tolist() == [0]
    assert list(tsv_rows(path, 5)) == [(1, ["0", "a4", "b4", "alpha", "beta"])]
    assert count_rows(path) == 1


def test_imdb_bytes_labels_and_seeded_dev_split(tmp_path):
    make_imdb(tmp_path)
    folder = prepare("text", tmp_path, tmp_path / "cache", dev_fraction=0.25)
    data = load_cache(folder.parent, "text")
    train, dev, test = (data.splits[s] for s in ("train", "dev", "test"))
    assert (len(train), len(dev), len(test)) == (6, 2, 4)
    assert data.meta["dev_fraction"] == 0.25 and not data.meta.get("dev_is_test")
    # Test split in file order: neg then pos; bytes + 1, UTF-8 encoded.
    assert test.labels.tolist() == [0, 0, 1, 1]
    expected = np.frombuffer("Brilliant caf\u00e9 scene".encode(), dtype=np.uint8) + 1
    assert _tokens(test, 2).tolist() == expected.tolist()
    assert data.task.vocab_size == 257 and data.splits["test"].tokens.dtype == np.uint16
    train_texts = {bytes((_tokens(train, i) - 1).astype(np.uint8)) for i in range(len(train))}
    dev_texts = {bytes((_tokens(dev, i) - 1).astype(np.uint8)) for i in range(len(dev))}
    assert len(train_texts | dev_texts) == 8 and not train_texts & dev_texts


def test_imdb_reviews_are_stripped_of_surrounding_whitespace_as_tfds_reads_them(tmp_path):
    # TFDS's imdb_reviews, which LRA reads, keeps read().strip() of each file: bytes
    # inside the review (a BOM, inner spaces) stay, ASCII whitespace around it goes
    root = make_imdb(tmp_path)
    (root / "test" / "pos" / "0_7.txt").write_bytes(b"\xef\xbb\xbf  Two  words \r\n\t")
    data = load_cache(prepare("text", tmp_path, tmp_path / "c").parent, "text")
    text = bytes((_tokens(data.splits["test"], 2) - 1).astype(np.uint8))
    assert text == b"\xef\xbb\xbf  Two  words"
    (root / "test" / "pos" / "0_7.txt").write_bytes(b" \r\n")
    with pytest.raises(ValueError, match=r"test/pos/0_7\.txt holds only whitespace.*delete the "
                       "file or give it its text"):
        prepare("text", tmp_path, tmp_path / "c")


def test_imdb_hidden_files_a_mac_writes_are_no_reviews(tmp_path):
    """A tree copied by a Mac to another disk, or tarred there, holds a binary
    "._NAME.txt" beside every review: each was read as one more review of its label
    (and a "._NAME.npy" beside Pathfinder's metadata was refused as not UTF-8)."""
    root = make_imdb(tmp_path)
    for review in list(root.glob("*/*/*.txt")):
        (review.parent / f"._{review.name}").write_bytes(b"\x00\x05\x16\x07Mac OS X")
    data = load_cache(prepare("text", tmp_path, tmp_path / "c", dev_fraction=0.25).parent,
                      "text")
    assert [len(data.splits[s]) for s in ("train", "dev", "test")] == [6, 2, 4]
    # and Pathfinder's metadata files: refused as text that is not UTF-8
    pf, _ = make_pathfinder_release(tmp_path / "pf", count=20)
    metadata = pf / "curv_contour_length_14" / "metadata"
    for listed in list(metadata.glob("*.npy")):
        (metadata / f"._{listed.name}").write_bytes(b"\x00\x05\x16\x07Mac OS X\xb0")
    data = load_cache(prepare("pathfinder", pf, tmp_path / "c").parent, "pathfinder")
    assert sum(len(data.splits[s]) for s in ("train", "dev", "test")) == 20


def test_imdb_dev_fraction_zero_validates_on_test_and_says_so(tmp_path):
    make_imdb(tmp_path)
    data = load_cache(prepare("text", tmp_path / "aclImdb", tmp_path / "c", dev_fraction=0).parent,
                      "text")
    assert data.meta["dev_is_test"] is True
    # the test reviews (negative first) in a seeded order: a dev check reads the first
    # batches of its split, which were all negative
    order = np.random.default_rng(0).permutation(4)
    assert not np.array_equal(order, np.arange(4))
    dev, test = data.splits["dev"], data.splits["test"]
    assert np.array_equal(dev.tokens, test.tokens[order])
    assert np.array_equal(dev.labels, test.labels[order]) and test.labels.tolist() == [0, 0, 1, 1]


def test_imdb_truncates_to_max_len_and_reports_missing_folders(tmp_path):
    root = make_imdb(tmp_path)
    data = load_cache(prepare("text", tmp_path, tmp_path / "c", max_len=5).parent, "text")
    assert data.splits["train"].tokens.shape[-1] == 5
    assert data.meta["splits"]["train"]["truncated"] > 0
    for f in (root / "test" / "neg").iterdir():
        f.unlink()
    with pytest.raises(FileNotFoundError, match=r"test/neg holds no \*.txt"):
        prepare("text", tmp_path, tmp_path / "c")


def test_aan_pairs_become_two_segments(tmp_path):
    make_aan(tmp_path)
    folder = prepare("retrieval", tmp_path, tmp_path / "c", max_len=16)
    data = load_cache(folder.parent, "retrieval")
    train = data.splits["train"]
    assert train.tokens.shape == (3, 2, 16) and train.labels.tolist() == [1, 0, 1]
    assert bytes((_tokens(train, 0, 1) - 1).astype(np.uint8)) == b"parsing graphs"
    assert train.lengths[2].tolist() == [16, 1]


def test_aan_bad_label_names_the_line(tmp_path):
    files = make_aan(tmp_path)
    write_tsv(files["new_aan_pairs.eval.tsv"], [["0", "a", "b", "t1", "t2"],
                                                ["maybe", "a", "b", "t1", "t2"]])
    with pytest.raises(ValueError, match=r"eval.tsv line 2: the label column holds 'maybe'"):
        prepare("retrieval", tmp_path, tmp_path / "c")


def test_an_empty_document_is_named_by_file_and_line(tmp_path):
    """Not by its index in the data: by the line of the file (1-based, a header counted),
    with what to do about it; no cache is left behind."""
    files = make_aan(tmp_path / "aan")
    write_tsv(files["new_aan_pairs.eval.tsv"], [["0", "a", "b", "t1", "t2"],
                                                ["1", "a", "b", "t1", ""]])
    with pytest.raises(ValueError, match=r"new_aan_pairs\.eval\.tsv line 2: text2 \(column 5\) "
                       r"is empty.*delete the line or give it its text, then prepare again"):
        prepare("retrieval", tmp_path / "aan", tmp_path / "cache")
    write_tsv(files["new_aan_pairs.eval.tsv"], [["0", "a", "b", "", "t2"]],
              header=["label", "id1", "id2", "text1", "text2"])
    with pytest.raises(ValueError, match=r"eval\.tsv line 2: text1 \(column 4\) is empty"):
        prepare("retrieval", tmp_path / "aan", tmp_path / "cache")
    make_listops_release(tmp_path / "listops")
    write_tsv(tmp_path / "listops" / "basic_test.tsv", [["7", "7"], ["( )", "3"]],
              ["Source", "Target"])
    with pytest.raises(ValueError, match=r"basic_test\.tsv line 3: Source \(column 1\) holds "
                       r"no ListOps token"):
        prepare("listops", tmp_path / "listops", tmp_path / "cache")
    root = make_imdb(tmp_path / "imdb")
    (root / "test" / "pos" / "1_7.txt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"test/pos/1_7\.txt is empty.*delete the file"):
        prepare("text", tmp_path / "imdb", tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_cifar_grey_levels_and_lra_split(tmp_path):
    rgb, labels = make_cifar(tmp_path, records=10)
    data = load_cache(prepare("image", tmp_path, tmp_path / "c").parent, "image")
    train, dev, test = (data.splits[s] for s in ("train", "dev", "test"))
    assert (len(train), len(dev), len(test)) == (45, 5, 10)
    # Independent recomputation, pixel by pixel, as tf.image.rgb_to_grayscale on uint8:
    # float32 channels / 255, the weighted sum, then uint8(trunc(255.5 g)); it differs
    # from rounding the float64 sum on about a quarter of the pixels
    f32 = np.float32
    grey = np.array([[int(((f32(r) * f32(1 / 255) * f32(0.2989)
                            + f32(g) * f32(1 / 255) * f32(0.5870))
                           + f32(b) * f32(1 / 255) * f32(0.1140)) * f32(255.5))
                      for r, g, b in zip(*image, strict=True)] for image in rgb],
                    dtype=np.uint8)
    assert np.array_equal(np.asarray(train.tokens[:, 0]), grey[:45])
    assert np.array_equal(np.asarray(dev.tokens[:, 0]), grey[45:50])
    assert np.array_equal(np.asarray(test.tokens[:, 0]), grey[50:])
    assert test.labels.tolist() == labels[50:].tolist()
    assert data.max_len == 1024 and int(train.lengths.min()) == 1024
    from skyformer.lra.readers.image import grey_levels
    pixel = np.array([[[69], [78], [10]]], dtype=np.uint8)
    assert grey_levels(pixel).item() == 67  # 67.7 truncated; rounding the float64 sum gave 68


def test_cifar_wrong_size_names_the_file(tmp_path):
    make_cifar(tmp_path, records=2)
    path = tmp_path / "cifar-10-batches-bin" / "data_batch_3.bin"
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(ValueError, match=r"data_batch_3.bin has 6139 bytes"):
        prepare("image", tmp_path, tmp_path / "c")


def test_cifar_label_out_of_range_names_the_record(tmp_path):
    make_cifar(tmp_path, records=3)
    path = tmp_path / "cifar-10-batches-bin" / "test_batch.bin"
    data = bytearray(path.read_bytes())
    data[2 * 3073] = 12  # the label byte of the third record
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"test_batch.bin record 3 \(byte offset 6146\) has "
                       r"label 12; CIFAR-10 labels are 0-9: the file is damaged, unpack it "
                       r"again from cifar-10-binary.tar.gz\."):
        prepare("image", tmp_path, tmp_path / "c")


@pytest.mark.parametrize("given", ["folder", "parent"])
def test_cifar_python_version_says_which_version_to_get(tmp_path, given):
    """The python version (pickles, as torchvision downloads it) is named as such, with
    the binary version to get instead, not only as a missing data_batch_1.bin."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta"):
        (folder / name).write_bytes(b"\x80\x04")
    src = folder if given == "folder" else tmp_path
    with pytest.raises(FileNotFoundError, match=r"cifar-10-batches-py holds CIFAR-10's python "
                       r"version .* cifar-10-binary.tar.gz"):
        prepare("image", src, tmp_path / "c")


def test_pathfinder_layout_skips_empty_images_and_splits_80_10_10(tmp_path):
    root, images = make_pathfinder_release(tmp_path, count=20)
    data = load_cache(prepare("pathfinder", root, tmp_path / "c").parent, "pathfinder")
    splits = [data.splits[s] for s in ("train", "dev", "test")]
    assert [len(s) for s in splits] == [16, 2, 2]
    assert data.meta["empty_images_skipped"] == 1 and data.max_len == 1024
    assert not data.synthetic
    by_pixels = {pixels.tobytes(): label for pixels, label in images.values()}
    seen = 0
    for split in splits:
        for i in range(len(split)):
            key = np.asarray(split.tokens[i, 0]).tobytes()
            assert by_pixels[key] == split.labels[i]
            seen += 1
    assert seen == 20


def test_pathfinder_wrong_size_image_is_an_error(tmp_path):
    from PIL import Image

    root, _ = make_pathfinder_release(tmp_path, count=20)
    bad = root / "curv_contour_length_14" / "imgs" / "1" / "sample_3.png"
    Image.fromarray(np.zeros((16, 16), dtype=np.uint8), mode="L").save(bad)
    with pytest.raises(ValueError, match=r"sample_3.png is 16 x 16 pixels; expected 32 x 32"):
        prepare("pathfinder", root, tmp_path / "c")
    bad.write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"sample_3.png is not a readable image"):
        prepare("pathfinder", root, tmp_path / "c")



def test_pathfinder_sizes_are_named_from_the_first_listed_image(tmp_path):
    """The first listed image sets the size: one not square was said to be expected
    "None x None", and one of another size blamed the next, correct, image alone."""
    from PIL import Image

    from skyformer.lra.readers.pathfinder import _metadata

    root, _ = make_pathfinder_release(tmp_path, count=20)
    first = _metadata(root / "curv_contour_length_14")[0][0][0]
    Image.fromarray(np.zeros((32, 33), dtype=np.uint8), mode="L").save(first)
    with pytest.raises(ValueError, match=rf"{first.name} is 33 x 32 pixels; Pathfinder's "
                                         r"images are square\.$"):
        prepare("pathfinder", root, tmp_path / "c")
    Image.fromarray(np.zeros((64, 64), dtype=np.uint8), mode="L").save(first)
    with pytest.raises(ValueError, match=rf"is 32 x 32 pixels; expected 64 x 64 \(.*"
                                         rf"{first.name}, the first image listed, is\)"):
        prepare("pathfinder", root, tmp_path / "c")


def test_pathfinder_metadata_that_is_not_text_names_the_file_and_line(tmp_path):
    # the release's metadata/*.npy are text; a NumPy array saved there, or a damaged
    # line, is named as a ListOps or AAN file would be, not by the codec alone
    root, _ = make_pathfinder_release(tmp_path, count=10)
    meta = root / "curv_contour_length_14" / "metadata" / "1.npy"
    meta.write_bytes(meta.read_bytes() + b"imgs/1 caf\xe9.png 3 1\n")
    with pytest.raises(ValueError, match=r"metadata/1\.npy line 6: not UTF-8 \(byte 0xe9 at "
                       r"column 11\)"):
        prepare("pathfinder", root, tmp_path / "c")
    np.save(meta, np.zeros(3))
    with pytest.raises(ValueError, match=r"metadata/1\.npy line 1: not UTF-8 \(byte 0x93 at "
                       r"column 1\)"):
        prepare("pathfinder", root, tmp_path / "c")


def test_pathfinder_difficulty_that_contradicts_a_difficulty_folder_is_refused(tmp_path):
    """--src a difficulty folder with --difficulty naming another: the flag was ignored."""
    root, _ = make_pathfinder_release(tmp_path, count=20)
    folder = root / "curv_contour_length_14"
    with pytest.raises(ValueError, match=r"curv_contour_length_14 is itself a difficulty folder "
                       r"\(it holds metadata/\), not curv_baseline; drop --difficulty"):
        prepare("pathfinder", folder, tmp_path / "c", difficulty="curv_baseline")
    # the folder's own name, or picked from the resolution folder or the release's root
    for src in (folder, root, root.parent):
        cache = prepare("pathfinder", src, tmp_path / "c", difficulty="curv_contour_length_14")
        assert json.loads((cache / "meta.json").read_text())["difficulty"] == folder.name
    # a link named as the difficulty, to a folder named otherwise: the name given counts,
    # as the metadata records it
    (tmp_path / "links").mkdir()
    link = tmp_path / "links" / "curv_baseline"
    link.symlink_to(folder, target_is_directory=True)
    cache = prepare("pathfinder", link, tmp_path / "c", difficulty="curv_baseline")
    assert json.loads((cache / "meta.json").read_text())["difficulty"] == "curv_baseline"


@pytest.mark.parametrize("src", [".", "imgs/.."])
def test_pathfinder_difficulty_is_the_folders_name_when_given_relative(tmp_path, monkeypatch,
                                                                      src):
    # prepared from inside the difficulty folder: the same data, the same record
    root, _ = make_pathfinder_release(tmp_path, count=10)
    by_path = json.loads((prepare("pathfinder", root, tmp_path / "a") / "meta.json").read_text())
    monkeypatch.chdir(root / "curv_contour_length_14")
    here = json.loads((prepare("pathfinder", src, tmp_path / "b") / "meta.json").read_text())
    assert here["difficulty"] == by_path["difficulty"] == "curv_contour_length_14"
    assert data_fingerprint(here) == data_fingerprint(by_path)


def test_meta_records_counts_and_source(tmp_path):
    make_listops_release(tmp_path / "src")
    folder = prepare("listops", tmp_path / "src", tmp_path / "cache", max_len=6)
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["splits"]["train"]["count"] == 3
    assert meta["splits"]["train"]["label_counts"][9] == 1
    assert meta["max_len"] == 6 and meta["source"].endswith("src")


def test_an_empty_split_is_named_by_its_file_or_its_images(tmp_path):
    """A split without examples names where it was read from, not only the split."""
    make_listops_release(tmp_path / "lo")
    write_tsv(tmp_path / "lo" / "basic_val.tsv", [], header=["Source", "Target"])
    with pytest.raises(ValueError, match=r"the dev split of listops has no examples: "
                       r".*basic_val.tsv holds no rows"):
        prepare("listops", tmp_path / "lo", tmp_path / "cache")
    make_aan(tmp_path / "aan")
    (tmp_path / "aan" / "new_aan_pairs.test.tsv").write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"test split of retrieval has no examples: "
                       r".*new_aan_pairs.test.tsv holds no rows"):
        prepare("retrieval", tmp_path / "aan", tmp_path / "cache")
    root, _ = make_pathfinder_release(tmp_path / "pf", count=4)
    with pytest.raises(ValueError, match=r"the dev split of pathfinder has no examples: "
                       r".*curv_contour_length_14 lists 4 readable images, too few for its "
                       r"80/10/10 split"):
        prepare("pathfinder", root, tmp_path / "cache")
    make_imdb(tmp_path / "imdb")  # 8 training reviews
    with pytest.raises(ValueError, match=r"the train split of text has no examples: "
                       r"--dev-fraction 0.95 holds out all 8 training reviews under "):
        prepare("text", tmp_path / "imdb", tmp_path / "cache", dev_fraction=0.95)
