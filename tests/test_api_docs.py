"""The committed API reference (docs/api.md, docs/config.md, the README's Config table) is what
scripts/gen_api_docs.py writes from the current docstrings, and it covers every public name and
Config field."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rannc
from rannc.config import LAUNCH_ENV

pytestmark = pytest.mark.layer("single_process")

ROOT = Path(__file__).resolve().parents[1]
FIX = ("run `.venv/bin/python scripts/gen_api_docs.py` and commit docs/api.md, docs/config.md "
       "and README.md")


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")  # docs/api.md documents rannc.hf.RaNNCTrainer
    out = tmp_path_factory.mktemp("docs")
    shutil.copy(ROOT / "README.md", out / "README.md")  # its Config table is rewritten in the copy
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_api_docs.py"), "--out", str(out),
                          "--readme", str(out / "README.md")],
                         cwd=out, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return out


@pytest.mark.parametrize("name", ["docs/api.md", "docs/config.md", "README.md"])
def test_committed_docs_are_current(generated: Path, name: str) -> None:
    committed = ROOT / name
    assert committed.is_file(), f"{name} is missing: {FIX}"
    assert committed.read_text() == (generated / Path(name).name).read_text(), f"{name} is stale: {FIX}"


@pytest.mark.layer("pure")
def test_docs_cover_every_public_name_and_field() -> None:
    api = (ROOT / "docs" / "api.md").read_text()
    config = (ROOT / "docs" / "config.md").read_text()
    for name in rannc.__all__:
        assert f"## `rannc.{name}`" in api, name
    for f in dataclasses.fields(rannc.Config):
        assert f"| `{f.name}` |" in config and f"`RANNC_{f.name.upper()}`" in config, f.name
    for var in LAUNCH_ENV:
        assert f"| `{var}` |" in config, var
    readme = (ROOT / "README.md").read_text()
    assert "(docs/config.md)" in readme and "(docs/api.md)" in readme
    for f in dataclasses.fields(rannc.Config):
        assert f"| `{f.name}` |" in readme, f"the README's Config table lacks {f.name}: {FIX}"
