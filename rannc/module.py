"""RaNNCModule: the one-line facade around an unmodified nn.Module.

Construction is cheap: nothing is captured until the first call, because only
then are example inputs (shapes, dtypes, keyword names) known. The first call
captures the model (torch.export), forms its atomic components and deploys it;
later calls with the same input signature reuse that deployment, and a call
with a new signature (another sequence length, other keyword names, another
mode) captures once more and caches the result.

The wrapper owns no parameters of its own: it runs the captured graph on the
user's parameter and buffer tensors, so the user's optimizer, `state_dict()`
names and BatchNorm statistics keep their meaning.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx as fx
from torch import nn

from rannc.atomic.components import AtomicPartition, atomic_components
from rannc.config import Config
from rannc.graph.capture import CapturedModel, capture, flatten_inputs
from rannc.graph.extract import StageGraph, build_stage_module, run_chain, split_graph

log = logging.getLogger(__name__)


@dataclass
class _Deployment:
    """One captured signature, ready to run."""

    captured: CapturedModel
    atomic: AtomicPartition
    stages: list[StageGraph]
    modules: list[fx.GraphModule]


class RaNNCModule(nn.Module):
    """Wrap `model` (and optionally its optimizer) for automatic hybrid parallelism."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 config: Config | None = None, **options: Any) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"RaNNCModule wraps an nn.Module, got {type(model).__name__}")
        # Not registered as a child: state_dict() and named_parameters() must keep
        # the original names, without a "model." prefix.
        object.__setattr__(self, "_model", model)
        self.optimizer = optimizer
        self.config = Config.resolve(config, **options)
        self.training = model.training
        self._deployments: dict[tuple[Any, ...], _Deployment] = {}
        self._sync = True

    @property
    def module(self) -> nn.Module:
        """The wrapped model (as `DistributedDataParallel.module`)."""
        return cast(nn.Module, self.__dict__["_model"])

    @property
    def plan(self) -> None:
        """The deployment plan after the first call (multi-stage plans come with the runtime)."""
        return None

    # -- running -----------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves, layout = flatten_inputs(args, kwargs)
        key = (layout.signature, self.training)
        dep = self._deployments.get(key)
        if dep is None:
            dep = self._deploy(args, kwargs, first=not self._deployments)
            self._deployments[key] = dep
        values = run_chain(dep.modules, dep.stages, dep.captured.bind(self.module, leaves))
        return dep.captured.unflatten_outputs(values)

    def _deploy(self, args: tuple[Any, ...], kwargs: dict[str, Any], first: bool) -> _Deployment:
        cap = capture(self.module, args, kwargs)
        atomic = atomic_components(cap.graph)
        if not first:
            log.info("rannc: new input signature; captured again (%s)", cap.graph.summary())
        groups = [list(range(len(atomic.components)))]
        stages = split_graph(cap.graph, atomic, groups)
        modules = [build_stage_module(cap.gm, cap.graph, s) for s in stages]
        log.info("rannc: captured %s, %d atomic components, in %.2f s",
                 cap.graph.summary(), len(atomic.components), cap.seconds)
        return _Deployment(cap, atomic, stages, modules)

    # -- what a training script touches ------------------------------------
    def train(self, mode: bool = True) -> RaNNCModule:
        self.training = mode
        self.module.train(mode)
        return self

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, rank0_only: bool = True, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The model's state dict with its original names (loadable into the unwrapped model)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,  # type: ignore[override]
                        assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of all parameters by their global norm; returns that norm."""
        return torch.nn.utils.clip_grad_norm_(list(self.parameters()), max_norm, norm_type)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Defer the replica gradient all-reduce (gradient accumulation).

        With one replica per stage there is nothing to defer, so this only marks the scope.
        """
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    def extra_repr(self) -> str:
        return f"module={type(self.module).__name__}, deployments={len(self._deployments)}"
