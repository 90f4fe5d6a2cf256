"""The README is a user's document that stays true: its quick-start commands are the ones CI
runs, its code parses, the files and links it names exist, the variables and command-line
options it shows are rannc's, and the troubleshooting table keeps its rows and names real
error classes. (tests/test_packaging.py runs its examples from an installed wheel.)"""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rannc
from rannc import checkpoint, health, validate
from rannc.config import LAUNCH_ENV, RANNC_ORIGINAL_ENV

pytestmark = pytest.mark.layer("pure")

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 4)
    return README[start:end if end > 0 else len(README)]


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.M | re.S)


def test_quick_start_is_what_ci_runs() -> None:
    quick = section("Quick start")
    assert "bash scripts/train.sh" in quick and "bash scripts/test.sh" in quick
    assert (ROOT / "scripts" / "train.sh").is_file()
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()  # CI runs the README's test command


def test_no_pointers_to_internals() -> None:
    for word in (r"\bissues?\b", r"DESIGN\.md", r"shared folder", r"\bIII-[A-C]\b", r"\bphase [123]\b"):
        hits = [line for line in README.splitlines() if re.search(word, line, re.I)]
        assert not hits, (word, hits[:3])


def test_python_blocks_parse() -> None:
    blocks = code_blocks("python")
    assert len(blocks) >= 4
    for block in blocks:
        ast.parse(block)


def test_named_files_and_links_exist() -> None:
    links = re.findall(r"\]\(((?!https?:|#)[^)]+)\)", README)
    paths = re.findall(r"`((?:examples|tests|scripts|docs|benchmarks)/[\w./-]+\.\w+)", README)
    assert links and paths
    missing = sorted({p.split(":")[0] for p in links + paths if not (ROOT / p.split(":")[0]).exists()})
    assert not missing, missing


def test_environment_variables_are_rannc_s() -> None:
    known = {f"RANNC_{f.name.upper()}" for f in dataclasses.fields(rannc.Config)}
    known |= set(LAUNCH_ENV) | set(RANNC_ORIGINAL_ENV)
    known |= {"RANNC_NP"}  # scripts/train.sh's rank count
    known |= {"RANNC_PARTITON_NUM"}  # the troubleshooting table's misspelt example
    named = set(re.findall(r"\bRANNC_[A-Z0-9_]+", README))
    assert named and not named - known, sorted(named - known)
    assert "RANNC_NP" in (ROOT / "scripts" / "train.sh").read_text()


def test_cli_options_exist() -> None:
    helps = ""
    for args in (["plan", "--help"], ["--help"]):
        res = subprocess.run([sys.executable, "-m", "rannc", *args], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stderr
        helps += res.stdout
    shown = {o for line in README.splitlines() if "rannc plan" in line or line.startswith("    --")
             for o in re.findall(r"(?<![\w-])--[a-z][a-z-]+", line)}
    shown |= set(re.findall(r"`(--[a-z][a-z-]+)[ `]", section("Using rannc").split("### Timelines")[0]
                            .split("Plan for a cluster")[1]))
    assert {"--devices", "--onnx", "--cluster", "--timeline"} <= shown
    assert not {o for o in shown if o not in helps}, sorted(o for o in shown if o not in helps)


def test_troubleshooting_keeps_its_rows_and_names_real_errors() -> None:
    rows = [line for line in section("Troubleshooting").splitlines()
            if line.startswith("| ") and not line.startswith("| you see")]
    assert len(rows) >= 44, len(rows)
    modules = (rannc, checkpoint, health, validate)
    for name in set(re.findall(r"`(\w+Error|RankFailure)\b", "\n".join(rows))):
        if name in ("ValueError", "JSONDecodeError", "UserWarning"):
            continue
        assert any(hasattr(m, name) for m in modules), name
