"""Several optimizers of one model, seen by rannc as one.

Why: some models need two. torch's Muon (`torch.optim.Muon`) steps only matrices, so a model
trained with it gives its embeddings, norms and biases to an AdamW; recommender models give
their sparse embeddings to SparseAdam. rannc prunes the optimizer at deployment (each rank
steps the parameters it holds), counts its state in the memory model, hooks ZeRO-1 onto its
step and saves and loads its state by parameter name; with one optimizer given, the other's
state was in no checkpoint.

How: `RaNNCModule(model, [muon, adamw])` wraps the list in an `OptimizerSet`, an optimizer
whose `param_groups` are its optimizers' groups in order (the same dicts: pruning one prunes the
optimizer it belongs to), whose `state` looks a parameter up in the optimizer that steps it, and
whose step hooks, `step()`, `zero_grad()` and `load_state_dict()` go to each optimizer. The
training loop keeps stepping its own optimizers (or the set: `model.optimizer.step()`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from rannc.errors import ConfigError


class _States(MutableMapping[torch.Tensor, Any]):
    """The optimizers' `state` dictionaries as one (a parameter is in one optimizer's)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers

    def _holder(self, p: torch.Tensor) -> MutableMapping[torch.Tensor, Any] | None:
        return next((o.state for o in self._optimizers if p in o.state), None)

    def __getitem__(self, p: torch.Tensor) -> Any:
        held = self._holder(p)
        if held is None:
            raise KeyError(p)
        return held[p]

    def __setitem__(self, p: torch.Tensor, value: Any) -> None:
        owner = next((o for o in self._optimizers
                      if any(q is p for g in o.param_groups for q in g["params"])), None)
        if owner is None:
            raise KeyError("a parameter none of the optimizers steps")
        owner.state[p] = value

    def __delitem__(self, p: torch.Tensor) -> None:
        for o in self._optimizers:
            o.state.pop(p, None)

    def __contains__(self, p: object) -> bool:
        return any(p in o.state for o in self._optimizers)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for o in self._optimizers:
            yield from o.state

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._optimizers)


class OptimizerSet(torch.optim.Optimizer):
    """Optimizers of one model as one (module docstring). `optimizers` are the user's own."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        # (not torch.optim.Optimizer.__init__: the groups and state are the optimizers' own)
        self.optimizers = list(optimizers)
        self.defaults = {}
        self._state = _States(self.optimizers)

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for o in self.optimizers for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        raise AttributeError("OptimizerSet.param_groups are its optimizers' own: change theirs")

    @property  # type: ignore[override]
    def state(self) -> MutableMapping[torch.Tensor, Any]:  # type: ignore[override]
        return self._state

    @state.setter
    def state(self, value: Any) -> None:
        raise AttributeError("OptimizerSet.state is its optimizers' own: change theirs")

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise ConfigError("OptimizerSet.step() takes no closure: step each optimizer with its own")
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ConfigError("OptimizerSet.add_param_group: add the group to one of its optimizers "
                          "(model.optimizer.optimizers[i].add_param_group(...))")

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """`hook` before each optimizer's step (called with that optimizer)."""
        handles = [o.register_step_pre_hook(hook) for o in self.optimizers]
        return handles[0] if len(handles) == 1 else _Handles(handles)  # type: ignore[return-value]

    def register_step_post_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """`hook` after each optimizer's step (called with that optimizer)."""
        handles = [o.register_step_post_hook(hook) for o in self.optimizers]
        return handles[0] if len(handles) == 1 else _Handles(handles)  # type: ignore[return-value]

    def state_dict(self) -> dict[str, Any]:
        """Each optimizer's own state dict, in order."""
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """`state_dict()`'s, or one in torch's layout over the set's concatenated groups
        (`{"state": {index: ...}, "param_groups": [{..., "params": [index, ...]}]}`, the
        indices counting through every group in order), split between the optimizers."""
        if "optimizers" in state_dict:
            parts = state_dict["optimizers"]
            if len(parts) != len(self.optimizers):
                raise ConfigError(f"the state dict holds {len(parts)} optimizers' states, the set "
                                  f"{len(self.optimizers)}")
            for o, sd in zip(self.optimizers, parts, strict=True):
                o.load_state_dict(sd)
            return
        groups, state = list(state_dict["param_groups"]), dict(state_dict["state"])
        if len(groups) != len(self.param_groups):
            raise ConfigError(f"the state dict has {len(groups)} param group(s), the optimizers "
                              f"{len(self.param_groups)} together")
        at = 0
        for o in self.optimizers:
            mine = groups[at:at + len(o.param_groups)]
            at += len(o.param_groups)
            index: dict[Any, int] = {}
            for g in mine:
                for i in g["params"]:
                    index[i] = len(index)
            o.load_state_dict({
                "state": {index[i]: s for i, s in state.items() if i in index},
                "param_groups": [{**g, "params": [index[i] for i in g["params"]]} for g in mine]})

    def __repr__(self) -> str:
        return f"OptimizerSet({', '.join(type(o).__name__ for o in self.optimizers)})"


class _Handles:
    """Several hooks' handles removed together."""

    def __init__(self, handles: list[RemovableHandle]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def as_one(optimizer: Any) -> torch.optim.Optimizer | None:
    """`RaNNCModule`'s optimizer argument as one optimizer: None, an optimizer, or a list or
    tuple of them (an `OptimizerSet`; one in a list is itself). Refuses anything else, and a
    parameter that two of them step, by name of the problem and the fix."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if not isinstance(optimizer, (list, tuple)) or not optimizer or not all(
            isinstance(o, torch.optim.Optimizer) for o in optimizer):
        kinds = [type(o).__name__ for o in optimizer] if isinstance(optimizer, (list, tuple)) \
            else type(optimizer).__name__
        raise ConfigError(f"RaNNCModule's optimizer is {kinds}: pass a torch.optim.Optimizer, a "
                          "list of them (e.g. [Muon over the matrices, AdamW over the rest]), or "
                          "None")
    if len(optimizer) == 1:
        return optimizer[0]
    seen: dict[int, int] = {}
    for i, o in enumerate(optimizer):
        for g in o.param_groups:
            for p in g["params"]:
                j = seen.setdefault(id(p), i)
                if j != i:
                    raise ConfigError(
                        f"optimizers {j} and {i} ({type(optimizer[j]).__name__}, "
                        f"{type(o).__name__}) both step a parameter of shape {tuple(p.shape)}: "
                        "each parameter must be in one optimizer. Fix: split the parameters "
                        "between them")
    return OptimizerSet(optimizer)


def members(optimizer: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    """The user's optimizers behind `optimizer` (itself, or an `OptimizerSet`'s)."""
    if optimizer is None:
        return []
    return list(optimizer.optimizers) if isinstance(optimizer, OptimizerSet) else [optimizer]


__all__ = ["OptimizerSet", "as_one", "members"]
