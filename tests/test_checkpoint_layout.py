"""Checkpoints in one process: the versioned layout under crashes at every publish step (one and
two in a row), checksums, damaged files, strict keys, symlinked and ill-named paths, Stateful
objects and user files. The multi-rank behaviour (sharding, resume, a save on rank 0 only) is
in test_checkpoint_mpi.py.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import rannc
from rannc import checkpoint as ckpt

pytestmark = pytest.mark.layer("single_process")


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_left_behind() -> Iterator[None]:
    """A single-process save starts a one-rank group; later test files expect none."""
    yield
    from rannc import dist as rdist

    rdist.shutdown()


class Crash(BaseException):
    """A simulated kill: nothing after it runs (a BaseException, like SystemExit)."""


def _model(depth: int = 2, seed: int = 0) -> tuple[rannc.RaNNCModule, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(4, 4), nn.Tanh()]
    model = nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return rannc.RaNNCModule(model, opt), opt


def _step(m: rannc.RaNNCModule, opt: torch.optim.Optimizer) -> None:
    m(torch.randn(3, 4)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _params(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


# Where a save is killed: before publishing (the version is written aside), at the rename of the
# version into place, at the replacement of `latest`, or while removing what it supersedes.
POINTS = ("write", "rename-version", "rename-pointer", "clean")


def _crash_at(monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    monkeypatch.undo()
    if point == "write":
        def dead(*args: Any) -> None:
            raise Crash
        monkeypatch.setattr(ckpt, "_publish", dead)
    elif point == "clean":
        monkeypatch.setattr(ckpt, "_clean", lambda *a, **k: (_ for _ in ()).throw(Crash()))
    else:
        nth = 1 if point == "rename-version" else 2
        calls = itertools.count(1)

        def replace(src: Any, dst: Any) -> None:
            if next(calls) == nth:
                raise Crash
            os.replace(src, dst)
        fake = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
        fake.replace = replace
        monkeypatch.setattr(ckpt, "os", fake)


@pytest.mark.parametrize("first,second", list(itertools.product(POINTS, POINTS)))
def test_load_after_one_and_two_crashes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        first: str, second: str) -> None:
    """Killed at any publish step, once and then again: `latest` names a whole version (the
    last committed one: a save counts once `latest` names it), it loads, and the next save
    leaves exactly one version and no leftovers."""
    m, opt = _model()
    ck = tmp_path / "ck"
    assert rannc.latest_checkpoint(ck) is None
    _step(m, opt)
    m.save_checkpoint(ck)
    committed = _params(m)
    for point in (first, second):
        _step(m, opt)
        _crash_at(monkeypatch, point)
        with pytest.raises(Crash):
            m.save_checkpoint(ck)
        monkeypatch.undo()
        if point == "clean":  # `latest` was replaced: this save is the committed one
            committed = _params(m)
        assert os.path.exists(ck) and rannc.latest_checkpoint(ck) is not None
        _step(m, opt)
        m.load_checkpoint(ck)
        for n, p in m.named_parameters():
            assert torch.equal(p, committed[n]), (point, n)
    m.save_checkpoint(ck)
    latest = Path(rannc.latest_checkpoint(ck) or "")
    assert sorted(os.listdir(ck)) == ["latest", latest.name], os.listdir(ck)


def test_layout_and_latest_pointer(tmp_path: Path) -> None:
    m, opt = _model()
    ck = tmp_path / "ck"
    m.save_checkpoint(ck)
    m.save_checkpoint(ck)
    assert (ck / "latest").read_text().strip() == "v-000002"
    assert rannc.latest_checkpoint(ck) == str(ck / "v-000002")
    files = json.loads((ck / "v-000002" / ckpt.META_FILE).read_text())["files"]
    assert ".metadata" in files and any(n.endswith(".distcp") for n in files)
    assert sorted(os.listdir(ck)) == ["latest", "v-000002"]


def _a_shard(ck: Path) -> Path:
    return next(Path(rannc.latest_checkpoint(ck) or "").glob("*.distcp"))


def test_flipped_bytes_are_named(tmp_path: Path) -> None:
    m, opt = _model()
    ck = tmp_path / "ck"
    m.save_checkpoint(ck)
    shard = _a_shard(ck)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(rannc.RaNNCError, match=f"{shard.name} is corrupt"):
        m.load_checkpoint(ck)


def test_truncated_shard_is_a_rannc_error_naming_it(tmp_path: Path) -> None:
    m, opt = _model()
    ck = tmp_path / "ck"
    m.save_checkpoint(ck)
    shard = _a_shard(ck)
    shard.write_bytes(shard.read_bytes()[:40])
    with pytest.raises(rannc.RaNNCError, match=f"{shard.name} is truncated.*Load an older copy"):
        m.load_checkpoint(ck)


def test_truncated_metadata_json_is_a_rannc_error_naming_it(tmp_path: Path) -> None:
    m, opt = _model()
    ck = tmp_path / "ck"
    m.save_checkpoint(ck)
    meta = Path(rannc.latest_checkpoint(ck) or "") / ckpt.META_FILE
    meta.write_text(meta.read_text()[:30])
    with pytest.raises(rannc.RaNNCError, match=f"{ckpt.META_FILE} cannot be read.*truncated"):
        m.load_checkpoint(ck)


def test_strict_keys(tmp_path: Path) -> None:
    """A deeper model's checkpoint into a shallower model: an error naming the unexpected keys;
    strict=False loads the shared ones. And the reverse names the missing keys."""
    deep, _ = _model(depth=3, seed=1)
    ck = tmp_path / "deep"
    deep.save_checkpoint(ck)
    shallow, _ = _model(depth=2, seed=2)
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"unexpected keys \['4.bias', '4.weight'\]"):
        shallow.load_checkpoint(ck)
    shallow.load_checkpoint(ck, strict=False)
    want = dict(deep.named_parameters())
    for n, p in shallow.named_parameters():
        assert torch.equal(p, want[n]), n
    shallow.save_checkpoint(tmp_path / "shallow")
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"missing keys \['4.weight', '4.bias'\]"):
        deep.load_checkpoint(tmp_path / "shallow")
    deep.load_checkpoint(tmp_path / "shallow", strict=False)


def test_symlink_is_written_through(tmp_path: Path) -> None:
    m, opt = _model()
    target = tmp_path / "real"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    m.save_checkpoint(link)
    m.save_checkpoint(link)
    assert link.is_symlink() and (target / "latest").exists()
    assert sorted(os.listdir(target)) == ["latest", "v-000002"]
    m.load_checkpoint(link)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "made" / "here")
    m.save_checkpoint(dangling)
    assert dangling.is_symlink() and (tmp_path / "made" / "here" / "latest").exists()


@pytest.mark.parametrize("name", [".", "sub/..", "sub/../", ""])
def test_a_path_naming_no_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               name: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    m, opt = _model()
    with pytest.raises(ckpt.CheckpointError, match="does not name a directory of its own"):
        m.save_checkpoint(name)
    assert sorted(os.listdir(tmp_path)) == ["sub"]


def test_a_file_path_is_refused(tmp_path: Path) -> None:
    m, opt = _model()
    (tmp_path / "f").write_text("x")
    with pytest.raises(ckpt.CheckpointError, match="is a file"):
        m.save_checkpoint(tmp_path / "f")


def test_nothing_to_load_says_so(tmp_path: Path) -> None:
    m, opt = _model()
    with pytest.raises(ckpt.CheckpointError, match="no rannc checkpoint"):
        m.load_checkpoint(tmp_path / "none")


class Counter:
    """A Stateful step counter."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]


