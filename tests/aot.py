"""Running an ahead-of-time compile for sm_90 in a subprocess (no GPU: Triton's bundled ptxas),
for the tests that judge what the compiler makes of a kernel.

The script runs with ``TRITON_INTERPRET`` unset (the kernels then take their GPU paths) and
prints one line ``AOT<json>``; when the compile cannot run here (no ptxas, a Triton without the
backend, a timeout) the test is skipped with the reason printed.
"""
import json
import os
import subprocess
import sys

import pytest


def aot_run(script, *args, pythonpath=None, timeout=900):
    """(the JSON after ``AOT``, the script's stdout) of ``python -c script *args``;
    pythonpath: a directory put first on the path (another Triton)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    try:
        proc = subprocess.run([sys.executable, "-c", script, *args], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.skip(f"the ahead-of-time compile took over {timeout // 60} minutes")
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("AOT")), None)
    if proc.returncode != 0 or line is None:
        version = next((ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("TRITON ")),
                       "?")
        reason = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        print(f"AOT compile for sm_90 unavailable (triton {version}): {reason[0]}")
        pytest.skip(f"AOT compile for sm_90 unavailable: {reason[0]}")
    return json.loads(line[3:]), proc.stdout
