"""ListOps and synthetic Pathfinder generators."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import deque

import numpy as np
import pytest

from skyformer.lra import ListOpsRules, load_cache, prepare, write_listops, write_pathfinder
from skyformer.lra.listops_gen import generate_examples, random_tree, tree_source, tree_value
from skyformer.lra.pathfinder_gen import PathfinderRules, draw_example
from skyformer.lra.vocab import LISTOPS_TOKENS


def evaluate_tokens(source: str) -> int:
    """Independent stack evaluator of a ListOps string (parentheses ignored)."""
    stack: list = []
    for token in source.split():
        if token in ("(", ")"):
            continue
        if token.startswith("["):
            stack.append((token, []))
        elif token == "]":
            op, args = stack.pop()
            s = sorted(args)
            value = {"[MIN": s[0], "[MAX": s[-1], "[SM": sum(s) % 10,
                     "[MED": int(np.median(s))}[op]
            if not stack:
                return value
            stack[-1][1].append(value)
        else:
            if not stack:
                return int(token)
            stack[-1][1].append(int(token))
    raise AssertionError("unbalanced expression")


def test_listops_values_match_an_independent_evaluator():
    rules = ListOpsRules(max_depth=5, max_args=6, min_length=10, max_length=200)
    rng = random.Random(3)
    checked = 0
    while checked < 300:
        tree, length = random_tree(rng, rules)
        source = tree_source(tree)
        tokens = [t for t in source.split() if t not in "()"]
        assert len(tokens) == length
        assert source.count("(") == source.count(")")
        assert set(tokens) <= set(LISTOPS_TOKENS)
        assert tree_value(tree) == evaluate_tokens(source)
        checked += 1


def test_listops_release_format_example():
    assert tree_source(("[MAX", [2, 9])) == "( ( ( [MAX 2 ) 9 ) ] )"
    assert tree_value(("[MED", [1, 2, 7, 9])) == 4  # mean of the middle pair, rounded down
    assert tree_value(("[SM", [9, 8, ("[MIN", [3, 5])])) == 0


def test_listops_lengths_bounds_distinctness_and_determinism():
    rules = ListOpsRules(max_depth=4, max_args=5, min_length=20, max_length=60)
    examples = generate_examples(200, rules, seed=1)
    lengths = [sum(t not in "()" for t in s.split()) for s, _ in examples]
    assert min(lengths) > 20 and max(lengths) < 60
    assert len({s for s, _ in examples}) == 200
    assert generate_examples(200, rules, seed=1) == examples
    assert generate_examples(200, rules, seed=2) != examples


def test_listops_lengths_are_those_trees_can_have():
    """An enumeration of every tree shape's length (small rules) against the rules'
    lengths; a window holding none of them is refused up front (it ran the whole draw
    budget, minutes at LRA's sizes, before saying so)."""
    import itertools

    def enumerate_lengths(depth, max_depth, max_args, limit):
        found = {1}
        if depth < max_depth:
            below = enumerate_lengths(depth + 1, max_depth, max_args, limit)
            for count in range(2, max_args + 1):
                for parts in itertools.combinations_with_replacement(sorted(below), count):
                    if 2 + sum(parts) <= limit:
                        found.add(2 + sum(parts))
        return found

    for depth, args in ((2, 2), (3, 2), (3, 3), (4, 2)):
        rules = ListOpsRules(max_depth=depth, max_args=args, min_length=0, max_length=30)
        assert rules.lengths() == sorted(enumerate_lengths(1, depth, args, 31))
    always = ListOpsRules(max_depth=3, max_args=2, min_length=0, max_length=30, value_p=1.0)
    assert always.lengths() == [10]  # operators down to the deepest level
    with pytest.raises(ValueError, match="no tree of depth <= 3"):
        ListOpsRules(max_depth=3, max_args=2, min_length=4, max_length=9, value_p=1.0)
    with pytest.raises(ValueError, match=r"no tree of depth <= 3 with <= 2 arguments has a "
                       r"length strictly between min_length=4 and max_length=7 \(the nearest "
                       r"lengths are 4 and 7\)"):
        ListOpsRules(max_depth=3, max_args=2, min_length=4, max_length=7)


def test_listops_rules_that_cannot_be_met_fail_early():
    with pytest.raises(ValueError, match="at most 4 tokens"):
        ListOpsRules(max_depth=2, max_args=2, min_length=10, max_length=20)
    with pytest.raises(ValueError, match="no length lies strictly between"):
        ListOpsRules(min_length=5, max_length=6)
    with pytest.raises(ValueError, match="max_args must be at least 2"):
        ListOpsRules(max_args=1)


def test_listops_rules_whose_window_is_rare_fail_at_the_first_rate_check():
    """A window rare under the rules was drawn at for up to 2000 draws an example (hours
    at LRA's 100,000) before the refusal; the rate of trees kept now decides early."""
    rare = ListOpsRules(max_depth=4, min_length=150, max_length=400)  # ~1 tree in 4000
    with pytest.raises(ValueError, match=r"of the first 50000 trees drawn are distinct "
                                         r"with 150 < length < 400: the 1000 asked for "
                                         r"would take about [\d,]+ draws, more than the "
                                         r"2,100,000 allowed"):
        generate_examples(1000, rare, seed=0)
    unmet = ListOpsRules(max_depth=3, min_length=100, max_length=200)  # 122 tokens at most
    with pytest.raises(ValueError, match=r"^none of the first 50000 trees drawn has "
                                         r"100 < length < 200; widen"):
        generate_examples(100_000, unmet, seed=0)


def test_written_listops_reads_back_with_its_generator_record(tmp_path):
    rules = ListOpsRules(max_depth=3, max_args=4, min_length=4, max_length=40)
    write_listops(tmp_path / "src", train=30, dev=5, test=5, rules=rules, seed=0)
    data = load_cache(prepare("listops", tmp_path / "src", tmp_path / "c", max_len=40).parent,
                      "listops")
    assert [len(data.splits[s]) for s in ("train", "dev", "test")] == [30, 5, 5]
    assert data.meta["generated"]["rules"]["max_depth"] == 3
    lines = (tmp_path / "src" / "basic_train.tsv").read_text().splitlines()
    assert lines[0] == "Source\tTarget"
    for line, label in zip(lines[1:], data.splits["train"].labels, strict=True):
        source, target = line.split("\t")
        assert evaluate_tokens(source) == int(target) == label


def _components(mask: np.ndarray) -> np.ndarray:
    """8-connected component labels of a boolean image."""
    labels = np.zeros(mask.shape, dtype=int)
    current = 0
    for start in zip(*np.nonzero(mask), strict=True):
        if labels[start]:
            continue
        current += 1
        labels[start] = current
        queue = deque([start])
        while queue:
            r, c = queue.popleft()
            for dr in (-1, 0, 1):
                for dc in (-1, 0, 1):
                    q = (r + dr, c + dc)
                    if 0 <= q[0] < mask.shape[0] and 0 <= q[1] < mask.shape[1] \
                            and mask[q] and not labels[q]:
                        labels[q] = current
                        queue.append(q)
    return labels


def _grow(mask: np.ndarray) -> np.ndarray:
    padded = np.pad(mask, 1)
    n, m = mask.shape
    return np.any([padded[i:i + n, j:j + m] for i in range(3) for j in range(3)], axis=0)


@pytest.mark.parametrize("label", [0, 1])
def test_pathfinder_label_is_a_property_of_the_picture(label):
    """Growing the lit pixels by one pixel joins each path's dashes, never two paths:
    the dots share a component exactly when the label says connected."""
    rules = PathfinderRules()
    rng = np.random.default_rng(label)
    dashed = 0
    for _ in range(15):
        drawing = draw_example(rng, rules, label)
        image = drawing.image > 0
        components = _components(_grow(image))
        a, b = (components[d] for d in drawing.dots)
        assert (a == b) == bool(label)
        # as many separate paths as drawn (dots sit on them)
        assert len(np.unique(components[components > 0])) == 2 + rules.distractors
        dashed += len(np.unique(_components(image))) - 1 > 2 + rules.distractors
    assert dashed > 0, "paths should show gaps between dashes"


def test_synthetic_pathfinder_round_trip_is_labelled_synthetic(tmp_path):
    write_pathfinder(tmp_path / "pf", 30, seed=0)
    data = load_cache(prepare("pathfinder", tmp_path / "pf", tmp_path / "c").parent, "pathfinder")
    assert data.synthetic and "Synthetic" in data.meta["synthetic_note"]
    assert [len(data.splits[s]) for s in ("train", "dev", "test")] == [24, 3, 3]
    assert set(np.unique(np.asarray(data.splits["train"].tokens))) <= {0, 255}
    labels = np.concatenate([data.splits[s].labels for s in ("train", "dev", "test")])
    assert 0 < labels.mean() < 1


def test_a_moved_copy_of_generated_pathfinder_is_the_same_data(tmp_path):
    """The difficulty recorded was the folder's name, for generated data the --out it
    was given: a renamed copy (every split's digest equal) could not resume a run."""
    import shutil

    from skyformer.lra.cache import data_fingerprint

    write_pathfinder(tmp_path / "pf", 12, seed=0)
    shutil.copytree(tmp_path / "pf", tmp_path / "moved" / "pf_copy")
    metas = [load_cache(prepare("pathfinder", tmp_path / src, tmp_path / cache).parent,
                        "pathfinder").meta
             for src, cache in (("pf", "c1"), ("moved/pf_copy", "c2"))]
    assert metas[0]["difficulty"] == "synthetic"
    assert data_fingerprint(metas[0]) == data_fingerprint(metas[1])
    # a run recorded when the folder's name was the difficulty resumes on it
    from skyformer.lra.resume import check_same_data

    data = load_cache(tmp_path / "c2", "pathfinder")
    check_same_data({"data": {**data_fingerprint(metas[0]), "difficulty": "pf"}},
                    tmp_path / "last.pt", data, None)


def test_generating_pathfinder_without_pillow_names_the_extra(tmp_path, monkeypatch):
    """Pillow comes with the lra extra: without it the generator says so before it
    makes any folder."""
    monkeypatch.setitem(sys.modules, "PIL", None)  # import PIL fails as if not installed
    with pytest.raises(ImportError, match=r"Pillow: pip install pillow .*'skyformer\[lra\]'"):
        write_pathfinder(tmp_path / "pf", 4, seed=0)
    assert list(tmp_path.iterdir()) == []


def _contents(folder):
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_generating_over_generated_data_needs_replace_and_replaces_it_whole(tmp_path):
    folder = write_pathfinder(tmp_path / "pf", 12, seed=0)
    before = _contents(folder)
    with pytest.raises(FileExistsError, match=r"already holds files .*pass --replace"):
        write_pathfinder(folder, 10, seed=1)
    assert _contents(folder) == before
    write_pathfinder(folder, 10, seed=1, replace=True)
    data = load_cache(prepare("pathfinder", folder, tmp_path / "c").parent, "pathfinder")
    assert sum(len(data.splits[s]) for s in ("train", "dev", "test")) == 10
    assert '"count": 10' in data.meta["synthetic_note"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "pf"], "no temporary left"
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"notes\.txt, which `generate pathfinder`"):
        write_pathfinder(folder, 10, seed=2, replace=True)


