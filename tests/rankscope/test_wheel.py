"""The built wheel carries every data file and its license and metadata, and a non-editable install
opens a store.

The wheel is built from a copy of the working tree's non-ignored files (``git ls-files``), so a
stale ``build/`` folder in the repo can neither add nor hide a file, and the shared tree gets no
build output. It is installed with ``pip install --target`` and imported from a folder outside the
repo; its dependencies come from the venv.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("rankscope", "producers", "stream_processors", "offline", "cli", "storage", "dashboard")
PROJECT_FILES = ("pyproject.toml", "LICENSE", "README.md")  # what pyproject names besides the packages
RUNTIMES = PACKAGES[1:]           # installed as rankscope.producers, rankscope.storage, ...
# Every data file a package reads at run time, as globs in the repo.
DATA_GLOBS = ("rankscope/*.json", "storage/*.sql", "storage/migrations/*", "cli/stack/kafka/*",
              "producers/native/*.cpp", "producers/native/*.h", "dashboard/*/*.py")
# The wheel declares these extras; the rank side (no extra) never pulls a server dependency.
EXTRAS = {"gpu", "analysis", "processors", "sink", "dashboard", "embedded", "server", "dev"}
SERVER_ONLY = ("faust-streaming", "streamlit", "chdb", "clickhouse-connect", "pandas", "pyarrow")


def _source_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", *PROJECT_FILES, *PACKAGES],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (REPO / f).is_file()]


def build_wheel(tmp: Path) -> Path:
    """Build the wheel from a copy of the tree's non-ignored files into ``tmp/dist``; return its path."""
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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def _metadata(wheel: Path) -> list[tuple[str, str]]:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(name).decode().splitlines()
    return [(k, v.strip()) for k, _, v in (line.partition(":") for line in lines) if k in ("Requires-Dist", "Provides-Extra")]


def test_wheel_declares_rank_side_only_and_server_extras(wheel: Path) -> None:
    meta = _metadata(wheel)
    assert {v for k, v in meta if k == "Provides-Extra"} == EXTRAS
    requires = [v for k, v in meta if k == "Requires-Dist"]
    base = sorted(r.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip().lower()
                  for r in requires if "extra ==" not in r)
    assert base == ["confluent-kafka", "msgpack", "numpy", "psutil"], base
    assert not [r for r in requires if r.lower().startswith("torch")], requires  # the image's own torch
    extra_of = {}
    for r in requires:
        if "extra ==" in r:
            extra_of.setdefault(r.split("extra ==")[1].strip(" \"'"), []).append(r.lower())
    for dist in SERVER_ONLY:
        assert not [r for r in requires if r.lower().startswith(dist) and "extra ==" not in r], dist
    assert any(r.startswith("faust-streaming") for r in extra_of["processors"])
    assert any(r.startswith("streamlit") for r in extra_of["dashboard"])
    assert any(r.startswith("chdb") for r in extra_of["embedded"])
    assert any(r.startswith("nvidia-ml-py") for r in extra_of["gpu"])
    assert any("processors" in r and "embedded" in r and "dashboard" in r and "sink" in r
               for r in extra_of["server"]), extra_of["server"]


def test_wheel_metadata_names_license_pythons_and_loose_rank_pins(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.parser.Parser().parsestr(z.read(name).decode())
        license_text = z.read(name.replace("METADATA", "licenses/LICENSE"))
    assert meta["License-Expression"] == "Apache-2.0" and meta.get_all("License-File") == ["LICENSE"]
    assert license_text == (REPO / "LICENSE").read_bytes()
    assert b"Apache License\n                           Version 2.0, January 2004" in license_text
    classifiers = set(meta.get_all("Classifier"))
    assert {f"Programming Language :: Python :: 3.{m}" for m in (11, 12, 13, 14)} <= classifiers, classifiers
    assert {"Operating System :: POSIX :: Linux", "Topic :: System :: Monitoring",
            "Topic :: Scientific/Engineering :: Artificial Intelligence"} <= classifiers, classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # License-Expression says it
    assert meta["Requires-Python"] in (">=3.11,<3.15", "<3.15,>=3.11"), meta["Requires-Python"]
    assert meta["Description-Content-Type"] == "text/markdown" and meta.get_payload().startswith("# rankscope")
    requires = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    base = {r.name: r.specifier for r in requires if r.marker is None}
    # A training image's own psutil and msgpack stay (tests/rankscope/test_wheel_into_image.py installs over them).
    assert base["psutil"].contains("5.9.8") and not base["psutil"].contains("8.0.0"), base["psutil"]
    assert base["msgpack"].contains("1.0.0") and not base["msgpack"].contains("2.0.0"), base["msgpack"]
    analysis = {r.name for r in requires if r.marker is not None and r.marker.evaluate({"extra": "analysis"})}
    assert analysis == {"pandas", "msgspec"}, analysis


def installed_path(repo_path: str) -> str:
    """Where a file of the repo lies in the wheel: ``storage/schema.sql`` -> ``rankscope/storage/schema.sql``."""
    return f"rankscope/{repo_path}" if repo_path.split("/")[0] in RUNTIMES else repo_path


def test_wheel_installs_one_namespace(wheel: Path) -> None:
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"rankscope"}, tops
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = [installed_path(f) for f in _source_files() if f.endswith(".py")]
    assert len(modules) > 100
    missing = [m for m in modules if m not in names]
    assert not missing, f"modules not in {wheel.name} (a folder missing from pyproject's packages?): {missing}"


def test_wheel_has_every_data_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = sorted({installed_path(str(p.relative_to(REPO))) for g in DATA_GLOBS for p in REPO.glob(g)
                       if p.is_file() and not p.name.startswith(".")})
    assert {"rankscope/alert.schema.json", "rankscope/storage/schema.sql", "rankscope/cli/stack/kafka/pom.xml",
            "rankscope/producers/native/kineto_columns.cpp", "rankscope/producers/native/window_math.h"} <= set(expected)
    assert any(e.startswith("rankscope/storage/migrations/") for e in expected)
    missing = [e for e in expected if e not in names]
    assert not missing, f"not in {wheel.name}: {missing}"


def test_installed_wheel_opens_store(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                          str(wheel)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    script = textwrap.dedent(f"""
        import rankscope.storage
        from rankscope.storage.store import open_store
        assert rankscope.storage.__file__.startswith({str(site)!r}), rankscope.storage.__file__
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
