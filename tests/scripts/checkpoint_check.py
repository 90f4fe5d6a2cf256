"""Checkpoint runs: gathered state dicts, optimizer state by name, sharded save/load, resume.

    mpiexec -n 4 python tests/scripts/checkpoint_check.py --phase save --dir D \
        --layout gpt2=1,1,2/2 --layout resnet=1,1,1,1/1

Every rank builds the same model and global batch (seed 0) and feeds its own rows, as
pipeline_check.py does; `--layout NAME=REPLICAS/MICROBATCHES` places each model (fill-drain,
no recomputation, so two runs of one layout compute identically). Phases, in the order the
tests run them:

* save (4 ranks): load a state dict before the first call; 2 steps against the unwrapped model
  on the global batch; the gathered state dict loads into a fresh unwrapped model (strict) and
  equals the reference's; the gathered optimizer state by name equals the reference's; after a
  3rd step both roll back with load_state_dict / load_optimizer_state_dict (after deployment)
  and redo it; save_checkpoint (twice: the second replaces the first); 3 more steps. Rank 0
  writes the losses of steps 4-6 and the state dicts after steps 3 and 6 to D/NAME.pt.
* resume (new processes, same layout): load_checkpoint before the first call, then steps 4-6
  equal the saved run's losses (to 1e-6) and final state dict. With --crash, rank 0 then dies
  inside save_checkpoint after every rank has written the temporary directory, before it is
  moved into place.
* load (another world size and plan): one step from a fresh model (deploys), load_checkpoint
  after deployment: the gathered state dict equals the saved step-3 one (so the crashed save
  left the last good checkpoint), and steps 4-6 equal the saved losses (rtol 1e-5).
* single (plain python): the same calls in one process.
* exact (2 ranks, --dir D): a model with dropout, an LR scheduler, a Stateful step counter and
  rannc.checkpoint.RNGState: 6 uninterrupted steps saving after step 3 (D/exact.pt: losses and
  state of steps 4-6); with --resume, new processes load before their first call and run steps
  4-6: losses, parameters, learning rate and step bit-identical.
* rank0-only (2 ranks): rank 0 calls save_checkpoint, rank 1 does not (`--then step`: it goes
  on training; `--then exit`: its script ends). Must fail within seconds, not timeout_s.

Prints "PASS <phase> <model> rank R" or raises.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]
import case_batch  # noqa: E402
from model_zoo import make_case  # noqa: E402
from pipeline_check import local_sizes, rows_of  # noqa: E402

import rannc  # noqa: E402
from rannc import checkpoint as ckpt  # noqa: E402
from rannc import dist as rdist  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
BATCH = 8


class Run:
    """The wrapped model on this rank's rows, and the unwrapped reference on the global batch."""

    def __init__(self, name: str, layout: str, rank: int, world: int) -> None:
        self.name, self.rank, self.world = name, rank, world
        case = make_case(name, batch=BATCH, seed=0)
        self.case = case
        torch.manual_seed(1)
        self.y = torch.randint(0, 5, (BATCH,))
        sizes = local_sizes(BATCH, world)
        lo = sum(sizes[:rank])
        self.mine = (lo, lo + sizes[rank])
        self.ref = copy.deepcopy(case.model)
        opts: dict[str, Any] = {"schedule": "gpipe", "checkpointing": "off", "profiler": "estimate"}
        if layout:  # REPLICAS/MICROBATCHES[/SCHEDULE/PARTITION_NUM]
            reps, micro, *sched = layout.split("/")
            opts["replicas"] = [int(x) for x in reps.split(",")]
            opts["microbatches"] = int(micro)
            if sched:
                opts["schedule"], opts["partition_num"] = sched[0], int(sched[1])
        self.opt = torch.optim.AdamW(case.model.parameters(), lr=1e-2, eps=1e-4)
        self.ref_opt = torch.optim.AdamW(self.ref.parameters(), lr=1e-2, eps=1e-4)
        self.model = rannc.RaNNCModule(case.model, self.opt, **opts)
        self.args = [rows_of(x, self.mine, BATCH) for x in case.args]
        self.kwargs = {k: rows_of(v, self.mine, BATCH) for k, v in case.kwargs.items()}

    def _loss(self, out: Any, rows: tuple[int, int] | None) -> torch.Tensor:
        if self.name == "resnet":
            y = self.y if rows is None else self.y[rows[0]:rows[1]]
            return F.cross_entropy(out, y)
        return out.loss  # a global scalar output: the same on every rank

    def step(self, ref: bool = True) -> float:
        """One training step; returns the global loss (checked against the reference)."""
        loss = self._loss(self.model(*self.args, **self.kwargs), self.mine)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        g = loss.detach().clone()
        if self.world > 1 and self.name == "resnet":  # the per-rank row means, averaged
            dist.all_reduce(g)
            g /= self.world
        if ref:
            ref_loss = self._loss(self.ref(*self.case.args, **self.case.kwargs), None)
            ref_loss.backward()
            self.ref_opt.step()
            self.ref_opt.zero_grad()
            torch.testing.assert_close(g, ref_loss.detach(), rtol=RTOL, atol=ATOL)
        return float(g)

    def check_params(self) -> None:
        ref = dict(self.ref.named_parameters())
        for n, p in self.model.named_parameters():
            torch.testing.assert_close(p, ref[n], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=n: f"rank {self.rank} param {n}: {m}")


