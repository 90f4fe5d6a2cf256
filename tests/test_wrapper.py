"""RaNNCModule is a transparent wrapper, like DDP and FSDP: the wrapped model's attributes are
reachable through it, rannc's settings do not hide them, and a parent module sees its parameters.

(Multi-rank: tests/scripts/wrapper_check.py, run by test_wrapper_mpi below.)
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from model_zoo import make_case
from mpi_harness import run_mpi, run_torchrun
from torch import nn

import rannc

pytestmark = pytest.mark.layer("single_process")

SCRIPT = Path(__file__).resolve().parent / "scripts" / "wrapper_check.py"


def test_hugging_face_attributes_reach_through() -> None:
    case = make_case("gpt2")
    wrapped = rannc.RaNNCModule(case.model)
    # Trainer reads these: `config.use_cache` failed while RaNNCModule.config was rannc's Config.
    assert wrapped.config is case.model.config
    assert wrapped.config.use_cache is False
    assert wrapped.generation_config is case.model.generation_config
    assert wrapped.can_generate() == case.model.can_generate()
    assert isinstance(wrapped.rannc_config, rannc.Config)
    assert wrapped.module is case.model


def test_user_attribute_and_missing_attribute() -> None:
    model = nn.Linear(3, 2)
    model.my_flag = 7  # type: ignore[assignment]
    wrapped = rannc.RaNNCModule(model, timeout_s=12.0)
    assert wrapped.my_flag == 7
    assert wrapped.weight is model.weight
    assert wrapped.rannc_config.timeout_s == 12.0
    with pytest.raises(AttributeError, match="no_such_thing"):
        _ = wrapped.no_such_thing


def test_parent_sees_parameters_under_original_names() -> None:
    case = make_case("bert")
    ref = copy.deepcopy(case.model)
    parent = nn.ModuleDict({"net": rannc.RaNNCModule(case.model)})
    names = [n for n, _ in parent.named_parameters()]
    assert names and all(n.startswith("net.") for n in names)
    assert len(list(parent.parameters())) == len(list(ref.parameters()))
    # The wrapper's own names stay the original ones (no "module." prefix).
    assert [n for n, _ in parent["net"].named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(parent["net"].state_dict()) == list(ref.state_dict())
    assert all(k.startswith("net.") and not k.startswith("net.module.") for k in parent.state_dict())
    out = parent["net"](*case.args, **case.kwargs)  # still runs
    torch.testing.assert_close(out.loss, ref(*case.args, **case.kwargs).loss, rtol=1e-6, atol=1e-7)
    # After the first call too (one process: every parameter is held).
    assert len(list(parent.parameters())) == len(list(ref.parameters()))


def test_one_process_has_a_plan_too() -> None:
    """model.plan after the first call in one process, as on several ranks: one stage holding every
    parameter, every atomic component, one microbatch, rank 0; printable and saved as any plan."""
    case = make_case("gpt2")
    model = rannc.RaNNCModule(case.model)
    assert model.plan is None
    model(*case.args, **case.kwargs)
    plan = model.plan
    assert plan is not None and len(plan.stages) == 1 and plan.world_size == 1
    (st,) = plan.stages
    assert st.ranks == (0,) and plan.microbatches == 1 and st.recompute == 0.0
    params = dict(case.model.named_parameters(remove_duplicate=False))  # tied: wte and lm_head
    assert {id(params[n]) for n in st.param_names} == {id(p) for p in case.model.parameters()}
    assert st.components == tuple(range(len(st.components)))
    assert "1 stage(s), 1 microbatch(es)" in plan.summary()
    assert rannc.Plan.from_dict(plan.to_dict()) == plan


def test_the_first_call_under_no_sync_plans_for_an_accumulation() -> None:
    """grad_accumulation "auto" plans for an accumulation when the first call (the one that
    plans) is an accumulation's first micro-step, under no_sync(); "on" and "off" as set."""
    m = rannc.RaNNCModule(nn.Linear(4, 4))
    assert m._planning_config().grad_accumulation == "off"
    with m.no_sync():
        assert m._planning_config().grad_accumulation == "on"
    for fixed in ("on", "off"):
        f = rannc.RaNNCModule(nn.Linear(4, 4), grad_accumulation=fixed)
        with f.no_sync():
            assert f._planning_config().grad_accumulation == fixed
        assert f._planning_config().grad_accumulation == fixed


