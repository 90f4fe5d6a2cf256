"""Lightning holding a RaNNCModule, on 2 ranks (torchrun or mpiexec): README's recipe.

    torchrun --nproc-per-node 2 tests/scripts/lightning_check.py

A LightningModule holds the RaNNCModule (2 stages) and returns rannc's optimizer; Lightning runs
with SingleDeviceStrategy (rannc does the distribution; Lightning's DDP would all-reduce again)
and the user's DistributedSampler. After 4 SGD steps each rank's held parameters equal those of
the unwrapped model trained on the global batches. Prints "PASS lightning rank R".
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn

import rannc


class Lit(L.LightningModule):
    def __init__(self, net: rannc.RaNNCModule, opt: torch.optim.Optimizer) -> None:
        super().__init__()
        self.net, self.opt = net, opt

    def training_step(self, batch: torch.Tensor, i: int) -> torch.Tensor:
        return self.net(batch).square().mean()  # this rank's rows: DDP's gradient semantics

    def configure_optimizers(self) -> Any:
        return self.opt


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net = rannc.RaNNCModule(model, opt, partition_num=2, timeout_s=60)
    rank, world = rannc.get_rank(), rannc.get_world_size()
    data = torch.randn(16, 8)
    sampler = torch.utils.data.DistributedSampler(data, shuffle=False)  # right after wrapping
    loader = torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler)
    trainer = L.Trainer(strategy=SingleDeviceStrategy("cpu"), use_distributed_sampler=False,
                        max_steps=4, enable_checkpointing=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Lit(net, opt), loader)
    assert trainer.global_step == 4

    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        # Step s: rank r had rows r, r + world, ... of sampler's stride, two of them.
        rows = torch.cat([data[torch.arange(r, 16, world)][2 * step:2 * step + 2] for r in range(world)])
        ref(rows).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    held = dict(net.named_parameters())
    assert held and len(held) < len(dict(ref.named_parameters()))
    for n, q in ref.named_parameters():
        if n in held:
            torch.testing.assert_close(held[n], q, rtol=1e-5, atol=1e-6, msg=n)
    print(f"PASS lightning rank {rank}", flush=True)


if __name__ == "__main__":
    main()