def test_replacing_the_folder_one_works_in_is_refused(tmp_path, monkeypatch):
    """Replacing the working folder (or one above it) renames it away: the shell is
    left in a deleted folder that lists nothing."""
    folder = write_pathfinder(tmp_path / "pf", 12, seed=0)
    before = _contents(folder)
    (folder / "sub").mkdir()
    for where, out in ((folder, "."), (folder / "sub", "..")):
        monkeypatch.chdir(where)
        with pytest.raises(ValueError, match=r"the folder this process works in.*cd"):
            write_pathfinder(out, 10, seed=1, replace=True)
    (folder / "sub").rmdir()
    assert _contents(folder) == before


def test_replace_refuses_the_releases_files_of_the_generators_names(tmp_path):
    """The release's listops-1000/ and a Pathfinder difficulty folder hold the names the
    generators write: --replace took them for generated data and replaced them."""
    from tests.lra.release_files import make_listops_release, make_pathfinder_release

    rules = ListOpsRules(max_depth=3, max_args=4, min_length=4, max_length=40)
    make_listops_release(tmp_path / "listops-1000")
    root, _ = make_pathfinder_release(tmp_path / "release")
    difficulty = root / "curv_contour_length_14"
    before = {f: _contents(f) for f in (tmp_path / "listops-1000", difficulty)}
    with pytest.raises(FileExistsError, match=r"holds no generator\.json, which `generate "
                       r"listops` writes .*--replace only replaces generated data"):
        write_listops(tmp_path / "listops-1000", train=5, dev=5, test=5, rules=rules,
                      replace=True)
    with pytest.raises(FileExistsError, match=r"holds no SYNTHETIC\.txt"):
        write_pathfinder(difficulty, 10, seed=1, replace=True)
    assert {f: _contents(f) for f in before} == before


