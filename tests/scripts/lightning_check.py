"""Lightning holding a RaNNCModule, on 2 ranks (torchrun or mpiexec), with
`rannc.lightning.RaNNCStrategy`: README's recipe.

    torchrun --nproc-per-node 2 tests/scripts/lightning_check.py DIR

A LightningModule holds the RaNNCModule (2 stages) and returns rannc's optimizer (SGD with
momentum and weight decay); Lightning puts its own DistributedSampler in the loader and
accumulates 2 micro-batches a step under the RaNNCModule's no_sync(). After an epoch (4 steps) each rank's
held parameters equal those of the unwrapped model trained on the global batches; the
checkpoint Lightning's default callback saved (rank 0 alone writes it) holds the whole model
under the unwrapped LightningModule's names and the whole optimizer in torch's layout, equal
to the unwrapped ones; `validate` logs the unwrapped model's loss on every rank; and a new
model resumed from that checkpoint (`fit(ckpt_path=...)`) trains its second epoch exactly;
`test` and `predict` give the unwrapped model's loss and outputs. Prints "PASS lightning rank R".

    torchrun --nproc-per-node 2 tests/scripts/lightning_check.py DIR gan

Lightning's GAN recipe: manual optimization (`automatic_optimization = False`,
`manual_backward`), two optimizers (Adam for the generator, SGD with momentum for the
discriminator), `toggle_optimizer` (which sets requires_grad False on the other model's
parameters for a step), the generator and the discriminator each a RaNNCModule of 2 stages and
composed (`D(G(z))`); the discriminator's real and fake batches go in one call, as rannc's error
for two calls before one backward says. An epoch (4 steps of each) exact against the unwrapped
pair. Prints "PASS gan rank R".
"""

from __future__ import annotations

import copy
import glob
import io
import os
import sys
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

import rannc
from rannc.lightning import RaNNCStrategy


class Lit(L.LightningModule):
    def __init__(self, net: nn.Module, opt: torch.optim.Optimizer) -> None:
        super().__init__()
        self.net, self.opt = net, opt

    def training_step(self, batch: torch.Tensor, i: int) -> torch.Tensor:
        loss = self.net(batch).square().mean()  # this rank's rows: DDP's gradient semantics
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: torch.Tensor, i: int) -> None:
        self.log("val_loss", self.net(batch).square().mean(), sync_dist=True)

    def test_step(self, batch: torch.Tensor, i: int) -> None:
        self.log("test_loss", self.net(batch).square().mean(), sync_dist=True)

    def predict_step(self, batch: torch.Tensor, i: int) -> torch.Tensor:
        return self.net(batch)

    def configure_optimizers(self) -> Any:
        return self.opt


class GAN(L.LightningModule):
    def __init__(self, g: nn.Module, d: nn.Module, opt_g: torch.optim.Optimizer,
                 opt_d: torch.optim.Optimizer) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.g, self.d, self.opt_g, self.opt_d = g, d, opt_g, opt_d

    def training_step(self, batch: list[torch.Tensor], i: int) -> None:
        real, z = batch
        n = len(z)
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.d(self.g(z)), torch.ones(n, 1))
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        out = self.d(torch.cat([real, self.g(z).detach()]))
        d_loss = (F.binary_cross_entropy_with_logits(out[:n], torch.ones(n, 1))
                  + F.binary_cross_entropy_with_logits(out[n:], torch.zeros(n, 1))) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return [self.opt_g, self.opt_d]


def gan_pair() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8))
    d = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    return (g, d, torch.optim.Adam(g.parameters(), lr=0.01),
            torch.optim.SGD(d.parameters(), lr=0.1, momentum=0.9))


