"""The array cache: complete-or-nothing writes, safe reads, clear errors."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from skyformer.lra.cache import SplitSource, load_cache, write_cache
from skyformer.lra.tasks import get_task

LISTOPS = get_task("listops")


def _split(n, start=1):
    return SplitSource(n, (([np.arange(start, start + 1 + i % 3)], i % 10) for i in range(n)))


def _splits(n=4):
    return {"train": _split(n), "dev": _split(2), "test": _split(2)}


def test_round_trip_with_lengths_padding_and_readonly_memmaps(tmp_path):
    write_cache(tmp_path, LISTOPS, _splits(), max_len=5)
    data = load_cache(tmp_path, "listops")
    train = data.splits["train"]
    assert train.tokens.shape == (4, 1, 5) and train.tokens.dtype == np.uint8
    assert train.lengths[:, 0].tolist() == [1, 2, 3, 1]
    assert np.asarray(train.tokens[2, 0]).tolist() == [1, 2, 3, 0, 0]
    assert isinstance(train.tokens, np.memmap) and not train.tokens.flags.writeable
    assert data.meta["splits"]["train"]["label_counts"][:4] == [1, 1, 1, 1]


def test_truncated_counts_only_documents_longer_than_max_len(tmp_path):
    lengths = [4, 5, 6, 9]  # max_len 5: two documents lose tokens, one fits exactly
    train = SplitSource(4, (([np.ones(n, dtype=np.int64)], 0) for n in lengths))
    write_cache(tmp_path, LISTOPS, {**_splits(), "train": train}, max_len=5)
    data = load_cache(tmp_path, "listops")
    assert data.meta["splits"]["train"]["truncated"] == 2
    assert data.splits["train"].lengths[:, 0].tolist() == [4, 5, 5, 5]
    assert data.meta["splits"]["dev"]["truncated"] == 0


def test_a_failing_write_keeps_the_previous_cache_and_leaves_no_temporary(tmp_path):
    write_cache(tmp_path, LISTOPS, _splits(), max_len=5)

    def broken():
        yield [np.array([1, 2])], 3
        raise OSError("disk on fire")

    splits = _splits()
    splits["test"] = SplitSource(2, broken())
    with pytest.raises(OSError, match="disk on fire"):
        write_cache(tmp_path, LISTOPS, splits, max_len=7)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["listops"]
    assert load_cache(tmp_path, "listops").max_len == 5


def test_counts_labels_and_token_ids_are_checked(tmp_path):
    splits = _splits()
    splits["dev"] = _split(3)
    splits["dev"].count = 2
    with pytest.raises(ValueError, match="yields more than the 2 examples announced"):
        write_cache(tmp_path, LISTOPS, splits, max_len=5)
    splits = _splits()
    splits["dev"] = SplitSource(5, iter([([np.array([1])], 0)]))
    with pytest.raises(ValueError, match="announced 5 examples but yielded 1"):
        write_cache(tmp_path, LISTOPS, splits, max_len=5)
    splits = _splits()
    splits["test"] = SplitSource(1, iter([([np.array([1])], 10)]))
    with pytest.raises(ValueError, match=r"label 10 is outside 0..9"):
        write_cache(tmp_path, LISTOPS, splits, max_len=5)
    splits = _splits()
    splits["test"] = SplitSource(1, iter([([np.array([16])], 1)]))
    with pytest.raises(ValueError, match=r"token ids must lie in 0..15"):
        write_cache(tmp_path, LISTOPS, splits, max_len=5)
    assert list(tmp_path.iterdir()) == []


def test_missing_or_damaged_caches_say_how_to_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="skyformer lra prepare listops"):
        load_cache(tmp_path, "listops")
    folder = write_cache(tmp_path, LISTOPS, _splits(), max_len=5)
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "format": 99}))
    with pytest.raises(ValueError, match="prepare the task again"):
        load_cache(tmp_path, "listops")
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / "dev.labels.npy").write_bytes(b"junk")
    with pytest.raises(ValueError, match=r"cannot read .*dev.labels.npy"):
        load_cache(tmp_path, "listops")


def test_a_tasks_own_folder_given_as_the_cache_root_names_its_parent(tmp_path):
    """--cache data/cache/listops was answered with a prepare command for that same path."""
    folder = write_cache(tmp_path, LISTOPS, _splits(), max_len=5)
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"{folder} is a task's folder (it holds meta.json), not the cache root: pass "
            f"its parent, --cache {tmp_path}.")):
        load_cache(folder, "listops")
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"--cache {tmp_path} (it holds listops; text is prepared into text/ there).")):
        load_cache(folder, "text")


@pytest.mark.parametrize(("task", "source"), [
    ("listops", r", or a folder `skyformer lra generate listops --out PATH` writes"),
    ("text", r"\.$"),
])
def test_missing_data_says_what_the_source_path_is(tmp_path, task, source):
    """``lra train TASK --quick`` without prepared data said to run ``lra prepare TASK
    --src PATH`` without saying what PATH is; it now names the release's files and, for
    the tasks ``lra generate`` makes, that command."""
    with pytest.raises(FileNotFoundError, match=r"--src PATH --cache .*, PATH being "
                                                  r"the task's files of the public LRA "
                                                  r"release \(docs/lra.md\)" + source):
        load_cache(tmp_path, task)


def test_pickled_arrays_are_refused(tmp_path):
    folder = write_cache(tmp_path, LISTOPS, _splits(), max_len=5)
    np.save(folder / "test.labels.npy", np.array([{"a": 1}, {"b": 2}], dtype=object),
            allow_pickle=True)
    with pytest.raises(ValueError, match="cannot read"):
        load_cache(tmp_path, "listops")


def _damage(folder, name, array):
    np.save(folder / f"train.{name}.npy", array)


@pytest.mark.parametrize(("damage", "words"), [
    (lambda f: (f / "train.labels.npy").write_bytes(b""), "cannot read"),
    (lambda f: (f / "meta.json").write_text("[1, 2]"), "holds a list"),
    (lambda f: (f / "meta.json").write_text(json.dumps(
        {**json.loads((f / "meta.json").read_text()), "splits": None})), "example count"),
    (lambda f: _damage(f, "labels", np.array([0, 1, 99, 2])), "labels lie outside"),
    (lambda f: _damage(f, "lengths", np.zeros((4, 1), dtype=np.int32)), "lengths lie outside"),
    (lambda f: _damage(f, "lengths", np.full((4, 1), 9, dtype=np.int32)), "lengths lie outside"),
    (lambda f: _damage(f, "tokens", np.full((4, 1, 5), 250, dtype=np.uint8)),
     "token ids lie outside"),
    (lambda f: _damage(f, "tokens", np.ones((4, 1, 5), dtype=np.float32)), "not integers"),
    # a valid label changed by hand: only the digest prepare recorded tells
    (lambda f: _damage(f, "labels", np.array([1, 1, 2, 3])),
     r"the train arrays are not those meta.json recorded .* \(their SHA-256 differs\)"),
])
def test_a_damaged_cache_is_named_not_trained_on(tmp_path, damage, words):
    folder = write_cache(tmp_path, LISTOPS, _splits(), max_len=5)
    damage(folder)
    with pytest.raises(ValueError, match=words):
        load_cache(tmp_path, "listops")


def test_an_empty_document_is_refused_when_the_cache_is_written(tmp_path):
    splits = {**_splits(), "dev": SplitSource(1, iter([([np.array([], dtype=int)], 0)]))}
    with pytest.raises(ValueError, match="document 0 is empty"):
        write_cache(tmp_path, LISTOPS, splits, max_len=5)


def test_a_cache_root_with_a_tilde_is_the_home_folder(monkeypatch, tmp_path):
    """``SKYFORMER_LRA_CACHE=~/x`` (quoted in a shell, or set in a notebook) names a folder
    in the home folder, as ``--src`` does, not a folder called ``~`` in the working one."""
    from skyformer.lra.cache import CACHE_ENV, default_cache_root

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(CACHE_ENV, "~/lra-cache")
    assert default_cache_root() == tmp_path / "lra-cache"


@pytest.mark.parametrize(("src", "cache"), [("data", "data"), ("data/listops", "data")])
def test_preparing_into_the_folder_of_the_source_files_is_refused(tmp_path, src, cache):
    """The reader looks for a listops/ folder, so --src data --cache data named the
    source folder as the cache's task folder, which the build replaced whole: the .tsv
    files were deleted and "prepared" was printed."""
    from skyformer.lra import prepare
    from tests.lra.release_files import make_listops_release

    make_listops_release(tmp_path / "data" / "listops")
    before = sorted(p.name for p in (tmp_path / "data" / "listops").iterdir())
    with pytest.raises(FileExistsError, match=r"holds basic_test\.tsv, basic_train\.tsv, "
                       r"basic_val\.tsv, which a prepared cache does not: .*pass another "
                       r"--cache"):
        prepare("listops", tmp_path / src, tmp_path / cache)
    assert sorted(p.name for p in (tmp_path / "data" / "listops").iterdir()) == before
    prepare("listops", tmp_path / src, tmp_path / "cache")
    (tmp_path / "cache" / "listops" / ".DS_Store").write_bytes(b"")  # a file manager's
    prepare("listops", tmp_path / src, tmp_path / "cache")  # a cache is replaced