def test_generating_into_the_empty_folder_one_works_in_is_refused(tmp_path, monkeypatch):
    """The rename replaced an empty working folder too: the files landed in a new folder
    of its name and the shell was left in the deleted one."""
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"the folder this process works in"):
        write_pathfinder(".", 10, seed=1)
    assert os.path.samefile(os.getcwd(), tmp_path / "empty")
    assert list((tmp_path / "empty").iterdir()) == []


def test_an_interrupted_replacement_leaves_the_previous_data(tmp_path, monkeypatch):
    import skyformer.lra.listops_gen as listops_gen
    import skyformer.lra.pathfinder_gen as pathfinder_gen

    rules = ListOpsRules(max_depth=3, max_args=4, min_length=4, max_length=40)
    lo = tmp_path / "lo"
    write_listops(lo, train=20, dev=5, test=5, rules=rules, seed=0)
    pf = write_pathfinder(tmp_path / "pf", 12, seed=0)
    before = {lo: _contents(lo), pf: _contents(pf)}
    real_tsv, real_draw = listops_gen._write_tsv, pathfinder_gen.draw_example

    def after(calls, real):
        def interrupted(*args, **kwargs):
            calls.append(1)
            if len(calls) > 1:
                raise KeyboardInterrupt
            return real(*args, **kwargs)
        return interrupted

    monkeypatch.setattr(listops_gen, "_write_tsv", after([], real_tsv))
    monkeypatch.setattr(pathfinder_gen, "draw_example", after([], real_draw))
    with pytest.raises(KeyboardInterrupt):
        write_listops(lo, train=20, dev=5, test=5, rules=rules, seed=1, replace=True)
    with pytest.raises(KeyboardInterrupt):
        write_pathfinder(pf, 12, seed=1, replace=True)
    assert {lo: _contents(lo), pf: _contents(pf)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lo", "pf"]


@pytest.mark.skipif(sys.platform == "win32", reason="no process check on Windows")
def test_a_killed_builds_temporary_folder_is_removed_by_the_next_build(tmp_path):
    """A SIGKILLed `lra generate` or `prepare` runs no cleanup: its hidden temporary
    folder stayed forever. The next build removes the ones of dead processes of this
    host, and only those: a live build's, another host's or an unknown one stays."""
    from skyformer.io import building_folder
    from skyformer.io.processes import builder_tag

    with building_folder(tmp_path / "x") as tmp:
        assert tmp.name.startswith(f".x.{builder_tag()}.") and tmp.name.endswith(".tmp")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = builder_tag().rsplit("-", 1)[0]
    names = {"dead": f".pf.{host}-{dead.pid}.abcd_123.tmp",
             "live": f".pf.{host}-{os.getppid()}.abcd_123.tmp",
             "other host": f".pf.{host}x-{dead.pid}.abcd_123.tmp",
             "unknown": ".pf.abcd_123.tmp", "other folder": f".lo.{host}-{dead.pid}.abcd_123.tmp",
             "no such pid": f".pf.{host}-{10**20}.abcd_123.tmp"}  # os.kill overflowed
    for name in names.values():
        (tmp_path / name / "imgs").mkdir(parents=True)
    write_pathfinder(tmp_path / "pf", 4, seed=0)
    left = {p.name for p in tmp_path.iterdir()}
    assert names["dead"] not in left
    assert {names[k] for k in ("live", "other host", "unknown", "other folder",
                               "no such pid")} <= left


def test_pathfinder_rules_guard_the_label_property():
    with pytest.raises(ValueError, match="gap_length must be at most 2"):
        PathfinderRules(gap_length=2.5)
    with pytest.raises(ValueError, match="clearance must be at least 4"):
        PathfinderRules(clearance=3)
    with pytest.raises(ValueError, match="could not place"):
        draw_example(np.random.default_rng(0), PathfinderRules(resolution=8, distractors=3), 1,
                     attempts=3)


def test_paths_that_do_not_fit_name_the_settings_to_change():
    """Without distractors the two paths of the dots remain: 'use fewer paths' could not
    be followed; the sentence names the dashes and the resolution too."""
    with pytest.raises(ValueError, match=r"could not place 2 paths \(2 for the dots, 0 "
                       r"distractors\) .* canvas; lower --dashes or raise --resolution\.$"):
        draw_example(np.random.default_rng(0), PathfinderRules(resolution=8, distractors=0), 1,
                     attempts=3)
