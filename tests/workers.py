"""Runs a tests/_*_worker.py script in its own process with N virtual CPU devices (jax fixes its device count when
it first starts, and the pytest process already started it with one) and returns the JSON it reports."""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def cpu_env(devices: int, xla_flags: str = "") -> dict:
    """The environment of a worker: the CPU backend with `devices` virtual devices (plus xla_flags), the repository
    importable."""
    flags = f"--xla_force_host_platform_device_count={devices} {xla_flags}".strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_worker(script: str, *args: str, devices: int = 8, timeout: int = 600, xla_flags: str = "") -> dict:
    """-> the object the worker printed on its last `RESULT <json>` line (the test fails if it exits non-zero)."""
    proc = subprocess.run([sys.executable, os.path.join(HERE, script), *args], env=cpu_env(devices, xla_flags),
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{script} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def run_snippet(code: str, timeout: int = 300) -> None:
    """Runs `code` in a fresh Python process (one device; the repository and tests/ importable), for a check that
    must not share this process: importing a training recipe defines its absl flags, which another recipe's import
    would repeat. The code prints "ok" last; the test fails otherwise."""
    env = cpu_env(1)
    env["PYTHONPATH"] = HERE + os.pathsep + env["PYTHONPATH"]
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
