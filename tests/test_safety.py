"""Nothing unsafe: plans are JSON, never pickle; checkpoints load without unpickling arbitrary
objects (what `torch.load(weights_only=True)` guarantees); no rannc module unpickles files.
(The rendezvous listening only on loopback is checked in test_dist_bootstrap.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
from model_zoo import make_case
from torch import nn

import rannc

pytestmark = pytest.mark.layer("pure")

ROOT = Path(__file__).resolve().parents[1]


def test_plan_files_are_plain_json_and_a_pickle_is_refused(tmp_path: Path) -> None:
    case = make_case("fork_join", batch=8)
    spec = rannc.DeviceSpec("test-gpu", memory_bytes=16e9, flops=10e12, mem_bandwidth=1e12)
    cluster = rannc.Cluster.homogeneous(spec, n=2, per_node=2)
    plan = rannc.plan(case.model, case.args, case.kwargs, cluster=cluster,
                      config=rannc.Config(partition_num=2))
    path = tmp_path / "plan.json"
    plan.save(path)
    assert isinstance(json.loads(path.read_text()), dict)
    path.write_bytes(pickle.dumps(plan.to_dict()))
    with pytest.raises((rannc.RaNNCError, ValueError)):
        rannc.Plan.load(path)


def test_no_module_unpickles_a_file_or_loads_without_weights_only() -> None:
    offenders = []
    for f in sorted((ROOT / "rannc").rglob("*.py")):
        text = f.read_text()
        for m in re.finditer(r"pickle\.loads?\(|torch\.load\(([^)]*)\)", text):
            if m[0].startswith("torch.load") and "weights_only=True" in (m[1] or ""):
                continue
            offenders.append(f"{f.relative_to(ROOT)}: {m[0]}")
    assert offenders == []


class _Payload:
    """Unpickling this would create a file: the proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.marker, "w"))


@pytest.mark.layer("single_process")
def test_checkpoint_metadata_that_would_run_code_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters())
    m = rannc.RaNNCModule(model, opt)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    where = tmp_path / "ckpt"
    m.save_checkpoint(where)
    m.load_checkpoint(where)  # DCP's own metadata passes the restricted reader
    marker = tmp_path / "code-ran"
    version = Path(rannc.latest_checkpoint(where) or "")
    doctored = pickle.dumps(_Payload(str(marker)))
    (version / ".metadata").write_bytes(doctored)
    # Whoever doctors the file can record its checksum too: the reader must still refuse it.
    meta = json.loads((version / "rannc_meta.json").read_text())
    meta["files"][".metadata"] = {"sha256": hashlib.sha256(doctored).hexdigest(),
                                  "bytes": len(doctored)}
    (version / "rannc_meta.json").write_text(json.dumps(meta))
    with pytest.raises(rannc.RaNNCError, match="never unpickles arbitrary objects"):
        m.load_checkpoint(where)
    assert not os.path.exists(marker)
