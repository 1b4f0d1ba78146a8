"""The compare table keeps its columns apart for method names of any length."""

from __future__ import annotations

from skyformer.eval.compare import format_table


def test_long_method_names_do_not_run_into_the_target_column():
    row = {"method": "skyformer_multipole_long_name", "target": "gaussian", "exact": False,
           "num_features": 128, "spectral_error": 0.1, "spectral_error_std": 0.01,
           "frobenius_error": 0.2, "time_ms": 1.0, "peak_mib": None}
    lines = format_table([row]).splitlines()
    assert lines[2].split()[:2] == ["skyformer_multipole_long_name", "gaussian"]
    assert lines[0].index("target") == lines[2].index("gaussian")
