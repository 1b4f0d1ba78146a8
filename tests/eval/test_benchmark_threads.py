"""The benchmarks' ``--threads``: a count below one is refused by argparse in a line.
It was a plain int: 0 or a negative count raised torch's RuntimeError from
``set_num_threads`` as a traceback, or was dropped where the script tested it for truth."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark

SCRIPTS = [  # script, the arguments it needs besides --threads
    ("accuracy_first", []), ("causal_features", []), ("causal_lm", []),
    ("decoding_memory", []), ("implicit_core_gradient", []), ("kernelized_masks", []),
    ("linformer_draw", []), ("published", ["reformer"]), ("real_vs_random", []),
    ("sequence_parallel", []), ("causal_blocks", []), ("topk_ties", []),
]


@pytest.mark.parametrize(("script", "argv"), SCRIPTS)
def test_a_thread_count_below_one_is_refused_in_a_line(script, argv, capsys):
    with pytest.raises(SystemExit) as stop:
        load_benchmark(script).main([*argv, "--threads", "0"])
    assert stop.value.code == 2
    assert "argument --threads: must be a positive integer, got 0" in capsys.readouterr().err
