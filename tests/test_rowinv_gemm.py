"""bench/rowinv_gemm.py's row-invariant GEMM (a probe for exact speculation on CUDA) against the
fp32 reference under Triton's interpreter: every config family (split-K summed by a second kernel
or by the last program, the swapped tile) at small shapes, M in 1..5, 17 and 20."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "rowinv_gemm.py"


def test_the_row_invariant_gemm_matches_the_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, str(BENCH), "--check-small"], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "check-small: PASS" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