def test_stateful_objects_and_values_round_trip(tmp_path: Path) -> None:
    m, opt = _model()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    counter = Counter()
    for _ in range(3):
        _step(m, opt)
        sched.step()
        counter.n += 1
    torch.manual_seed(123)
    m.save_checkpoint(tmp_path / "ck", sched=sched, counter=counter, rng=ckpt.RNGState(),
                      epoch=7, note={"tag": "a", "sizes": [1, 2]})
    want_rand, want_lr, want_sched = torch.rand(3), opt.param_groups[0]["lr"], sched.state_dict()
    m2, opt2 = _model(seed=5)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    counter2 = Counter()
    torch.manual_seed(999)
    got = m2.load_checkpoint(tmp_path / "ck", sched=sched2, counter=counter2,
                             rng=ckpt.RNGState(), epoch=0, note=None)
    assert torch.equal(torch.rand(3), want_rand)  # the RNG state came back
    assert got["epoch"] == 7 and got["note"] == {"tag": "a", "sizes": [1, 2]}
    assert got["counter"] is counter2 and counter2.n == 3
    assert sched2.state_dict() == want_sched and opt2.param_groups[0]["lr"] == want_lr
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"holds no \['other'\]"):
        m2.load_checkpoint(tmp_path / "ck", other=Counter())
    m2.load_checkpoint(tmp_path / "ck", strict=False, other=Counter())


