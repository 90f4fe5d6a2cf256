"""A torchrun elastic restart (tests/test_faults.py): train, checkpoint every step, let one
rank fail once; torchrun's `--max-restarts` starts every worker again, the new attempt resumes
from `rannc.latest_checkpoint()` and finishes. Rank 0 writes the final parameters to --out.

Each attempt prints "ATTEMPT n rank r resumes at step s".
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import rannc
from rannc import dist as rdist


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--marker", required=True, help="exists once the fault was injected")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--fail-step", type=int, default=3)
    a = p.parse_args()

    model, opt = make()
    m = rannc.RaNNCModule(model, opt, timeout_s=20, profiler="estimate", partition_num=2)
    rank = rdist.get_rank()
    start = 0
    if rannc.latest_checkpoint(a.ckpt) is not None:
        start = m.load_checkpoint(a.ckpt, step=-1)["step"] + 1
    print(f"ATTEMPT {os.environ.get('TORCHELASTIC_RESTART_COUNT')} rank {rank} resumes at step "
          f"{start}", flush=True)
    for step in range(start, a.steps):
        x, y = batch(step)
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
        m.save_checkpoint(a.ckpt, step=step)
        if step == a.fail_step and rank == 1 and not os.path.exists(a.marker):
            open(a.marker, "w").close()
            raise RuntimeError(f"injected fault on rank 1 at step {step}")
    state = m.state_dict()
    if rank == 0:
        torch.save(state, a.out)
        print("DONE", flush=True)


if __name__ == "__main__":
    main()
