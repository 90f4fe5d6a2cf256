"""`rannc plan FILE.py:FACTORY`: a dry-run plan for a cluster this machine is not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import rannc

pytestmark = pytest.mark.layer("pure")

ROOT = Path(__file__).resolve().parents[1]
FACTORY = f"{ROOT / 'tests' / 'plan_factories.py'}:tiny_bert"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rannc", "plan", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=300)


def test_plan_for_a_cluster_we_do_not_have(tmp_path: Path) -> None:
    out, onnx = tmp_path / "plan.json", tmp_path / "plan.onnx"
    png = tmp_path / "timeline.png"
    res = run(FACTORY, "--devices", "16", "--per-node", "8", "--device", "V100-32GB",
              "--batch-size", "64", "--out", str(out), "--onnx", str(onnx), "--timeline", str(png),
              "--config", '{"partition_num": 4, "microbatches": 4}')
    assert res.returncode == 0, res.stderr
    assert "rannc plan:" in res.stdout and "16 rank(s)" in res.stdout and "global batch 64" in res.stdout
    plan = rannc.Plan.load(out)
    assert sorted(r for st in plan.stages for r in st.ranks) == list(range(16))
    assert json.loads(out.read_text())["batch_size"] == 64
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "bubble ratio" in res.stdout
    import onnx as onnx_lib

    model = onnx_lib.load(str(onnx))
    # one function per stage, each node inside with its stage
    assert [n.op_type for n in model.graph.node][:len(plan.stages)] == [
        f"stage{s}" for s in range(len(plan.stages))]
    stages = {f.name: {a.i for n in f.node for a in n.attribute if a.name == "stage"}
              for f in model.functions}
    assert stages == {f"stage{s}": {s} for s in range(len(plan.stages))}


def test_bad_arguments_say_what_is_wrong() -> None:
    res = run("no_colon.py", "--devices", "2", "--batch-size", "8")
    assert res.returncode != 0 and "FILE.py:FACTORY" in res.stderr
    res = run(f"{ROOT / 'tests' / 'plan_factories.py'}:not_a_pair", "--devices", "2", "--batch-size", "8")
    assert res.returncode != 0 and "(model, args, kwargs)" in res.stderr
    res = run(FACTORY, "--devices", "2", "--batch-size", "8", "--device", "X100")
    assert res.returncode != 0 and "unknown device" in res.stderr