def test_an_unstorable_value_is_refused_before_writing(tmp_path: Path) -> None:
    m, opt = _model()
    with pytest.raises(ckpt.CheckpointError, match="neither a Stateful"):
        m.save_checkpoint(tmp_path / "ck", obj=object())
    assert rannc.latest_checkpoint(tmp_path / "ck") is None


def test_user_files_are_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A file beside `latest` is never touched; one inside a version directory keeps that
    directory (with a warning) when the version is superseded."""
    m, opt = _model()
    ck = tmp_path / "ck"
    m.save_checkpoint(ck)
    (ck / "config.yaml").write_text("top")
    (ck / "v-000001" / "notes.txt").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="rannc.checkpoint"):
        m.save_checkpoint(ck)
    assert (ck / "config.yaml").read_text() == "top"
    assert (ck / "v-000001" / "notes.txt").read_text() == "mine"
    assert os.listdir(ck / "v-000001") == ["notes.txt"]
    assert "notes.txt" in caplog.text
    assert rannc.latest_checkpoint(ck) == str(ck / "v-000002")
    m.save_checkpoint(ck)
    assert (ck / "v-000001" / "notes.txt").exists() and rannc.latest_checkpoint(ck) == str(ck / "v-000003")


@pytest.mark.layer("pure")
def test_a_per_rank_state_cannot_go_to_another_number_of_ranks(tmp_path: Path) -> None:
    """States that differ across the saving ranks are stored per rank; loading them on another
    number of ranks is an error naming the key. States equal on every rank are stored once."""
    parts = [{"rng": ("stateful", {"s": torch.tensor([r])}), "sched": ("stateful", {"lr": 0.1})}
             for r in range(4)]
    entries = ckpt._merge_states(parts)
    assert len(entries["rng"]["states"]) == 4 and len(entries["sched"]["states"]) == 1
    got = ckpt._restore(entries, {"sched": 0}, tmp_path, True, rank=1, world=2)
    assert got == {"sched": {"lr": 0.1}}
    with pytest.raises(ckpt.CheckpointError, match="'rng' was saved by 4 ranks"):
        ckpt._restore(entries, {"rng": 0}, tmp_path, True, rank=1, world=2)
    got = ckpt._restore(entries, {"rng": 0}, tmp_path, True, rank=3, world=4)
    assert torch.equal(got["rng"]["s"], torch.tensor([3]))


def test_an_aside_copy_of_the_old_layout_is_found(tmp_path: Path) -> None:
    """rannc <= 0.1 left only `ck.old-<id>` after a crash inside its publish."""
    m, opt = _model()
    m.save_checkpoint(tmp_path / "new")
    os.rename(Path(rannc.latest_checkpoint(tmp_path / "new") or ""), tmp_path / "ck.old-1234")
    assert rannc.latest_checkpoint(tmp_path / "ck") == str(tmp_path / "ck.old-1234")
    m.load_checkpoint(tmp_path / "ck")


@pytest.mark.layer("pure")
def test_torch_layout_of_an_optimizer_by_name_loads_into_the_unwrapped_optimizer() -> None:
    """`to_torch_layout` numbers the parameters over the param groups as built, as the unwrapped
    optimizer's own state_dict() does (so it loads there), and `from_torch_layout` names them
    back; a parameter without state (not yet stepped) is numbered all the same."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW([{"params": [net[0].weight, net[1].weight], "lr": 0.1},
                             {"params": [net[0].bias, net[1].bias], "weight_decay": 0.0}])
    net(torch.randn(5, 3)).sum().backward()
    net[1].bias.grad = None  # (no state for it)
    opt.step()
    names = [["0.weight", "1.weight"], ["0.bias", "1.bias"]]
    want = opt.state_dict()
    by_name = ckpt.from_torch_layout(want, names)
    assert set(by_name["state"]) == {"0.weight", "1.weight", "0.bias"}
    assert [g["params"] for g in by_name["param_groups"]] == names
    got = ckpt.to_torch_layout(by_name)
    assert got["param_groups"] == want["param_groups"]
    assert list(got["state"]) == [0, 1, 2] and torch.equal(got["state"][2]["exp_avg"],
                                                            want["state"][2]["exp_avg"])
    fresh = torch.optim.AdamW(opt.param_groups)
    fresh.load_state_dict(got)
    assert torch.equal(fresh.state[net[0].bias]["exp_avg_sq"], opt.state[net[0].bias]["exp_avg_sq"])


