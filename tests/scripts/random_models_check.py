"""Exactness under random models, multi-rank layer (issue 9): random DAG models
(tests/random_models.py) in random layouts, wrapped in RaNNCModule, against the unwrapped
model on the global batch.

    mpiexec -n 3 python tests/scripts/random_models_check.py --examples 12 --seed 3

Lockstep: rank 0 alone runs hypothesis (seeded by --seed, generate phase only, no shrinking)
and broadcasts each drawn (model, layout) to the other ranks, which loop until rank 0 sends
"stop". Running the same hypothesis sequence on every rank would also be deterministic, but
only as long as hypothesis's engine makes the same decisions on every rank (it also reacts to
what the test did); one drawing rank cannot diverge by construction. A check never raises into
hypothesis: its outcome is recorded, every rank's outcome gathered after each example, and
each rank prints `EXAMPLE i rank r PASS|FAIL ...`.

A layout: stage count (at most the nodes the outputs depend on), replicas per stage summing
to the world size, microbatches 1..4, schedule gpipe/1f1b/scp, recomputation on or off, a
global batch of max(world, microbatches)..3*world rows (uneven over ranks). Each example
checks, with pipeline_check's helpers: this rank's output rows, the loss, the gradient of
every parameter it holds (None where the original's is None) for 2 AdamW steps, then the
parameters, and on rank 0 the gathered state_dict (BatchNorm running statistics included).

BatchNorm normalises over the rows one replica sees in one microbatch, by design (see
tests/test_pipeline_mpi.py). A model with BatchNorm is therefore trained in train mode only
when the layout has 1 microbatch and 1 replica per stage; under any other layout both copies
are put in eval mode (running statistics, still training the parameters), which is exact.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2]),
                str(Path(__file__).resolve().parent)]
import case_batch  # noqa: E402
from pipeline_check import ATOL, RTOL, compare_and_loss, local_sizes, rows_of  # noqa: E402
from random_models import DagSpec, Node, build, dag_specs, make_inputs, user_loss  # noqa: E402

import rannc  # noqa: E402
from rannc import dist as rdist  # noqa: E402

STEPS = 2
PROCESS_GROUP_TIMEOUT_S = 120


@dataclass(frozen=True)
class Layout:
    replicas: tuple[int, ...]
    microbatches: int
    schedule: str
    checkpointing: str
    batch: int

    def bn_exact(self) -> bool:
        return self.microbatches == 1 and all(r == 1 for r in self.replicas)


@st.composite
def layouts(draw: st.DrawFn, world: int, spec: DagSpec) -> Layout:
    s = draw(st.integers(1, min(world, spec.live_nodes())))
    cuts = sorted(draw(st.lists(st.integers(1, world - 1), min_size=s - 1, max_size=s - 1,
                                unique=True))) if s > 1 else []
    bounds = [0, *cuts, world]
    micro = draw(st.integers(1, 4))
    return Layout(replicas=tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False)),
                  microbatches=micro,
                  schedule=draw(st.sampled_from(["gpipe", "1f1b", "scp"])),
                  checkpointing=draw(st.sampled_from(["on", "off"])),
                  # a row per rank and per microbatch (fewer: a ConfigError, by design)
                  batch=draw(st.integers(max(world, micro), 3 * world)))


def check_example(spec: DagSpec, lay: Layout, rank: int, world: int,
                  ignore_last: bool = False) -> list[str]:
    """Train both copies for STEPS steps; return what differed on this rank (empty: exact).
    A difference is recorded and the run goes on, so that every rank makes the same
    collective calls whatever it finds."""
    errors: list[str] = []

    def check(what: str, got: Any, want: Any) -> None:
        try:
            if (got is None) != (want is None):
                raise AssertionError(f"{got} vs {want}")
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        except AssertionError as e:
            errors.append(f"{what}: {e}")

    model = build(spec, seed=1)
    ref = copy.deepcopy(model)
    args, kwargs = make_inputs(spec, lay.batch, seed=2)
    sizes = local_sizes(lay.batch, world)
    lo = sum(sizes[:rank])
    mine = (lo, lo + sizes[rank])
    l_args = [rows_of(x, mine, lay.batch) for x in args]
    l_kwargs = {k: rows_of(v, mine, lay.batch) for k, v in kwargs.items()}
    opt_w = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4)
    wrapped = rannc.RaNNCModule(model, opt_w, replicas=list(lay.replicas),
                                microbatches=lay.microbatches, schedule=lay.schedule,
                                checkpointing=lay.checkpointing, profiler="estimate", timeout_s=60)
    if spec.has_batchnorm and not lay.bn_exact():
        wrapped.eval()
        ref.eval()
    y = torch.zeros(lay.batch)  # unused by user_loss; compare_and_loss slices it
    ref_params = dict(ref.named_parameters())
    for step in range(STEPS):
        out = wrapped(*l_args, **l_kwargs)
        ref_out = ref(*args, **kwargs)
        try:
            loss, ref_loss = compare_and_loss("random", out, ref_out, y, sizes, rank,
                                              f"step {step}", loss_fn=lambda o, _y: user_loss(o, ignore_last))
        except AssertionError as e:
            errors.append(str(e))
            loss, ref_loss = user_loss(out, ignore_last), user_loss(ref_out, ignore_last)
        loss.backward()
        ref_loss.backward()
        for n, p in wrapped.named_parameters():
            check(f"step {step} grad {n}", p.grad, ref_params[n].grad)
        opt_w.step()
        opt_r.step()
        opt_w.zero_grad()
        opt_r.zero_grad()
    for n, p in wrapped.named_parameters():
        check(f"param {n} after {STEPS} steps", p, ref_params[n])
    state = wrapped.state_dict()  # collective: rank 0 gets every entry
    if rank == 0:
        for k, v in ref.state_dict().items():
            check(f"state_dict {k}", state.get(k), v)
    return errors


def run_one(i: int, spec: DagSpec, lay: Layout, rank: int, world: int,
            ignore_last: bool = False) -> bool:
    import torch.distributed as dist

    t0 = time.perf_counter()
    try:
        error = " || ".join(check_example(spec, lay, rank, world, ignore_last))
    except Exception as e:  # recorded, gathered, reported: never raised into hypothesis
        error = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    error = error.replace("\n", " | ")[:2000]
    outcomes: list[Any] = [None] * world
    dist.all_gather_object(outcomes, error)
    mode = "train" if not spec.has_batchnorm or lay.bn_exact() else "eval"
    status = "PASS" if not error else f"FAIL {error}"
    # One write per line: the ranks share the launcher's pipe.
    sys.stdout.write(f"EXAMPLE {i} rank {rank} {status} ({time.perf_counter() - t0:.1f} s; "
                     f"{lay}; {mode}; {spec.describe()})\n")
    sys.stdout.flush()
    return not any(outcomes)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--examples", type=int, default=12)
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed (rank 0 draws)")
    p.add_argument("--dead-batchnorm", action="store_true",
                   help="instead: the one known failing model (a dead BatchNorm branch)")
    p.add_argument("--unused-output", action="store_true",
                   help="instead: a replicated stage whose second output the loss ignores; "
                        "its head's .grad must stay None on every rank")
    return p.parse_args(argv)


def run(a: argparse.Namespace, ctx: rdist.DistContext) -> None:
    import torch.distributed as dist

    rank, world = ctx.rank, ctx.world_size
    count = 0

    def next_example(box: list[Any]) -> None:
        nonlocal count
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            run_one(count, *box[0], rank, world)
            count += 1

    if a.dead_batchnorm:  # drawn by seed 2 on 2 ranks; bn#2 is dead, ln#1 then gets zeros
        n = Node
        spec = DagSpec(in_width=9, in2_width=0, y_by_keyword=False, linears=(),
                       norms=(("bn", 9), ("ln", 9), ("bn", 18)),
                       nodes=(n("act", (0,), act="relu"), n("bn", (1,), module=0),
                              n("add", (0, 0)), n("act", (3,), act="tanh"), n("add", (1, 3)),
                              n("add", (1, 3)), n("ln", (6,), module=1), n("cat", (7, 6)),
                              n("bn", (8,), module=2), n("add_", (2, 3))),
                       outputs=(10, 3), form="tuple", scalar=True)
        run_one(0, spec, Layout((1,) * world, 1, "1f1b", "off", 3), rank, world)
        count = 1
    elif a.unused_output:  # two Linear heads, one stage on every rank, the loss of one head
        spec = DagSpec(in_width=4, in2_width=0, y_by_keyword=False, linears=((4, 4),) * 3,
                       norms=(), nodes=(Node("linear", (0,), module=0),
                                        Node("linear", (1,), module=1),
                                        Node("linear", (1,), module=2)),
                       outputs=(2, 3), form="tuple", scalar=False)
        run_one(0, spec, Layout((world,), 2, "gpipe", "off", 2 * world), rank, world,
                ignore_last=True)
        count = 1
    elif rank == 0:
        @seed(a.seed)  # deterministic, and another sequence for each launch's seed
        @settings(max_examples=a.examples, deadline=None, database=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(spec=dag_specs(), data=st.data())
        def draw(spec: DagSpec, data: st.DataObject) -> None:
            next_example([(spec, data.draw(layouts(world, spec)))])

        draw()
        next_example([None])
    else:
        box: list[Any] = [None]
        while True:
            box = [None]
            next_example(box)
            if box[0] is None:
                break
    print(f"DONE rank {rank} examples {count}", flush=True)


def main() -> None:
    case_batch.main(parse, run, timeout_s=PROCESS_GROUP_TIMEOUT_S)


if __name__ == "__main__":
    main()
