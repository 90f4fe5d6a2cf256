"""The cost-oracle protocol the planner asks (`BlockOracle`) and its roofline implementation
(the choice between estimating and measuring is `rannc.profile.choice.make_oracle`).

Kept apart from the planner so that the measuring oracle (`rannc.profile.measure`, which
captures and runs blocks) can implement it without importing the planner.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rannc.profile.device import Cluster
from rannc.profile.estimate import BlockProfile, GraphCosts


class BlockOracle:
    """What the planner asks a cost oracle (estimate or measure)."""

    additive = False
    """Whether a group's costs are exactly its components' (sums; the maximum for working
    memory), so that a split costs the same whatever grouping it is tabled on. A measured
    oracle times each group on its own, and groups of different sizes time differently."""

    def component_time(self, batch: int) -> np.ndarray:
        raise NotImplementedError

    def block_profile(self, block_of: Sequence[int], batch_sizes: Sequence[int]) -> BlockProfile:
        raise NotImplementedError


class EstimateOracle(BlockOracle):
    """Roofline estimates on the cluster's slowest device."""

    additive = True

    def __init__(self, costs: GraphCosts, cluster: Cluster) -> None:
        self.costs = costs
        self.spec = cluster.slowest

    def component_time(self, batch: int) -> np.ndarray:
        return self.costs.component_time(self.spec, batch)

    def block_profile(self, block_of: Sequence[int], batch_sizes: Sequence[int]) -> BlockProfile:
        return self.costs.block_profile(self.spec, block_of, batch_sizes)


__all__ = ["BlockOracle", "EstimateOracle"]
