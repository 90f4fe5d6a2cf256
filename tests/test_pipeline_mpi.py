"""Multi-rank pipelines under mpiexec (gloo, CPU) against the unwrapped model on the global
batch: each rank's output rows, the loss, every held parameter's gradient and the parameters
after 3 AdamW steps (rtol 1e-5), for the model set and the layouts of issue 3.

Each test checks its own case of tests/scripts/pipeline_check.py (`CASES`), but the cases that
need the same ranks run in one launch (tests/mpi_harness.py's `CaseLaunches`): a launch's
start-up costs more than most cases."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import pytest
from mpi_harness import TESTS, Case, CaseLaunches, case_launches_fixture, case_of, run_mpi, run_torchrun

# (timeout: the first test of a rank count waits for its whole launch, and relaunches after a
# crash; each launch is killed by its own limit, 120 s + 150 s per case)
pytestmark = [pytest.mark.layer("multi_rank"), pytest.mark.timeout(3600)]

SCRIPT = TESTS / "scripts" / "pipeline_check.py"
CASES: dict[str, Case] = {}  # filled below, next to the tests that read them
launches = case_launches_fixture(SCRIPT, CASES)


def _case(case_id: str, n: int, args: Any, env: dict[str, str] | None = None, script: str = "") -> str:
    CASES[case_id] = Case(n, args, env or {}, script)
    return case_id

ALL = "bert,gpt2,fork_join,shared_param,kwargs"
# BatchNorm normalises over the rows one replica sees in one microbatch (as DDP without
# SyncBatchNorm does), so ResNet equals the unwrapped model on the global batch only with one
# microbatch and one replica per stage.
WITH_BN = ALL + ",resnet"

# (ranks, layout arguments, microbatches, global batch, models): every layout of issue 3 with
# the whole model set; uneven batches (7, 9, 10 rows over 3 or 4 ranks and 2 or 4 microbatches).
LAYOUTS = [
    (2, ["--partition-num", "2", "--eval-check", "--last-batch", "3"], 1, 8, WITH_BN),
    (2, ["--partition-num", "2"], 2, 5, ALL),
    (3, ["--replicas", "2,1"], 2, 7, ALL),
    (3, ["--replicas", "1,2"], 4, 9, ALL),
    (4, ["--replicas", "1,3"], 4, 10, ALL),
    # A last batch of 7 rows: only rank 3's rows change, so ranks 0 to 2 run that call on the
    # last call's row layout first and then again on the new one.
    (4, ["--replicas", "2,2", "--last-batch", "7"], 2, 8, ALL),
    (4, ["--replicas", "1,1,2"], 2, 9, ALL),
    (4, ["--replicas", "1,1"], 1, 8, ALL),  # 2 stages, the pipeline replicated (R = 2)
    # Rows regrouped from 2 replicas into 1: T5's padded mask is picked per row by an
    # arange over the microbatch, which each stage must compute for its own rows.
    (3, ["--replicas", "2,1"], 2, 6, "t5"),
    # Writes through views and into buffers, with values written in one stage read in the
    # next (one microbatch: its input-dependent buffer update, like BatchNorm's, is per piece);
    # a last batch of 5 rows: rank 0's rows stay, so it runs that call on the old layout first,
    # its buffer writes (and BatchNorm's counters) put back before it runs again.
    (2, ["--partition-num", "2", "--eval-check", "--last-batch", "5"], 1, 6, "writes,resnet"),
    # One row on one rank at the very first call (capture, profiling and planning included):
    # reported to hang every rank until timeout_s.
    (4, ["--partition-num", "2", "--rows", "4,4,1,4"], 1, 13, "bert"),
]


# Fill-drain on the replica layouts that test_every_schedule_equals_the_unwrapped_model runs with
# the same ranks, stages and rows under 1F1B/scp: CI runs those; --full adds these.
FULL_ONLY = {(3, "1,2", 9), (4, "1,3", 10), (4, "1,1,2", 9), (3, "2,1", 7)}  # (ranks, replicas, batch)


def _layout_params() -> list[Any]:
    out: list[Any] = []
    for n, lay, mb, b, models in LAYOUTS:
        full = lay[0] == "--replicas" and (n, lay[1], b) in FULL_ONLY
        i = f"{n}r-{'_'.join(lay[1:])}-m{mb}-b{b}"
        c = _case(f"layout-{i}", n, ["--model", models, *lay, "--microbatches", str(mb), "--batch", str(b)])
        out.append(pytest.param(n, lay, mb, b, models, c, id=i,
                                marks=[pytest.mark.cases(c), *([pytest.mark.full] if full else [])]))
    return out


@pytest.mark.parametrize(("n", "layout", "micro", "batch", "models", "case"), _layout_params())
def test_pipeline_equals_unwrapped_model(n: int, layout: list[str], micro: int, batch: int,
                                         models: str, case: str, launches: CaseLaunches) -> None:
    res = launches.result(case)
    for model in models.split(","):
        got = sorted(re.findall(rf"PASS {model} rank (\d+)", res.stdout))
        assert got == [str(r) for r in range(n)], (model, res.stdout)
        if "--last-batch" in layout:
            # Calls after the first run before the ranks agree on the rows (no collective at
            # a step's start); the ranks whose rows stay the same in the last batch guess the
            # old layout there, and run the call again on the new one.
            guesses = {int(r): (int(g), int(x)) for r, g, x in re.findall(
                rf"GUESSES {model} rank (\d+) guessed (\d+) rerun (\d+)", res.stdout)}
            last = int(layout[layout.index("--last-batch") + 1])
            kept = [r for r in range(n) if _rows(batch, n)[r] == _rows(last, n)[r]]
            assert sorted(guesses) == list(range(n)), (model, res.stdout)
            assert all(g >= 2 for g, _x in guesses.values()), (model, guesses)
            assert all(guesses[r][1] >= 1 for r in kept), (model, kept, guesses)
            assert all(guesses[r][1] == 0 for r in range(n) if r not in kept), (model, guesses)


def _rows(batch: int, world: int) -> list[int]:
    """Each rank's rows of a global batch, as pipeline_check.local_sizes splits it."""
    return [batch // world + (1 if r < batch % world else 0) for r in range(world)]


# (ranks, arguments, models): 1F1B and the shifted critical path on the runtime's layouts, with
# partial recomputation, a scaled loss and a GradScaler; the models without a scalar loss output
# (fork_join, shared_param) run fill-drain instead, and kwargs' batch output that the loss also
# uses takes the late recomputing pass.
SCHEDULED = [
    (2, ["--partition-num", "2", "--microbatches", "4", "--batch", "8", "--schedule", "1f1b",
         "--extra-forward"], ALL),
    (3, ["--replicas", "1,2", "--microbatches", "4", "--batch", "9", "--schedule", "scp",
         "--recompute-fraction", "0.5", "--eval-check", "--new-seq", "5"], ALL),
    (4, ["--replicas", "1,1,2", "--microbatches", "4", "--batch", "9", "--schedule", "1f1b",
         "--recompute-fraction", "0.5", "--loss-scale", "0.5"], ALL),
    (4, ["--replicas", "2,2", "--microbatches", "2", "--batch", "8", "--schedule", "scp",
         "--recompute-fraction", "1", "--grad-scaler"], "bert,gpt2"),
    # (--full: the replicated pipeline runs fill-drain in CI, a GradScaler under the others)
    (4, ["--replicas", "1,1", "--microbatches", "2", "--batch", "8", "--schedule", "1f1b",
         "--grad-scaler"], "bert,gpt2"),
    (3, ["--replicas", "2,1", "--microbatches", "2", "--batch", "7", "--schedule", "1f1b"], ALL),
    (4, ["--replicas", "1,3", "--microbatches", "4", "--batch", "10", "--schedule", "scp",
         "--checkpointing", "on"], ALL),
    # zero-bubble: each backward as B then W, W deferred (stage s by s passes) into the
    # cool-down, with replicas, partial recomputation (the rebuilt part kept until W), a
    # GradScaler, and the late pass (kwargs) and the fill-drain fallback (fork_join)
    (4, ["--replicas", "2,1,1", "--microbatches", "4", "--batch", "10", "--schedule",
         "zero_bubble", "--recompute-fraction", "0.5", "--grad-scaler"], ALL),
    (2, ["--partition-num", "2", "--microbatches", "4", "--batch", "8", "--schedule", "zero_bubble",
         "--loss-scale", "0.5", "--extra-forward"], "bert,gpt2"),
    # ZB-H1 with W deferred by at most one microbatch: 4 stages (lags 0, 1, 1, 1, where ZB-H1's
    # are 0 to 3), partial recomputation
    (4, ["--partition-num", "4", "--microbatches", "6", "--batch", "12", "--schedule",
         "zero_bubble_lag1", "--recompute-fraction", "0.5"], "bert,gpt2"),
    # ... and by none (each W right after its B, which is sent back first), with replicas
    (3, ["--replicas", "2,1", "--microbatches", "4", "--batch", "10", "--schedule",
         "zero_bubble_lag0", "--grad-scaler"], "bert,gpt2"),
    # interleaved: two stages per rank (s and s + P on the same ranks), replicas per pipeline
    # position [1, 2], partial recomputation; fork_join falls back to fill-drain over the same
    # shared ranks, kwargs takes the late pass
    (3, ["--replicas", "1,2", "--partition-num", "4", "--microbatches", "4", "--batch", "9",
         "--schedule", "interleaved_1f1b", "--recompute-fraction", "0.5"], ALL),
    (2, ["--partition-num", "4", "--microbatches", "2", "--batch", "8", "--schedule",
         "interleaved_1f1b", "--grad-scaler"], "bert,gpt2"),
    # ZB-V: stages d and 2P - 1 - d on the same ranks (the middle two hand their activations
    # over within each rank), backward as B then W, replicas per pipeline position [1, 2],
    # partial recomputation and a GradScaler; fewer microbatches than its 2P - 1 warm-up
    (3, ["--replicas", "1,2", "--partition-num", "4", "--microbatches", "4", "--batch", "9",
         "--schedule", "zero_bubble_v", "--recompute-fraction", "0.5", "--grad-scaler"], ALL),
    (2, ["--partition-num", "4", "--microbatches", "2", "--batch", "8", "--schedule",
         "zero_bubble_v", "--loss-scale", "0.5", "--extra-forward"], "bert,gpt2"),
    # selective recomputation (recipes rebuilt when backward reads them): in B and again in W
    # of ZB-V's split backward, on top of a recomputed prefix, with replicas; and under 1F1B
    # with a GradScaler, T5 included (a write into a tensor forward made)
    (3, ["--replicas", "1,2", "--partition-num", "4", "--microbatches", "4", "--batch", "9",
         "--schedule", "zero_bubble_v", "--recompute-fraction", "0.5", "--selective"], ALL),
    (2, ["--partition-num", "2", "--microbatches", "4", "--batch", "8", "--schedule", "1f1b",
         "--selective", "--grad-scaler"], "bert,gpt2,t5,llama"),
]


SCHEDULED_FULL = frozenset({"4r-replicas_1,1_microbatches_2_batch_8_schedule_1f1b_grad-scaler"})


def _ids(rows: list[Any]) -> list[str]:
    return [f"{n}r-{'_'.join(x.lstrip('-') for x in a)}" for n, a, *_ in rows]


def _params(kind: str, rows: list[Any], env: dict[str, str] | None = None,
            full: frozenset[str] = frozenset()) -> list[Any]:
    """pytest.param(n, args, models) per row, each with its case `kind-id`."""
    return [pytest.param(n, a, m, id=i, marks=[pytest.mark.cases(_case(
        f"{kind}-{i}", n, ["--model", m, *a], env)), *([pytest.mark.full] if i in full else [])])
        for (n, a, m), i in zip(rows, _ids(rows), strict=True)]


@pytest.mark.parametrize(("n", "args", "models"), _params("schedule", SCHEDULED, full=SCHEDULED_FULL))
def test_every_schedule_equals_the_unwrapped_model(n: int, args: list[str], models: str,
                                                   launches: CaseLaunches,
                                                   request: pytest.FixtureRequest) -> None:
    res = launches.result(case_of(request))
    sched = args[args.index("--schedule") + 1]
    assert f"SCHEDULE {sched}" in res.stdout
    if "fork_join" in models:  # no scalar loss output: fill-drain, and the log says why
        assert "runs fill-drain (gpipe) instead" in res.stdout + res.stderr
    for model in models.split(","):
        got = sorted(re.findall(rf"PASS {model} rank (\d+)", res.stdout))
        assert got == [str(r) for r in range(n)], (model, res.stdout)
    if "--selective" in args:  # every rank's stages keep recipes, and autograd used some
        for model in ("bert", "gpt2", *(("llama",) if "llama" in models else ())):
            dropped = re.findall(rf"SELECTIVE {model} rank \d+ parts (\d+) dropped (\d+)", res.stdout)
            assert len(dropped) == n and all(int(p) > 0 and int(d) > 0 for p, d in dropped), dropped
    if "--new-seq" in args:  # eval and a new sequence length re-captured, placed, run twice
        for what in ("eval", "new sequence"):
            assert len(re.findall(rf"OK {what} bert rank", res.stdout)) == 2 * n


# Gradients reduced in buckets of about 1 KB (RANNC_BUCKET_MB), so most parameters reduce in
# their own .grad and the small ones share buffers, started during the last backward under
# fill-drain: with replicas, BERT's word embedding tied across both stages (a group of all four
# ranks), shared_param's weight used twice, and partial recomputation (a parameter read by the
# recomputed and the kept part accumulates twice in one microbatch); under 1F1B every bucket
# starts after backward(); no_sync and clipping with small buckets are in test_train_ops_mpi.py.
BUCKETED = [
    (4, ["--replicas", "2,2", "--microbatches", "2", "--batch", "8", "--schedule", "gpipe",
         "--recompute-fraction", "0.5"], "bert,shared_param,gpt2"),
    (3, ["--replicas", "2,1", "--microbatches", "2", "--batch", "7", "--schedule", "1f1b",
         "--grad-scaler"], "bert,kwargs"),
]


# ZeRO-1 (RANNC_ZERO_STAGE=1): each parameter's optimizer state on one of its holders, its new
# values broadcast after the step, in chunks of bucket_mb (1 KB here: many chunks). With
# replicas, parameters tied across stages (BERT's word embedding, four holders), partial
# recomputation, a GradScaler with an overflow injected at step 1 (every rank skips that step,
# and no holder's state goes stale), and data parallelism alone (one stage x 2).
ZERO = [
    (4, ["--replicas", "2,2", "--microbatches", "2", "--batch", "8", "--schedule", "gpipe",
         "--recompute-fraction", "0.5"], "bert,shared_param,gpt2"),
    (3, ["--replicas", "2,1", "--microbatches", "2", "--batch", "7", "--schedule", "1f1b",
         "--grad-scaler", "--inject-overflow", "1"], "bert,kwargs"),
    (2, ["--replicas", "2", "--microbatches", "1", "--batch", "8"], "gpt2"),
]


@pytest.mark.parametrize(("n", "args", "models"),
                         _params("zero", ZERO, {"RANNC_BUCKET_MB": "0.001", "RANNC_ZERO_STAGE": "1"}))
def test_zero_1_equals_the_unwrapped_model(n: int, args: list[str], models: str,
                                           launches: CaseLaunches, request: pytest.FixtureRequest) -> None:
    res = launches.result(case_of(request))
    for model in models.split(","):
        got = sorted(re.findall(rf"PASS {model} rank (\d+)", res.stdout))
        assert got == [str(r) for r in range(n)], (model, res.stdout)
        state = re.findall(rf"STATE {model} rank (\d+) params_with_state (\d+) of_reference "
                           r"(\d+) zero (\d+)", res.stdout)
        assert len(state) == n and all(z == "1" for *_x, z in state), (model, state)
        # every parameter's state exactly once over the ranks, as in the unwrapped optimizer
        assert sum(int(k) for _r, k, _ref, _z in state) == int(state[0][2]), (model, state)


@pytest.mark.parametrize(("n", "args", "models"), _params("buckets", BUCKETED, {"RANNC_BUCKET_MB": "0.001"}))
def test_small_gradient_buckets_equal_the_unwrapped_model(n: int, args: list[str], models: str,
                                                          launches: CaseLaunches,
                                                          request: pytest.FixtureRequest) -> None:
    res = launches.result(case_of(request))
    for model in models.split(","):
        got = sorted(re.findall(rf"PASS {model} rank (\d+)", res.stdout))
        assert got == [str(r) for r in range(n)], (model, res.stdout)


# Mixed precision (issue 6): bf16 autocast with recomputation under 1F1B (fill-drain's, exact:
# test_recomputation_replays_dropout), a model cast to bf16, and GradScaler with an inf gradient
# injected on one rank (every rank must skip that step and keep the same scale; kwargs leaves two
# ranks without parameters).
PRECISION = [
    (2, ["--partition-num", "2", "--microbatches", "2", "--batch", "8", "--schedule", "1f1b",
         "--autocast", "bf16", "--recompute-fraction", "1"], "bert,gpt2"),
    (2, ["--partition-num", "2", "--microbatches", "2", "--batch", "8", "--bf16"], "bert,gpt2"),
    (3, ["--replicas", "1,1,1", "--microbatches", "2", "--batch", "8", "--schedule", "1f1b",
         "--grad-scaler", "--inject-overflow", "1"], "bert,kwargs"),
    # (one stage on both ranks: the sums carry the overflow to every rank, unchecked)
    (2, ["--replicas", "2", "--microbatches", "2", "--batch", "8", "--grad-scaler",
         "--inject-overflow", "1"], "bert"),
    # (BERT untied, so that no parameter has two holders, and a scale of 1 at the overflow: a
    # unit loss gradient, whose overflow check travels with the loss gradient's all-reduce
    # under 1F1B; the halved scale after it takes the usual path)
    (3, ["--replicas", "1,1,1", "--microbatches", "2", "--batch", "8", "--schedule", "1f1b",
         "--grad-scaler", "--scaler-init", "1", "--inject-overflow", "1", "--untie"],
     "bert,kwargs"),
]


@pytest.mark.parametrize(("n", "args", "models"), _params("precision", PRECISION))
def test_mixed_precision_equals_the_unwrapped_model(n: int, args: list[str], models: str,
                                                    launches: CaseLaunches,
                                                    request: pytest.FixtureRequest) -> None:
    res = launches.result(case_of(request))
    for model in models.split(","):
        got = sorted(re.findall(rf"PASS {model} rank (\d+)", res.stdout))
        assert got == [str(r) for r in range(n)], (model, res.stdout)


@pytest.mark.cases(_case("alternate", 2, ["--model", "gpt2,resnet", "--partition-num", "2", "--microbatches",
                                           "1", "--batch", "8", "--steps", "10", "--eval-every", "1"]))
def test_train_and_eval_alternate_for_ten_steps(launches: CaseLaunches) -> None:
    """model.eval() + no_grad after every training step: forward-only, dropout off, BatchNorm on
    running statistics, the eval graph placed on the deployed stages once and reused."""
    res = launches.result("alternate")
    for model in ("gpt2", "resnet"):
        assert len(re.findall(rf"OK alternation {model} rank", res.stdout)) == 20, res.stdout
        assert sorted(re.findall(rf"PASS {model} rank (\d+)", res.stdout)) == ["0", "1"]
    said = "new mode (train/eval) (eval mode"  # (the capture key's part that differs)
    assert res.stdout.count(said) + res.stderr.count(said) == 2  # once per model, not per call


FAST = {"name": "fast", "memory_bytes": 16e9, "flops": 10e12, "mem_bandwidth": 1e12}
SLOW = {**FAST, "name": "slow", "flops": 5e12, "mem_bandwidth": 0.5e12}


def _cluster_file(path: Path, per_node: int, devices: list[dict[str, Any]]) -> str:
    path.write_text(json.dumps({"per_node": per_node, "devices": devices}))
    return str(path)


_case("cluster-speed", 3, lambda d: [
    "--model", ALL, "--replicas", "1,2", "--microbatches", "2", "--batch", "9", "--schedule", "1f1b",
    "--cluster-file", _cluster_file(d / "speed.json", 3, [FAST, FAST, SLOW])])
_case("cluster-first-stage", 2, lambda d: [
    "--model", "gpt2,kwargs", "--partition-num", "2", "--microbatches", "4", "--batch", "8",
    "--schedule", "1f1b", "--cluster-file", _cluster_file(d / "first.json", 2, [SLOW, FAST])])


@pytest.mark.cases("cluster-speed", "cluster-first-stage")
def test_a_mixed_cluster_splits_rows_by_speed_and_stays_exact(launches: CaseLaunches) -> None:
    """Issue 7: a cluster file declares rank 2 two times slower; the stage replicated over
    ranks 1 and 2 gives rank 1 two thirds of its rows; and a pipeline whose first stage lands on
    rank 1; training still equals the unwrapped model on the global batch."""
    res = launches.result("cluster-speed")
    for model in ALL.split(","):
        got = sorted(re.findall(rf"PASS {model} rank (\d+)", res.stdout))
        assert got == ["0", "1", "2"], (model, res.stdout)
    assert "1:fast:0.67,2:slow:0.33" in res.stdout, res.stdout
    # two stages on [slow, fast]: the mixed-cluster DP puts the first, larger stage on rank 1
    res = launches.result("cluster-first-stage")
    for model in ("gpt2", "kwargs"):
        assert sorted(re.findall(rf"PASS {model} rank (\d+)", res.stdout)) == ["0", "1"]
    assert re.search(r"PASS gpt2 rank 1 of 2 stage 0", res.stdout), res.stdout


@functools.cache
def _short_of_memory() -> tuple[list[dict[str, Any]], Any]:
    """The devices [fast, fast, slow, small] (small: enough memory for an equal share of the
    rows of the replicated stage, not for a fast device's speed share) and that stage's plan."""
    import dataclasses

    from model_zoo import make_case

    import rannc
    from rannc.atomic.components import atomic_components
    from rannc.graph.capture import capture
    from rannc.planner import plan_graph

    fast, slow = FAST, SLOW
    # (no selective recomputation: it would fit the speed share into the small memory, where
    # this case is about the rows that memory moves)
    cfg = rannc.Config(replicas=[1, 3], microbatches=2, schedule="1f1b", selective_recompute=False,
                       extra={"hetero_dp": False})
    case = make_case("gpt2", batch=12)
    g = capture(case.model, case.args, case.kwargs).graph
    atomic = atomic_components(g)
    roomy = rannc.Cluster([rannc.DeviceSpec(**d) for d in (fast, fast, slow, fast)], per_node=4)
    by_speed = plan_graph(g, atomic, roomy, cfg, batch_size=12).stages[1].predicted["memory_bytes"]
    equal = plan_graph(g, atomic, roomy, dataclasses.replace(cfg, extra={"balance": False}),
                       batch_size=12).stages[1].predicted["memory_bytes"]
    assert equal < by_speed
    # enough for an equal share of the rows, not for a fast device's speed share
    small = {**fast, "name": "small", "memory_bytes": (equal + by_speed) / 2 / (1 - cfg.mem_margin)}
    devices = [fast, fast, slow, small]
    tight = rannc.Cluster([rannc.DeviceSpec(**d) for d in devices], per_node=4)
    plan = plan_graph(g, atomic, tight, dataclasses.replace(cfg, extra={}), batch_size=12)
    return devices, plan.stages[1]


_case("cluster-short-of-memory", 4, lambda d: [
    "--model", "gpt2", "--replicas", "1,3", "--microbatches", "2", "--batch", "12", "--schedule", "1f1b",
    "--cluster-file", _cluster_file(d / "short.json", 4, _short_of_memory()[0])],
    {"RANNC_SELECTIVE_RECOMPUTE": "0"})


@pytest.mark.cases("cluster-short-of-memory")
def test_a_mixed_cluster_with_a_rank_short_of_memory(launches: CaseLaunches) -> None:
    """Issue 7 acceptance: ranks [fast, fast, 2x slower, fast with too little memory for its
    speed share]. The stage replicated over ranks 1 to 3 splits rows by speed, then shifts rows
    away from rank 3 (what fits its memory); training equals the unwrapped model."""
    _devices, st = _short_of_memory()
    share = dict(zip(st.devices, st.shares, strict=True))
    assert share["slow"] < share["fast"] and share["small"] < share["fast"]  # memory, not speed
    res = launches.result("cluster-short-of-memory")
    assert sorted(re.findall(r"PASS gpt2 rank (\d+)", res.stdout)) == ["0", "1", "2", "3"]
    want = ",".join(f"{r}:{d}:{x:.2f}" for r, d, x in zip(st.ranks, st.devices, st.shares, strict=True))
    assert want in res.stdout, (want, res.stdout)


def _trace_prefix(res: Any) -> str:
    return re.search(r"TRACE (\S+)_gpt2\.json", res.stdout).group(1)  # type: ignore[union-attr]


_case("trace-1f1b", 2, lambda d: [
    "--model", "gpt2", "--partition-num", "2", "--microbatches", "4", "--batch", "8", "--schedule", "1f1b",
    "--steps", "2", "--checkpointing", "on", "--trace", str(d / "trace_1f1b")])


@pytest.mark.cases("trace-1f1b")
def test_trace_files_hold_every_rank_and_the_prediction(launches: CaseLaunches) -> None:
    from rannc.schedule import load_chrome_trace

    res = launches.result("trace-1f1b")
    assert "PASS gpt2 rank 0" in res.stdout
    prefix = _trace_prefix(res)
    events = load_chrome_trace(prefix + "_gpt2.json")
    assert sorted(events) == [0, 1]
    for rank, evs in events.items():
        done = [str(e.action) for e in evs if e.action.op.value in ("F", "B")]
        assert sorted(done) == sorted(f"{op}{rank}.{m}" for op in "FB" for m in range(4))
        assert all(e.end >= e.start for e in evs)
    assert any(e.action.op.value == "R" for e in events[0])  # stage 0 recomputes
    assert Path(prefix + "_gpt2.png").read_bytes()[:4] == b"\x89PNG"


_case("trace-zero-bubble", 2, lambda d: [
    "--model", "gpt2", "--partition-num", "2", "--microbatches", "4", "--batch", "8", "--schedule",
    "zero_bubble", "--steps", "2", "--trace", str(d / "trace_zb")])


@pytest.mark.cases("trace-zero-bubble")
def test_zero_bubble_runs_weight_gradients_apart(launches: CaseLaunches) -> None:
    """Under zero_bubble each rank runs W apart from B, as the schedule orders them: the last
    stage defers its first W past its second B, and the W passes do a real share of the
    backward's work (the weight gradients), not nothing."""
    from rannc.schedule import load_chrome_trace

    res = launches.result("trace-zero-bubble")
    assert "PASS gpt2 rank 1" in res.stdout and "SCHEDULE zero_bubble" in res.stdout
    events = load_chrome_trace(_trace_prefix(res) + "_gpt2.json")
    for rank, evs in events.items():
        order = [str(e.action) for e in evs if e.action.op.value in ("B", "W")]
        assert sorted(order) == sorted(f"{op}{rank}.{m}" for op in "BW" for m in range(4))
        if rank == 1:  # deferred by one: B1.0 B1.1 W1.0 ...
            assert order[:3] == ["B1.0", "B1.1", "W1.0"], order
        secs = {op: sum(e.end - e.start for e in evs if e.action.op.value == op) for op in "BW"}
        assert secs["W"] > 0.2 * secs["B"], (rank, secs)


@pytest.mark.cases(_case("holdings", 4, ["--model", "bert", "--partition-num", "4", "--microbatches", "2",
                                          "--steps", "1"]))
def test_receives_are_posted_ahead_of_the_actions_that_take_them() -> None:
    """A gloo transfer moves only once its receive is posted: each receive is posted while the action
    before it runs, or with the other pieces of its action where that action settles a guessed
    layout; none is a blocking recv. A send is dropped once the other rank's messages prove it
    arrived: of 8 microbatches, 1F1B and zero-bubble hold at most the 2 their first stage keeps
    in flight (each rank: its outputs, or its input gradients; fill-drain: its whole forward's,
    until forward() returns) (tests/scripts/prefetch_check.py; exact against the unwrapped
    model)."""
    res = run_mpi(TESTS / "scripts" / "prefetch_check.py", 2, [])
    got = re.findall(r"PASS (\S+) rank (\d) calls (\d+) blocking (\d+) posted (\d+) held (\d+)",
                     res.stdout)
    assert len(got) == 6, res.stdout
    for sched, _rank, calls, blocking, posted, held in got:
        assert int(blocking) == 0 < int(calls) < int(posted), got
        assert 0 < int(held) <= (8 if sched == "gpipe" else 2), got


def test_each_rank_holds_only_its_parameters(launches: CaseLaunches) -> None:
    """4 stages on 4 ranks: the parameter elements stored over all ranks add up to the model's,
    plus one copy of the word embedding tied between the first and the last stage."""
    res = launches.result("holdings")
    held = [int(x) for x in re.findall(r"PASS bert rank \d+ of 4 stage \d+ params (\d+)", res.stdout)]
    assert len(held) == 4
    from model_zoo import make_case

    bert = make_case("bert").model
    total = sum(p.numel() for p in bert.parameters())
    tied = bert.bert.embeddings.word_embeddings.weight.numel()
    assert sum(held) == total + tied, (held, total, tied)
    assert max(held) < total


@pytest.mark.parametrize("case", [
    pytest.param(c, id=c, marks=pytest.mark.cases(_case(c, 2, args, script="recompute_check")))
    for c, args in (("recompute-dropout", []),
                    ("recompute-autocast", ["--autocast", "--schedule", "gpipe"]))])
def test_recomputation_replays_dropout(launches: CaseLaunches, case: str) -> None:
    """(recompute-autocast: fill-drain recomputes in backward(), outside the autocast block)"""
    res = launches.result(case)
    assert len(re.findall(r"PASS rank", res.stdout)) == 2, res.stdout


def test_under_torchrun() -> None:
    res = run_torchrun(SCRIPT, 2, ["--model", "bert", "--partition-num", "2",
                                   "--microbatches", "2", "--batch", "6"])
    assert len(re.findall(r"PASS bert rank", res.stdout)) == 2, res.stdout


@functools.cache
def _bert_memory_needs() -> tuple[float, float]:
    """Bytes per device the planner says the test BERT needs as one stage, and with any stages,
    on 4 devices (batch 8): the limits the planned-run tests sit between."""
    from model_zoo import make_case

    import rannc
    from rannc.planner import PlanInfeasibleError

    case = make_case("bert", batch=8, seed=0)
    # a CPU device, as the ranks are: the forecast then holds a CPU rank's overhead, as theirs does
    cluster = rannc.Cluster.homogeneous(rannc.DeviceSpec("local-cpu", 1e12, 1e11, 1e10), n=4, per_node=4)
    needs = []
    for pn in (1, None):
        with pytest.raises(PlanInfeasibleError) as e:
            rannc.plan(case.model, case.args, case.kwargs, cluster=cluster,
                       config=rannc.Config(partition_num=pn, mem_limit_gb=1e-9))
        needs.append(e.value.needed_bytes)
    return needs[0], needs[1]


_case("memory-limit", 4, lambda d: [
    "--model", "bert", "--microbatches", "0", "--batch", "8",
    "--mem-limit-gb", repr((_bert_memory_needs()[1] + _bert_memory_needs()[0]) / 2 / 1e9)])


@pytest.mark.cases("memory-limit")
def test_planned_model_under_a_memory_limit_trains_exactly(launches: CaseLaunches) -> None:
    """No layout forced: a memory limit below what one stage needs makes the planner split the
    model, and the planned pipeline matches the unwrapped model."""
    one_stage, least = _bert_memory_needs()
    assert least < one_stage
    res = launches.result("memory-limit")
    assert len(re.findall(r"PASS bert rank", res.stdout)) == 4, res.stdout
    stages = int(re.search(r"STAGES (\d+)", res.stdout).group(1))  # type: ignore[union-attr]
    assert stages >= 2, res.stdout


# (last of its ranks' cases: its first call raises, after which the ranks run no more cases)
_case("memory-limit-error", 2, lambda d: [
    "--model", "bert", "--microbatches", "0", "--batch", "8", "--mem-limit-gb",
    repr(_bert_memory_needs()[1] / 4 / 1e9), "--expect-error", "per device"])


@pytest.mark.cases("memory-limit-error")
def test_memory_limit_too_small_for_any_plan_is_a_clear_error(launches: CaseLaunches) -> None:
    res = launches.result("memory-limit-error")
    errors = re.findall(r"PASS rank \d+ error: (.*)", res.stdout)
    assert len(errors) == 2, res.stdout
    assert "needs at least" in errors[0] and "mem_limit_gb" in errors[0], errors[0]


_case("boundaries", 3, lambda d: [
    "--model", "bert", "--partition-num", "3", "--microbatches", "2", "--batch", "6", "--schedule",
    "1f1b", "--cluster-file", _cluster_file(d / "boundaries.json", 3, [FAST] * 3)], {"RANNC_BLOCKS": "4"})


@pytest.mark.cases("boundaries")
def test_stage_boundaries_inside_blocks_train_exactly(tmp_path: Path, launches: CaseLaunches) -> None:
    """k = 4 blocks for 3 stages: the planner's boundary refinement cuts inside blocks (checked
    here against the whole-block plan, on the cluster file the ranks plan for), and those
    stages train exactly like the unwrapped model."""
    from model_zoo import make_case

    import rannc

    path = Path(_cluster_file(tmp_path / "cluster.json", 3, [FAST] * 3))
    cfg = {"blocks": 4, "partition_num": 3, "microbatches": 2, "schedule": "1f1b"}
    case = make_case("bert", batch=6, seed=0)
    cluster = rannc.Cluster.load(path)
    ranges = {}
    for refine in (False, True):
        plan = rannc.plan(case.model, case.args, case.kwargs, cluster=cluster, config=rannc.Config(
            **cfg, extra={"boundary_refinement": refine}))
        ranges[refine] = [f"{st.components[0]}-{st.components[-1]}" for st in plan.stages]
    assert ranges[True] != ranges[False], ranges
    res = launches.result("boundaries")
    assert sorted(re.findall(r"PASS bert rank (\d+)", res.stdout)) == ["0", "1", "2"], res.stdout
    printed = re.findall(r"^\s+\d+\s+(\d+-\d+)\s", res.stdout, flags=re.MULTILINE)
    assert printed == ranges[True], res.stdout


def test_new_input_signatures_make_no_new_process_groups() -> None:
    """Each sequence length (train and eval) is a new capture and runtime; they share the
    process groups (the default one and one for the gradients), where each used to make its
    own."""
    res = run_mpi(TESTS / "scripts" / "groups_check.py", 2, [])
    got = re.findall(r"PASS groups rank (\d+) one-stage (\d+) two-stage (\d+)", res.stdout)
    assert sorted(got) == [("0", "2", "2"), ("1", "2", "2")], res.stdout
