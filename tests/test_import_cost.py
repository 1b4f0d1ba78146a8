"""What ``import skyformer`` loads: the library and torch, not the packages only some
paths need (an optional extra, or sympy, which torch's export machinery imports and a
module-level import of it made every command pay half a second for)."""

from __future__ import annotations

import json
import subprocess
import sys

OPTIONAL = ("sympy", "transformers", "triton", "matplotlib", "scipy", "PIL", "tensorboard")


def test_importing_the_library_and_its_commands_loads_no_optional_package():
    code = ("import json, sys; import skyformer, skyformer.ops, skyformer.cli; "
            f"print(json.dumps([m for m in {OPTIONAL!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
