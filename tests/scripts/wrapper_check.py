"""RaNNCModule as a transparent wrapper on several ranks (mpiexec or torchrun).

    mpiexec -n 2 python tests/scripts/wrapper_check.py

Checks, on every rank: a DistributedSampler built right after wrapping (the process group
starts at construction); the wrapped Hugging Face model's `config` through the wrapper; after a
2-stage deployment, a parent module sees the parameters this rank holds (and 0-element
placeholders for the others), and the loss is
the unwrapped model's on the global batch. Prints "PASS wrapper rank R".
With --compile: compile=True on 2 stages of an MLP, exact against the unwrapped model, and
rannc's stage actions in a torch.profiler trace. Prints "PASS compile rank R".
"""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DistributedSampler

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]
from model_zoo import make_case  # noqa: E402

import rannc  # noqa: E402


def check_compiled_stages_and_profiler(rank: int, world: int) -> None:
    """compile=True on 2 stages: each rank's stage graph runs torch.compile'd, and 2 SGD steps
    equal the unwrapped model's on the global batch; torch.profiler shows rannc's stage actions."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(model, opt, partition_num=2, compile=True, timeout_s=120)
    x = torch.randn(4 * world, 8)
    mine = x[4 * rank:4 * rank + 4]
    for step in range(2):
        with profile(activities=[ProfilerActivity.CPU]) if step == 1 else contextlib.nullcontext() as prof:
            out = wrapped(mine)
            out.square().mean().backward()
        ref_out = ref(x)
        ref_out.square().mean().backward()
        torch.testing.assert_close(out, ref_out[4 * rank:4 * rank + 4], rtol=1e-5, atol=1e-6)
        held = dict(wrapped.named_parameters())
        for n, q in ref.named_parameters():
            if n in held:
                torch.testing.assert_close(held[n].grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    (rt,) = wrapped._runtimes.values()
    parts = [p.module for p in (rt.rec_part, rt.keep_part) if p is not None]
    assert parts and all(type(m).__name__ == "OptimizedModule" for m in parts), parts
    names = {e.name for e in prof.events()}
    assert any(n.startswith(f"rannc F{rank}.") for n in names), sorted(names)[:20]
    assert any(n.startswith(f"rannc B{rank}.") for n in names), sorted(names)[:20]
    print(f"PASS compile rank {rank}", flush=True)


def main() -> None:
    if "--compile" in sys.argv:
        check_compiled_stages_and_profiler(rannc.get_rank(), rannc.get_world_size())
        return
    torch.manual_seed(0)
    case = make_case("gpt2", batch=4)
    ref = copy.deepcopy(case.model)
    opt = torch.optim.SGD(case.model.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(case.model, opt, partition_num=2, timeout_s=60)
    sampler = DistributedSampler(list(range(8)), shuffle=False)  # no process group: raised here
    rank, world = rannc.get_rank(), rannc.get_world_size()
    assert (sampler.rank, sampler.num_replicas) == (rank, world), (sampler.rank, sampler.num_replicas)
    assert list(sampler) == list(range(rank, 8, world))
    assert wrapped.config.use_cache is False  # the HF config, not rannc's

    parent = nn.ModuleDict({"net": wrapped})
    total = len(list(ref.parameters()))
    assert len(list(parent.parameters())) == total  # before deployment: every parameter
    ids = case.kwargs["input_ids"]
    rows = slice(rank * 2, rank * 2 + 2)
    out = wrapped(input_ids=ids[rows], labels=ids[rows])
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-6)
    held = {id(p) for p in wrapped.parameters()}
    assert 0 < len(held) < total, (len(held), total)  # the wrapper itself: the held ones
    # A parent recursing into the wrapped model sees every parameter; those this rank does not
    # hold are 0-element placeholders (the held ones have their gradients).
    seen = list(parent.parameters())
    assert len(seen) == total
    assert {id(p) for p in seen if p.numel()} == held
    assert all(p.grad is not None for p in seen if p.numel() and p.requires_grad)
    print(f"PASS wrapper rank {rank}", flush=True)


if __name__ == "__main__":
    main()
