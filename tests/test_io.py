from __future__ import annotations

import json
import stat

from skyformer.io import atomic_write_text, write_csv, write_json


def test_atomic_writes_are_readable_and_leave_no_temporary(tmp_path):
    path = atomic_write_text(tmp_path / "sub" / "a.txt", "hello")
    assert path.read_text() == "hello"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["a.txt"]


def test_json_and_csv(tmp_path):
    write_json(tmp_path / "a.json", {"x": [1, 2]}, indent=None)
    assert (tmp_path / "a.json").read_text() == '{"x":[1,2]}\n'
    assert json.loads(write_json(tmp_path / "b.json", {"x": 1}).read_text()) == {"x": 1}
    rows = [{"a": 1, "b": None}, {"a": 2, "c": "z"}]
    text = write_csv(tmp_path / "r.csv", rows, metadata={"config": {"n": 3}}).read_text()
    assert text == '# config: {"n": 3}\na,b,c\n1,,\n2,,z\n'
