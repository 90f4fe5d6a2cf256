"""The rest of a training loop against the unwrapped model on the global batch: gradient
clipping by the global norm (2-norm and inf-norm, through model.clip_grad_norm_ and through
torch.nn.utils.clip_grad_norm_(model.parameters())), gradient accumulation under no_sync(),
and torch optimizers with LR schedulers (rtol 1e-5); plus the optimizer state factor the
planner's memory model reads."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from model_zoo import make_case
from mpi_harness import TESTS, Case, CaseLaunches, case_launches_fixture, case_of

import rannc
from rannc.module import optimizer_state_factor
from rannc.schedule import get_spec

# (timeout: the first test of a rank count waits for its whole launch)
pytestmark = [pytest.mark.layer("multi_rank"), pytest.mark.timeout(3600)]

SCRIPT = TESTS / "scripts" / "train_ops_check.py"
# The cases that need the same ranks run in one launch (tests/mpi_harness.py's CaseLaunches).
CASES: dict[str, Case] = {}  # filled below, next to the tests that read them
launches = case_launches_fixture(SCRIPT, CASES)


def _case(case_id: str, n: int, args: list[str], env: dict[str, str] | None = None) -> str:
    CASES[case_id] = Case(n, args, env or {})
    return case_id

# (ranks, arguments, models): BERT on 4 stages, so its tied word embedding lives on ranks 0 and
# 3, with the default schedule and under zero-bubble; 2 stages x 2 replicas under fill-drain; the
# whole 2-stage pipeline replicated (R = 2) under 1F1B.
LAYOUTS = [
    (4, ["--partition-num", "4"], "bert"),
    (4, ["--replicas", "2,2", "--schedule", "gpipe"], "bert"),
    (4, ["--replicas", "1,1", "--schedule", "1f1b"], "gpt2"),
    # zero-bubble on 4 stages: the tied embedding's weight passes on ranks 0 and 3
    (4, ["--partition-num", "4", "--schedule", "zero_bubble"], "bert"),
    # interleaved: 4 stages on 2 ranks, the tied embedding in stages 0 (rank 0) and 3 (rank 1)
    (2, ["--partition-num", "4", "--schedule", "interleaved_1f1b"], "bert"),
    # ZB-V: 4 stages on 2 ranks in a V, the tied embedding's stages 0 and 3 both on rank 0
    (2, ["--partition-num", "4", "--schedule", "zero_bubble_v"], "bert"),
    # data parallelism alone (one stage x 2), its backward inside forward(): the ranks do not
    # meet after the buckets when every replica computed rows, also after no_sync() calls
    (2, ["--replicas", "2", "--schedule", "1f1b"], "bert,gpt2"),
]


@pytest.mark.parametrize(("n", "args", "models"), [
    pytest.param(n, a, m, id=i, marks=pytest.mark.cases(_case(
        f"layout-{i}", n, ["--model", m, "--microbatches", "2", "--batch", "8", *a])))
    for n, a, m in LAYOUTS for i in [f"{n}r-{'_'.join(x.lstrip('-') for x in a)}-{m}"]])
def test_clip_accumulate_and_optimizers_equal_the_unwrapped_model(
        n: int, args: list[str], models: str, launches: CaseLaunches,
        request: pytest.FixtureRequest) -> None:
    res = launches.result(case_of(request))
    for model in models.split(","):
        got = sorted(re.findall(rf"PASS {model} rank (\d+)", res.stdout))
        assert got == [str(r) for r in range(n)], (model, res.stdout)
    if "--schedule" in args:
        assert f"SCHEDULE {args[args.index('--schedule') + 1]}" in res.stdout, res.stdout
    # The accumulation's second call starts an eager line with gradients held, which a plan not
    # made under no_sync() did not count: rank 0 warns once per wrapped model (none under
    # fill-drain, whose backward runs in backward())
    eager = sum(get_spec(s).eager for s in re.findall(r"SCHEDULE (\S+)", res.stdout))
    warned = (res.stdout + res.stderr).count("forward() started while .grad held gradients")
    assert warned == eager, (warned, eager, res.stderr[-3000:])


@pytest.mark.cases(_case("buckets", 4, ["--model", "bert", "--microbatches", "2", "--batch", "8",
                                         "--replicas", "2,2", "--schedule", "gpipe"],
                         {"RANNC_BUCKET_MB": "0.001"}))
def test_accumulation_and_clipping_with_small_gradient_buckets(launches: CaseLaunches) -> None:
    """no_sync's pending local sums and the tied word embedding (stages 0 and 1, all four
    ranks) reduced in buckets of about 1 KB that start during the last backward."""
    res = launches.result("buckets")
    got = sorted(re.findall(r"PASS bert rank (\d+)", res.stdout))
    assert got == ["0", "1", "2", "3"], res.stdout


@pytest.mark.parametrize(("args", "model"), [
    pytest.param(a, m, id=i, marks=pytest.mark.cases(_case(
        f"zero-{i}", 4, ["--model", m, "--microbatches", "2", "--batch", "8", *a],
        {"RANNC_ZERO_STAGE": "1"})))
    for a, m, i in [(["--replicas", "2,2", "--schedule", "gpipe"], "bert", "2x2-gpipe-bert"),
                    (["--replicas", "1,1", "--schedule", "1f1b"], "gpt2", "1x1x2-1f1b-gpt2")]])
def test_zero_1_clip_accumulate_and_optimizers(args: list[str], model: str, launches: CaseLaunches,
                                               request: pytest.FixtureRequest) -> None:
    """Under ZeRO-1 each holder steps only its share of the parameters: clipping (the norm
    counted at each parameter's owner), no_sync accumulation, and the torch optimizers with
    their schedulers (each with its own state shape) still equal the unwrapped model."""
    res = launches.result(case_of(request))
    got = sorted(re.findall(rf"PASS {model} rank (\d+)", res.stdout))
    assert got == ["0", "1", "2", "3"], res.stdout


@pytest.mark.layer("single_process")
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_in_one_process_is_torchs(norm_type: float) -> None:
    case = make_case("fork_join", batch=4)
    ref = copy.deepcopy(case.model)
    model = rannc.RaNNCModule(case.model)
    case.loss(model(*case.args)).backward()
    case.loss(ref(*case.args)).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type)
    got = model.clip_grad_norm_(0.01, norm_type)
    assert want > 0.01
    torch.testing.assert_close(got, want)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    # Not deployed on several ranks: torch.nn.utils.clip_grad_norm_ is torch's own.
    again = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, norm_type)
    torch.testing.assert_close(again, torch.nn.utils.get_total_norm(
        [q.grad for q in ref.parameters()], norm_type))


@pytest.mark.layer("pure")
def test_optimizer_state_factor_counts_torchs_state() -> None:
    """The factor equals the per-element state torch keeps after a step."""
    def measured(opt: torch.optim.Optimizer, lin: torch.nn.Linear) -> float:
        lin(torch.randn(3, 16)).pow(2).sum().backward()
        opt.step()
        n = sum(p.numel() for p in lin.parameters())
        kept = sum(v.numel() for st in opt.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)
        return kept / n

    makers = [
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.Adam(ps),
        lambda ps: torch.optim.Adam(ps, amsgrad=True),
        lambda ps: torch.optim.AdamW(ps),
        lambda ps: torch.optim.AdamW(ps, amsgrad=True),
        lambda ps: torch.optim.Adagrad(ps),
        lambda ps: torch.optim.RMSprop(ps, momentum=0.9, centered=True),
        lambda ps: torch.optim.NAdam(ps),
        lambda ps: torch.optim.Rprop(ps),
        lambda ps: torch.optim.Adadelta(ps),
    ]
    for make in makers:
        lin = torch.nn.Linear(16, 16)
        opt = make(lin.parameters())
        assert optimizer_state_factor(opt) == measured(opt, lin), opt
