"""``rankscope run``: the variables it gives the launched command, and its errors (no broker needed)."""

from __future__ import annotations

import os
import subprocess
import sys

from rankscope.producers.attach import boot_dir


def rankscope(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_") and k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "rankscope", *args], env={**base, **env}, capture_output=True,
                          text=True, timeout=120)


def test_the_command_runs_with_the_attach_variables_and_the_settings() -> None:
    probe = ("import os; print(os.environ['RANKSCOPE_ATTACH'], os.environ['PYTHONPATH'], "
             "os.environ['RANKSCOPE_STEP_MARKER'], os.environ['RANKSCOPE_JOB_ID'], os.environ['RANKSCOPE_KAFKA_PORT'])")
    out = rankscope("run", "--step-marker", "pkg.loop:step", "--job-id", "j7", "--kafka-port", "9555", "--",
                    sys.executable, "-c", probe, PYTHONPATH="/x")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", f"{boot_dir()}{os.pathsep}/x", "pkg.loop:step", "j7", "9555"]


def test_print_env_gives_exports_for_other_launchers() -> None:
    out = rankscope("run", "--print-env", "--job-id", "j8")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "export RANKSCOPE_ATTACH=1" in lines and "export RANKSCOPE_JOB_ID=j8" in lines
    assert f"export PYTHONPATH={boot_dir()}" in lines
    assert len(lines) == 3       # only what differs from the defaults


def test_errors_are_reported_with_an_exit_status() -> None:
    assert rankscope("run").returncode == 2
    bad = rankscope("run", "--step-marker", "no_colon", "--", "true")
    assert bad.returncode == 2 and "step_marker must be" in bad.stderr
    missing = rankscope("run", "--", "/nonexistent/launcher")
    assert missing.returncode == 127 and "cannot run" in missing.stderr


def test_print_env_never_prints_a_secret() -> None:
    out = rankscope("run", "--print-env", RANKSCOPE_KAFKA_SASL_PASSWORD="hunter2-secret")
    assert out.returncode == 0, out.stderr
    assert "hunter2-secret" not in out.stdout + out.stderr
    assert 'export RANKSCOPE_KAFKA_SASL_PASSWORD="${RANKSCOPE_KAFKA_SASL_PASSWORD}"' in out.stdout.splitlines()