def test_the_wrapped_model_s_own_mode_is_the_call_s_mode() -> None:
    """`model.module.eval()` (a script switching the model it unwrapped, as DDP allows) runs
    the eval graph (BatchNorm on its running statistics), and `.train()` on it the training
    one; before, the wrapper's stale flag kept the capture of the mode it was wrapped in."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    ref = copy.deepcopy(net)
    wrapped = rannc.RaNNCModule(net)
    x = torch.randn(6, 4)
    for mode in (True, False, True, False):
        net.train(mode)
        ref.train(mode)
        torch.testing.assert_close(wrapped(x), ref(x), rtol=0, atol=0)
        assert wrapped.training is mode
    assert len(wrapped._deployments) == 2


def test_a_copy_in_one_process_trains_on_its_own_and_pickling_names_the_fix() -> None:
    """`copy.deepcopy(model)` in one process (timm's ModelEma around the wrapped model) is a
    second wrapped model with its own parameters and optimizer: training it leaves the first
    untouched, also through a new capture. `torch.save(model)` raises by name with the fix
    (before: torch's "cannot pickle 'weakref.ReferenceType' object")."""
    import io

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    wrapped = rannc.RaNNCModule(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.randn(5, 4)
    wrapped(x).sum().backward()
    twin = copy.deepcopy(wrapped)
    assert twin.optimizer is not wrapped.optimizer
    before = [p.detach().clone() for p in wrapped.parameters()]
    wrapped.zero_grad()
    for batch in (x, torch.randn(3, 4)):  # the second a new input signature: captured anew
        twin.optimizer.zero_grad()
        twin(batch).sum().backward()
        twin.optimizer.step()
    assert all(p.grad is None for p in wrapped.parameters())
    for p, b in zip(wrapped.parameters(), before, strict=True):
        torch.testing.assert_close(p, b, rtol=0, atol=0)
    assert any(not torch.equal(p, b) for p, b in zip(twin.parameters(), before, strict=True))
    with pytest.raises(rannc.RaNNCError, match=r"pickling a RaNNCModule .* Fix: save its state"):
        torch.save(wrapped, io.BytesIO())


def test_plain_python_starts_no_process_group() -> None:
    import torch.distributed as dist

    from rannc import dist as rdist

    rdist.shutdown()  # a group an earlier single-process test started (a checkpoint save)
    assert not dist.is_initialized()
    rannc.RaNNCModule(nn.Linear(2, 2))
    assert not dist.is_initialized()
    assert rannc.init() is None  # nothing to do with one rank and no timeout asked for


@pytest.mark.layer("multi_rank")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["mpi", "torchrun"])
def test_wrapper_mpi(launcher: str) -> None:
    """On 2 ranks: DistributedSampler right after wrapping, HF attributes, and a parent seeing the
    parameters this rank holds after deployment."""
    run = run_mpi if launcher == "mpi" else run_torchrun
    res = run(SCRIPT, 2, [], timeout=240)
    assert res.stdout.count("PASS wrapper") == 2, res.stdout + res.stderr


@pytest.mark.layer("multi_rank")
@pytest.mark.timeout(400)
def test_compiled_stages_profiler_ranges_and_plan_table_mpi() -> None:
    """compile=True on 2 ranks equals the unwrapped model; stage actions show in torch.profiler;
    the plan table is printed once (rank 0) without any logging set up."""
    res = run_mpi(SCRIPT, 2, ["--compile"], timeout=360)
    assert res.stdout.count("PASS compile") == 2, res.stdout + res.stderr
    assert res.stderr.count("rannc plan: 2 stage(s)") == 1, res.stderr


def test_a_parent_module_saves_and_loads_through_the_wrapper() -> None:
    """A module holding a RaNNCModule (a LightningModule) gets its entries under the unwrapped
    names (`net.0.weight`, not `net.module.0.weight`) and loads them back with its own
    load_state_dict, strict: before, torch looked for them under `net.module.` and called
    them missing and the given ones unexpected. A missing entry is named with the parent's
    prefix, as torch names it. (On several ranks: tests/scripts/lightning_check.py.)"""

    class Parent(nn.Module):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net, self.head = net, nn.Linear(1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.net(x))

    torch.manual_seed(0)
    plain = Parent(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    wrapped = Parent(rannc.RaNNCModule(copy.deepcopy(plain.net)))
    wrapped(torch.randn(3, 4)).sum().backward()  # (deployed in one process)
    assert sorted(wrapped.state_dict()) == sorted(plain.state_dict())
    torch.manual_seed(1)
    new = {k: torch.randn_like(v) for k, v in plain.state_dict().items()}
    assert not wrapped.load_state_dict(new).missing_keys
    for k, v in wrapped.state_dict().items():
        torch.testing.assert_close(v, new[k], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "net.0.bias"'):
        wrapped.load_state_dict({k: v for k, v in new.items() if k != "net.0.bias"})
    got = wrapped.load_state_dict({**new, "net.9.weight": torch.ones(1)}, strict=False)
    assert got.unexpected_keys == ["net.9.weight"] and not got.missing_keys
