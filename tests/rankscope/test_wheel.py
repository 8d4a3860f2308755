"""The built wheel carries every data file, and a non-editable install opens a store.

The wheel is built from a copy of the working tree's non-ignored files (``git ls-files``), so a
stale ``build/`` folder in the repo can neither add nor hide a file, and the shared tree gets no
build output. It is installed with ``pip install --target`` and imported from a folder outside the
repo; its dependencies come from the venv.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("rankscope", "producers", "stream_processors", "storage", "dashboard", "benchmarks")
# Every data file a package reads at run time, as globs in the repo.
DATA_GLOBS = ("storage/*.sql", "storage/migrations/*", "rankscope/kafka/*",
              "producers/native/*.cpp", "producers/native/*.h")


def _source_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", "pyproject.toml", *PACKAGES],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (REPO / f).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for f in _source_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, src / f)
    pip = [sys.executable, "-m", "pip"]
    res = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"),
                          str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (whl,) = (tmp / "dist").glob("rankscope-*.whl")
    return whl


def test_wheel_has_every_data_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = sorted({str(p.relative_to(REPO)) for g in DATA_GLOBS for p in REPO.glob(g)
                       if p.is_file() and not p.name.startswith(".")})
    assert {"storage/schema.sql", "rankscope/kafka/pom.xml", "producers/native/kineto_columns.cpp",
            "producers/native/window_math.h"} <= set(expected)
    assert any(e.startswith("storage/migrations/") for e in expected)
    missing = [e for e in expected if e not in names]
    assert not missing, f"not in {wheel.name}: {missing}"


def test_installed_wheel_opens_store(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                          str(wheel)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    script = textwrap.dedent(f"""
        import storage
        from storage.store import open_store
        assert storage.__file__.startswith({str(site)!r}), storage.__file__
        store = open_store("chdb://{tmp_path / 'ch'}")
        print(store.query_rows("SELECT count() FROM rankscope.jobs")[0][0])
        print(store.query_rows("SELECT count() FROM rankscope.schema_migrations")[0][0])
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env["PYTHONPATH"] = str(site)
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split()[0] == "0"
