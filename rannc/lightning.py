"""Lightning's strategy for a LightningModule holding a RaNNCModule: `rannc.lightning.RaNNCStrategy`
(imports lightning).

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = rannc.RaNNCModule(model, opt)     # opt: the one configure_optimizers returns
        ...
    trainer = L.Trainer(strategy=rannc.lightning.RaNNCStrategy(), devices=N, ...)
    trainer.fit(lit, loader)            # torchrun --nproc-per-node N, or mpiexec -n N
    trainer.fit(lit, loader, ckpt_path="last")

Why a strategy: Lightning's DDP strategy wraps the LightningModule in DistributedDataParallel,
which would all-reduce gradients rannc has already reduced (and refuses parameters that differ
between ranks, as a pipeline's do), while the single-device strategy makes every rank believe it
is rank 0: each saves its own checkpoint to the same path and logs as rank 0. This one is
Lightning's DDP strategy without the DistributedDataParallel: Lightning knows the ranks (its
`DistributedSampler`, rank-zero logging, `sync_dist`), and its checkpoints work as DDP's do.
Every rank joins the checkpoint's gathering (a RaNNCModule's `state_dict()` and the optimizer's
`state_dict()` are collectives that gather the whole model and optimizer onto rank 0, under the
unwrapped names and layout), rank 0 writes the file, and every rank loads it back (each rank
taking the entries it holds, through `RaNNCModule._load_from_state_dict`). So a rannc
checkpoint loads into the LightningModule around the unwrapped model too, and back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from unittest import mock

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies import ddp as lightning_ddp
from lightning.pytorch.trainer.states import TrainerFn

from rannc.module import RaNNCModule


class RaNNCStrategy(DDPStrategy):
    """Lightning's DDP strategy for a LightningModule whose model is (or holds) a RaNNCModule:
    rannc distributes the model, so nothing wraps it in DistributedDataParallel, and nothing
    broadcasts rank 0's parameters before validating, testing or predicting (each rank holds
    its own stages' parameters). Gradient accumulation (`accumulate_grad_batches`) runs its
    micro-steps under the RaNNCModules' `no_sync()`, as DDP's strategy does with DDP's.
    Keyword arguments are DDPStrategy's (`process_group_backend`, `timeout`, ...); those that
    configure DistributedDataParallel itself have nothing to act on."""

    strategy_name = "rannc"

    def configure_ddp(self) -> None:
        """Nothing to wrap: the RaNNCModules inside reduce their own gradients."""

    def setup(self, trainer: pl.Trainer) -> None:
        """DDP's strategy's set-up, but for the broadcast of rank 0's parameters and buffers it
        makes before validating, testing or predicting (here each rank holds other stages,
        which rannc keeps consistent itself)."""
        if trainer.state.fn == TrainerFn.FITTING:
            super().setup(trainer)
            return
        with mock.patch.object(lightning_ddp, "_sync_module_states", lambda module: None):
            super().setup(trainer)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """The micro-steps of an accumulation before its last: every RaNNCModule of the model
        under `no_sync()` (gradients summed locally, reduced once at the last micro-step)."""
        wrapped = [m for m in (self.model.modules() if self.model is not None else ())
                   if isinstance(m, RaNNCModule)]
        with contextlib.ExitStack() as stack:
            for m in wrapped:
                stack.enter_context(m.no_sync())
            yield


__all__ = ["RaNNCStrategy"]