@pytest.mark.layer("pure")
def test_a_call_order_error_names_the_optimizer_save_it_caught() -> None:
    from rannc.validate import describe_call_order

    msg = describe_call_order(["optimizer.state_dict()", "forward (a call of the model)"])
    assert "rank 0: optimizer.state_dict()" in msg
    assert "`sd = optimizer.state_dict(); if rank == 0: torch.save(sd, path)`" in msg
    assert "`sd = model.state_dict();" in describe_call_order(["state_dict()", "x"])


def test_loading_optimizer_state_into_a_model_without_an_optimizer_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An optimizer built after wrapping is not the model's at load time (it becomes so at its
    first step, on several ranks): its saved state would silently not be loaded."""
    m, opt = _model()
    _step(m, opt)
    m.save_checkpoint(tmp_path / "ck")
    torch.manual_seed(0)
    late = rannc.RaNNCModule(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh()))
    with caplog.at_level(logging.WARNING, "rannc"):
        late.load_checkpoint(tmp_path / "ck")
    assert "holds optimizer state, and this model was given no optimizer" in caplog.text, caplog.text
    assert "RaNNCModule(model, optimizer)" in caplog.text and "take_optimizer" in caplog.text
    opt = torch.optim.Adam(late.parameters(), lr=1e-2)
    late.take_optimizer(opt)
    late.load_checkpoint(tmp_path / "ck")
    assert all(opt.state[p]["step"] == 1 for p in late.parameters())


def test_an_optimizer_built_after_wrapping_is_checkpointed(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """DDP's habit, `m = RaNNCModule(model); opt = Adam(m.parameters())`: at its first step the
    optimizer becomes the model's (said at INFO), so save_checkpoint holds its state (before:
    none, without a word) and a model given its optimizer resumes it."""
    torch.manual_seed(0)
    m = rannc.RaNNCModule(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    with caplog.at_level(logging.INFO, "rannc"):
        for _ in range(2):
            _step(m, opt)
    assert m.optimizer is opt and caplog.text.count("built after wrapping") == 1, caplog.text
    m.save_checkpoint(tmp_path / "ck")
    torch.manual_seed(3)
    model2 = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    rannc.RaNNCModule(model2, opt2).load_checkpoint(tmp_path / "ck")
    for p, q in zip(opt.param_groups[0]["params"], opt2.param_groups[0]["params"], strict=True):
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])
