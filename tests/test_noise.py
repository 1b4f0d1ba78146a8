"""What a user sees besides results: no traceback when a pipe closes, log messages through
``logging`` (silent unless enabled), and the cross-attention padding rule of
``MultiHeadAttention``."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from skyformer import MultiHeadAttention
from skyformer.cli import main
from skyformer.logs import enable_console, get_logger
from tests.streams import FlushRecorder


def test_list_into_a_closed_pipe_ends_quietly():
    proc = subprocess.run(
        f"{sys.executable} -m skyformer list --json | head -c 10", shell=True,
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def _closed_pipe():
    """A text stream into a pipe whose reader has gone (``| head`` after its lines)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    return open(write_end, "w", buffering=1)


def test_a_run_into_closed_pipes_still_writes_its_files(tmp_path, monkeypatch):
    """``skyformer bench --out X 2>&1 | head -1``: the first line written after the
    reader left ended the run (exit 0), before its files were complete (approx: before
    any result file); the run now goes on with its output dropped."""
    out, err = _closed_pipe(), _closed_pipe()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    code = main(["bench", "--methods", "softmax", "--seq-lens", "16", "32", "--repeats", "1",
                 "--warmup", "0", "--no-memory", "--no-plot", "--out", str(tmp_path / "b")])
    assert code == 0
    assert json.loads((tmp_path / "b.json").read_text())["complete"] is True
    assert sys.stdout is out and sys.stderr is err  # given back as they were
    out.close()
    err.close()


def test_a_closed_stdout_or_stderr_ends_no_run(monkeypatch):
    """``skyformer list >&-`` (or ``2>&-``): Python sets a closed standard stream to None;
    the pipe-surviving wrapper wrapped None too, so the first line written (or an error's
    sentence) crashed with an AttributeError traceback instead of being dropped."""
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["list"]) == 0
    assert sys.stdout is None
    monkeypatch.setattr(sys, "stderr", None)
    assert main(["compare", "--methods", "no_such_method"]) == 2
    assert sys.stderr is None


def test_each_log_line_is_flushed_as_it_is_logged(monkeypatch):
    """``skyformer lra train > train.log``: the console handler wrote without flushing,
    so the log file showed lines kilobytes late and lost the last ones to a kill."""
    _without_console()
    recorder = FlushRecorder()
    monkeypatch.setattr(sys, "stdout", recorder)
    enable_console()
    try:
        get_logger("test").info("step 10")
        assert recorder.flushed == "step 10\n"
    finally:
        _without_console()


def _without_console():
    root = logging.getLogger("skyformer")
    root.handlers = [h for h in root.handlers if type(h).__name__ != "_Console"]
    root.setLevel(logging.NOTSET)


def test_library_logs_through_logging_and_prints_only_when_enabled(capsys, caplog):
    _without_console()  # the CLI tests turn the console on in this process
    log = get_logger("test")
    with caplog.at_level(logging.INFO, logger="skyformer"):
        log.info("a message")
    assert "a message" in caplog.text
    assert capsys.readouterr().out == ""  # no handler of its own: nothing printed
    enable_console()
    enable_console()  # idempotent: one handler
    try:
        log.info("printed once")
        assert capsys.readouterr().out.count("printed once") == 1
    finally:
        _without_console()


def test_a_closed_standard_output_drops_log_lines_quietly(monkeypatch, capsys):
    """``skyformer approx >&-``: standard output is None (``cli/streams.py``), which
    ``print`` skips; each log line raised inside the handler and logging printed a
    'Logging error' traceback on standard error."""
    _without_console()
    enable_console()
    monkeypatch.setattr(sys, "stdout", None)
    try:
        get_logger("test").info("nowhere to go")
    finally:
        _without_console()
    assert "Logging error" not in capsys.readouterr().err


def test_cross_attention_key_mask_is_not_a_query_mask():
    """With a context as long as x, the key padding mask marks padded context tokens
    only: every query row is real (it was read as a query mask whenever Nq == Nk)."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(64, 4, method="softmax").eval()
    x, ctx = torch.randn(2, 10, 64), torch.randn(2, 10, 64)
    km = torch.ones(2, 10, dtype=torch.bool)
    km[1, 6:] = False
    y = layer(x, km, context=ctx)
    q = layer._split(layer.q_proj(x))
    k, v = layer._split(layer.k_proj(ctx)), layer._split(layer.v_proj(ctx))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=km[:, None, None, :])
    ref = layer.out_proj(ref.transpose(1, 2).reshape(2, 10, 64))
    torch.testing.assert_close(y, ref)
    assert y[1, 6:].abs().sum() > 0
