"""`rannc.graph.leftovers`: what torch keeps of a capture, given back with it (the end-to-end
bound is tested in test_bad_input.py and tests/scripts/bad_input_check.py)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from rannc.graph import leftovers
from rannc.graph.capture import capture

pytestmark = pytest.mark.layer("single_process")


def test_a_dropped_capture_frees_its_shape_env() -> None:
    mark = leftovers.Mark()
    cap = capture(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), (torch.randn(3, 4),))
    kept = mark.new(cap.gm)
    (env,) = [ref() for ref in kept.shape_envs]
    assert env is not None and env.tracked_fakes  # the cycle through C++ that gc cannot see
    del cap, env
    gc.collect()
    assert kept.shape_envs[0]() is not None  # (without giving it back: alive)
    leftovers.forget(kept)
    gc.collect()
    gc.collect()
    assert kept.shape_envs[0]() is None


def test_the_last_export_map_is_emptied_only_for_its_own_capture() -> None:
    """forget() may run from a finalizer while another model is being exported: torch.export's
    map of its last trace must then stay."""
    cap = capture(nn.Linear(4, 4), (torch.randn(3, 4),))
    last = proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT
    assert last  # the trace just made
    leftovers._forget_last_export([ShapeEnv()])  # another capture's: left as it is
    assert last
    leftovers._forget_last_export(leftovers.shape_envs(cap.gm))
    assert not last