def assert_state_equal(got: dict[str, Any], want: dict[str, Any], exact: bool = False) -> None:
    assert list(got) == list(want), (sorted(set(got) ^ set(want)))
    for k, v in want.items():
        if exact:
            assert torch.equal(got[k], v), k
        else:
            torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")


def check_gathered_state(run: Run) -> None:
    """The gathered state dict (rank 0, then every rank) loads strictly into a fresh unwrapped
    model and equals the reference's, buffers and tied names included."""
    want = run.ref.state_dict()
    for rank0_only in (True, False):
        sd = run.model.state_dict(rank0_only=rank0_only)
        if rank0_only and run.rank != 0:
            assert sd == {}, list(sd)[:3]
            continue
        fresh = make_case(run.name, batch=BATCH, seed=3).model
        fresh.load_state_dict(sd, strict=True)
        assert_state_equal(fresh.state_dict(), want)
        assert_state_equal(sd, want)


def named_ref_optimizer_state(run: Run) -> dict[str, dict[str, torch.Tensor]]:
    return {n: run.ref_opt.state[p] for n, p in run.ref.named_parameters() if p in run.ref_opt.state}


def check_gathered_optimizer_state(run: Run) -> None:
    osd = run.model.optimizer_state_dict()
    if run.rank != 0:
        assert osd == {}
        return
    want = named_ref_optimizer_state(run)
    assert list(osd["state"]) == list(want), sorted(set(osd["state"]) ^ set(want))
    for n, st in want.items():
        for k, v in st.items():
            torch.testing.assert_close(osd["state"][n][k], v, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=n, k=k: f"{n}.{k}: {m}")
    assert osd["param_groups"][0]["params"] == [n for n, _ in run.ref.named_parameters()]
    assert osd["param_groups"][0]["lr"] == 1e-2


def check_torch_optimizer_state(run: Run, want: dict[str, Any], out_dir: Path) -> Path:
    """torch's own `optimizer.state_dict()`, called on every rank, is the unwrapped optimizer's
    (`want`) on rank 0, by index, and rank 0 saves it; the other ranks' refuses saving and
    loading. Returns the file (after a barrier)."""
    osd = run.opt.state_dict()
    path = out_dir / f"{run.name}-optimizer.pt"
    if run.rank == 0:
        assert list(osd["state"]) == list(want["state"]), (list(osd["state"]), list(want["state"]))
        for i, st in want["state"].items():
            for k, v in st.items():
                torch.testing.assert_close(osd["state"][i][k], v, rtol=RTOL, atol=ATOL,
                                           msg=lambda m, i=i, k=k: f"state {i}.{k}: {m}")
        assert [g["params"] for g in osd["param_groups"]] == [g["params"] for g in want["param_groups"]]
        assert osd["param_groups"][0]["lr"] == want["param_groups"][0]["lr"]
        torch.save(osd, path)
    else:
        for refused in (lambda: torch.save(osd, out_dir / "never.pt"),
                        lambda: run.opt.load_state_dict(osd)):
            try:
                refused()
            except rannc.RaNNCError as e:
                assert "optimizer.state_dict()" in str(e), e
            else:
                raise AssertionError(f"rank {run.rank}'s optimizer.state_dict() was used")
    dist.barrier()
    return path