def shuffled_parts(data: Any, world: int, epoch: int) -> list[list[int]]:
    """Each rank's indices from Lightning's DistributedSampler (shuffled: seed 0, then the epoch)."""
    parts = []
    for r in range(world):
        sampler = torch.utils.data.DistributedSampler(data, world, r, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        parts.append(list(sampler))
    return parts


def gan(root: str) -> None:
    g, d, opt_g, opt_d = gan_pair()
    ref_g, ref_d, ref_opt_g, ref_opt_d = gan_pair()
    rank, world = rannc.get_rank(), rannc.get_world_size()
    gen = torch.Generator().manual_seed(1)
    real, z = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
    data = list(zip(real, z, strict=True))
    lit = GAN(rannc.RaNNCModule(g, opt_g, partition_num=2, timeout_s=60),
              rannc.RaNNCModule(d, opt_d, partition_num=2, timeout_s=60), opt_g, opt_d)
    fit = L.Trainer(strategy=RaNNCStrategy(), accelerator="cpu", devices=world, max_epochs=1,
                    logger=False, enable_progress_bar=False, enable_model_summary=False,
                    default_root_dir=root)
    fit.fit(lit, torch.utils.data.DataLoader(data, batch_size=2))
    assert fit.global_step == 8, fit.global_step  # (each optimizer's steps count)

    def only(trained: nn.Module, frozen: nn.Module) -> None:
        for p in trained.parameters():
            p.requires_grad_(True)
        for p in frozen.parameters():
            p.requires_grad_(False)

    bce = F.binary_cross_entropy_with_logits
    parts = shuffled_parts(data, world, 0)
    for step in range(4):
        # each rank back-propagates its rows' mean: the gradient is the average over the ranks
        rows = [p[2 * step:2 * step + 2] for p in parts]
        only(ref_g, ref_d)
        sum(bce(ref_d(ref_g(z[r])), torch.ones(2, 1)) / world for r in rows).backward()
        ref_opt_g.step()
        ref_opt_g.zero_grad()
        only(ref_d, ref_g)
        sum((bce(ref_d(real[r]), torch.ones(2, 1)) + bce(ref_d(ref_g(z[r])), torch.zeros(2, 1)))
            / (2 * world) for r in rows).backward()
        ref_opt_d.step()
        ref_opt_d.zero_grad()
    for name, mine, ref in (("g", lit.g, ref_g), ("d", lit.d, ref_d)):
        held = dict(mine.named_parameters())
        assert held
        for n, q in ref.named_parameters():
            if n in held:
                close(held[n], q, f"rank {rank} {name}.{n}")
    print(f"PASS gan rank {rank}", flush=True)


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def trainer(root: str, epochs: int, **kw: Any) -> L.Trainer:
    return L.Trainer(strategy=RaNNCStrategy(), accelerator="cpu", devices=rannc.get_world_size(),
                     max_epochs=epochs, accumulate_grad_batches=2, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                     **kw)


def close(got: Any, want: Any, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def main() -> None:
    root = sys.argv[1]
    model, opt = build(0)
    ref, ref_opt = copy.deepcopy(model), None
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    net = rannc.RaNNCModule(model, opt, partition_num=2, timeout_s=60)
    rank, world = rannc.get_rank(), rannc.get_world_size()
    data = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))  # (alike on every rank)
    loader = torch.utils.data.DataLoader(data, batch_size=2)  # Lightning's sampler goes in
    first = trainer(root, 1, limit_val_batches=0)
    lit = Lit(net, opt)
    first.fit(lit, loader)  # (one epoch: 8 micro-batches of 2 rows a rank, 4 steps)
    assert first.global_step == 4 and first.global_rank == rank and first.world_size == world

    def ref_epoch(epoch: int) -> None:
        parts = shuffled_parts(data, world, epoch)
        for step in range(4):
            for micro in (2 * step, 2 * step + 1):
                rows = torch.cat([data[p[2 * micro:2 * micro + 2]] for p in parts])
                (ref(rows).square().mean() / 2).backward()
            ref_opt.step()
            ref_opt.zero_grad()

    ref_epoch(0)
    held = dict(net.named_parameters())
    assert held and len(held) < len(dict(ref.named_parameters()))
    for n, q in ref.named_parameters():
        if n in held:
            close(held[n], q, f"rank {rank} step 4 {n}")
    (path,) = glob.glob(os.path.join(root, "checkpoints", "*.ckpt"))  # the default callback's
    saved = torch.load(path, weights_only=False)
    want = {f"net.{k}": v for k, v in ref.state_dict().items()}
    assert sorted(saved["state_dict"]) == sorted(want), sorted(saved["state_dict"])
    for k, v in want.items():
        close(saved["state_dict"][k], v, f"checkpoint {k}")
    ref_osd = ref_opt.state_dict()
    (osd,) = saved["optimizer_states"]
    assert osd["param_groups"][0]["params"] == ref_osd["param_groups"][0]["params"]
    for i, st in ref_osd["state"].items():
        close(osd["state"][i]["momentum_buffer"], st["momentum_buffer"], f"checkpoint momentum {i}")
    # loads into the LightningModule around the unwrapped model (strict)
    Lit(copy.deepcopy(ref), ref_opt).load_state_dict(saved["state_dict"])
    # the LightningModule's own state_dict() (every rank) is the whole model on rank 0; on the
    # others saving or loading it is refused (a part of the model saved to rank 0's path)
    sd = lit.state_dict()
    if rank == 0:
        assert sorted(sd) == sorted(want), sorted(sd)
    else:
        for doing, act in (("pickling", lambda: torch.save(sd, io.BytesIO())),
                           ("loading", lambda: lit.load_state_dict(sd))):
            try:
                act()
                raise AssertionError(f"{doing} rank {rank}'s part of the model was not refused")
            except rannc.RaNNCError as e:
                assert "save on rank 0 alone" in str(e), str(e)

    val = torch.utils.data.DataLoader(data[:16], batch_size=2)
    (metrics,) = trainer(root, 1).validate(lit, val, verbose=False)
    (tested,) = trainer(root, 1).test(lit, val, verbose=False)
    preds = trainer(root, 1).predict(lit, val)
    with torch.no_grad():
        close(torch.tensor(metrics["val_loss"]), ref(data[:16]).square().mean(), "validate")
        close(torch.tensor(tested["test_loss"]), ref(data[:16]).square().mean(), "test")
        # predict's sampler does not shuffle: rank r has rows r, r + world, ...
        mine = list(range(rank, 16, world))
        close(torch.cat(preds), ref(data[:16][mine]), f"rank {rank} predict")

    model2, opt2 = build(7)  # other weights and no momentum: the checkpoint must replace them
    lit2 = Lit(rannc.RaNNCModule(model2, opt2, partition_num=2, timeout_s=60), opt2)
    second = trainer(root, 2, limit_val_batches=0)
    second.fit(lit2, loader, ckpt_path=path)
    assert second.global_step == 8
    ref_epoch(1)
    held = dict(lit2.net.named_parameters())
    for n, q in ref.named_parameters():
        if n in held:
            close(held[n], q, f"rank {rank} resumed, step 8 {n}")
    print(f"PASS lightning rank {rank}", flush=True)


if __name__ == "__main__":
    if sys.argv[2:] == ["gan"]:
        gan(sys.argv[1])
    else:
        main()