def phase_save(run: Run, out_dir: Path) -> None:
    init = make_case(run.name, batch=BATCH, seed=7).model.state_dict()
    run.model.load_state_dict(init)  # before the first call: into the module as usual
    run.ref.load_state_dict(init)
    for _ in range(2):
        run.step()
    check_gathered_state(run)
    check_gathered_optimizer_state(run)
    sd2 = run.model.state_dict(rank0_only=False)
    osd2 = run.model.optimizer_state_dict(rank0_only=False)
    ref_sd2 = copy.deepcopy(run.ref.state_dict())
    ref_osd2 = copy.deepcopy(run.ref_opt.state_dict())
    torch_layout = check_torch_optimizer_state(run, ref_osd2, out_dir)
    run.step()
    res = run.model.load_state_dict(sd2)  # after deployment: each rank copies what it holds
    assert not res.missing_keys and not res.unexpected_keys, res
    run.model.load_optimizer_state_dict(osd2)
    run.ref.load_state_dict(ref_sd2)
    run.ref_opt.load_state_dict(copy.deepcopy(ref_osd2))
    run.step()  # step 3 again from the restored state: equals the reference
    run.check_params()
    # and again from torch's own layout, read from rank 0's file on every rank
    run.model.load_state_dict(sd2)
    run.opt.load_state_dict(torch.load(torch_layout, weights_only=True))
    run.ref.load_state_dict(ref_sd2)
    run.ref_opt.load_state_dict(copy.deepcopy(ref_osd2))
    run.step()
    run.check_params()
    print(f"PASS state_dict {run.name} rank {run.rank}", flush=True)
    target = out_dir / run.name
    run.model.save_checkpoint(target)
    run.model.save_checkpoint(target)  # replaces the first
    sd3 = run.model.state_dict()
    losses = [run.step() for _ in range(3)]
    run.check_params()
    sd6 = run.model.state_dict()
    if run.rank == 0:
        torch.save({"losses": losses, "sd3": sd3, "sd6": sd6}, out_dir / f"{run.name}.pt")
        assert sorted(os.listdir(target)) == ["latest", "v-000002"], os.listdir(target)
    print(f"PASS save {run.name} rank {run.rank}", flush=True)


def saved(out_dir: Path, name: str) -> dict[str, Any]:
    return torch.load(out_dir / f"{name}.pt", weights_only=True)


def phase_resume(run: Run, out_dir: Path) -> None:
    want = saved(out_dir, run.name)
    run.model.load_checkpoint(out_dir / run.name)  # before the first call
    losses = [run.step(ref=False) for _ in range(3)]
    torch.testing.assert_close(losses, want["losses"], rtol=0, atol=1e-6)
    sd6 = run.model.state_dict()
    if run.rank == 0:
        assert_state_equal(sd6, want["sd6"])
    print(f"PASS resume {run.name} rank {run.rank} losses {losses}", flush=True)


def crash_during_save(run: Run, out_dir: Path) -> None:
    """Rank 0 dies after every rank has written the temporary directory, before publishing it."""
    def die(root: Path, tmp: str, version: str) -> None:
        assert (root / tmp / ckpt.META_FILE).exists()
        print(f"CRASHING rank {run.rank} before moving {tmp} into place", flush=True)
        os._exit(1)

    ckpt._publish = die  # type: ignore[assignment]
    run.model.save_checkpoint(out_dir / run.name)
    raise AssertionError("save_checkpoint returned after its writer died")


def phase_load(run: Run, out_dir: Path) -> None:
    want = saved(out_dir, run.name)
    run.step(ref=False)  # deploys; the checkpoint then overwrites what this step changed
    run.model.load_checkpoint(out_dir / run.name)
    sd = run.model.state_dict()
    if run.rank == 0:
        assert_state_equal(sd, want["sd3"], exact=True)
    losses = [run.step(ref=False) for _ in range(3)]
    torch.testing.assert_close(losses, want["losses"], rtol=RTOL, atol=ATOL)
    print(f"PASS load {run.name} rank {run.rank} of {run.world} losses {losses}", flush=True)


def phase_single(run: Run, out_dir: Path) -> None:
    """One process: the same calls, on the module itself."""
    sd = run.model.state_dict()
    assert_state_equal(sd, run.case.model.state_dict(), exact=True)
    for _ in range(2):
        run.step()
    check_gathered_state(run)
    check_gathered_optimizer_state(run)
    run.model.save_checkpoint(out_dir / "single")
    want = copy.deepcopy(run.model.state_dict())
    losses = [run.step() for _ in range(2)]
    run.model.load_checkpoint(out_dir / "single")
    assert_state_equal(run.model.state_dict(), want, exact=True)
    again = [run.step(ref=False) for _ in range(2)]
    assert again == losses, (again, losses)
    print(f"PASS single {run.name} rank 0", flush=True)


class DropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 1)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.drop(torch.relu(self.b(self.drop(torch.relu(self.a(x)))))))


class StepCounter:
    """A Stateful of the script's own: the number of finished steps."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]


def phase_exact(out_dir: Path, resume: bool, rank: int, world: int) -> None:
    """Resume bit-identical to an uninterrupted run: dropout RNG and LR schedule included."""
    torch.manual_seed(0)
    model = DropNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    m = rannc.RaNNCModule(model, opt, schedule="gpipe", checkpointing="off", profiler="estimate",
                          replicas=[1] * world, microbatches=2)
    torch.manual_seed(100 + rank)  # each rank's own dropout stream
    counter = StepCounter()
    sizes = local_sizes(BATCH, world)
    lo = sum(sizes[:rank])
    ck = out_dir / "exact"

    def step() -> float:
        g = torch.Generator().manual_seed(counter.n)  # the data of step n, whoever runs it
        x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 1, generator=g)
        loss = F.mse_loss(m(x[lo:lo + sizes[rank]]), y[lo:lo + sizes[rank]])
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.n += 1
        return float(loss)

    if not resume:
        for _ in range(3):
            step()
        m.save_checkpoint(ck, sched=sched, step=counter, rng=ckpt.RNGState())
        losses = [step() for _ in range(3)]
        sd = m.state_dict(rank0_only=False)
        torch.save({"losses": losses, "sd": sd, "lr": opt.param_groups[0]["lr"]},
                   out_dir / f"exact-{rank}.pt")
        print(f"PASS exact-train rank {rank} losses {losses}", flush=True)
        return
    assert rannc.latest_checkpoint(ck) is not None
    m.load_checkpoint(ck, sched=sched, step=counter, rng=ckpt.RNGState())
    assert counter.n == 3, counter.n
    losses = [step() for _ in range(3)]
    want = torch.load(out_dir / f"exact-{rank}.pt", weights_only=True)
    assert losses == want["losses"], (losses, want["losses"])
    sd = m.state_dict(rank0_only=False)
    assert_state_equal(sd, want["sd"], exact=True)
    assert opt.param_groups[0]["lr"] == want["lr"] and counter.n == 6
    print(f"PASS exact-resume rank {rank} losses {losses}", flush=True)


def phase_rank0_only(out_dir: Path, then: str, rank: int, world: int) -> None:
    """`if rank == 0: save_checkpoint(...)`, the Hugging Face habit, then go on or finish."""
    model = DropNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    m = rannc.RaNNCModule(model, opt, schedule="gpipe", checkpointing="off", profiler="estimate",
                          replicas=[1] * world, microbatches=2)
    for step in range(2):
        m(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 0 and rank == 0:
            print(f"SAVING rank 0 on its own, then={then}", flush=True)
            start = time.monotonic()
            try:
                m.save_checkpoint(out_dir / "alone")
            finally:
                print(f"REFUSED after {time.monotonic() - start:.2f} s", flush=True)
        if then == "exit":
            break


PHASES: dict[str, Callable[[Run, Path], None]] = {
    "save": phase_save, "resume": phase_resume, "load": phase_load, "single": phase_single}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", required=True, choices=[*sorted(PHASES), "exact", "rank0-only"])
    p.add_argument("--dir", required=True)
    p.add_argument("--layout", action="append", default=[],
                   help="NAME=REPLICAS/MICROBATCHES[/SCHEDULE/PARTITION_NUM]")
    p.add_argument("--crash", action="store_true", help="resume: then die inside a save")
    p.add_argument("--resume", action="store_true", help="exact: resume from the checkpoint")
    p.add_argument("--then", choices=("step", "exit"), default="step", help="rank0-only")
    return p.parse_args(argv)


def run(a: argparse.Namespace, ctx: rdist.DistContext) -> None:
    out_dir = Path(a.dir)
    if a.phase == "exact":
        phase_exact(out_dir, a.resume, ctx.rank, ctx.world_size)
    elif a.phase == "rank0-only":
        phase_rank0_only(out_dir, a.then, ctx.rank, ctx.world_size)
    runs = []
    for spec in a.layout:
        name, _, layout = spec.partition("=")
        run = Run(name, layout, ctx.rank, ctx.world_size)
        PHASES[a.phase](run, out_dir)
        runs.append(run)
    if a.crash:
        crash_during_save(runs[0], out_dir)


def main() -> None:
    case_batch.main(parse, run)


if __name__ == "__main__":
    main()
