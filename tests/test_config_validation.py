"""rannc.Config: every field checked by its declared type and range at construction, from
keywords and RANNC_* variables alike, as a ConfigError naming the field, the value and the fix."""

from __future__ import annotations

import pydoc
from dataclasses import fields

import pytest
import torch
from torch import nn

import rannc
from rannc.errors import ConfigError

pytestmark = pytest.mark.layer("pure")


@pytest.mark.parametrize(("key", "text", "says"), [
    ("RANNC_PARTITION_NUM", "two", "RANNC_PARTITION_NUM='two' is not valid: partition_num must "
                                   "be an integer >= 1, or None"),
    ("RANNC_REPLICAS", "[2,1", "RANNC_REPLICAS='[2,1' is not valid: replicas must be a non-empty "
                               "list of integers each >= 1"),
    ("RANNC_MICROBATCHES", "1.5", "RANNC_MICROBATCHES=1.5 is not valid: microbatches must be an "
                                  "integer >= 1"),
    ("RANNC_TIMEOUT_S", "abc", "RANNC_TIMEOUT_S='abc' is not valid: timeout_s must be a finite "
                               "number > 0"),
    ("RANNC_MEM_LIMIT_GB", "lots", "RANNC_MEM_LIMIT_GB='lots' is not valid: mem_limit_gb must be "
                                   "a finite number > 0"),
    ("RANNC_SCHEDULE", "bogus", "schedule must be one of 'auto', 'gpipe'"),
    ("RANNC_SEED", "-3", "seed must be an integer >= 0"),
    ("RANNC_EXTRA", "[1]", "extra must be a dict"),
])
def test_a_bad_environment_value_names_the_variable_value_and_fix(key: str, text: str,
                                                                   says: str) -> None:
    with pytest.raises(ConfigError) as err:
        rannc.Config.resolve(environ={key: text})
    assert says in str(err.value)
    assert f"Fix: set {key} to such a value" in str(err.value)


@pytest.mark.parametrize(("kw", "says"), [
    ({"timeout_s": "abc"}, "Config.timeout_s='abc' is not valid: timeout_s must be a finite "
                           "number > 0. Fix: pass timeout_s=600"),
    ({"timeout_s": -5}, "Config.timeout_s=-5 is not valid"),
    ({"timeout_s": float("nan")}, "timeout_s must be a finite number > 0"),
    ({"partition_num": 2.5}, "Config.partition_num=2.5 is not valid: partition_num must be an "
                             "integer >= 1, or None (unset). Fix: pass partition_num=2"),
    ({"partition_num": True}, "partition_num must be an integer"),
    ({"replicas": [2, 0]}, "replicas must be a non-empty list of integers each >= 1"),
    ({"replicas": []}, "replicas must be a non-empty list"),
    ({"mem_margin": 1.0}, "mem_margin must be a finite number in [0, 1)"),
    ({"blocks": 0}, "blocks must be an integer >= 1"),
    ({"save_deployment": "yes"}, "save_deployment must be a boolean. Fix: pass save_deployment=True"),
    ({"deployment_file": 3}, "deployment_file must be a string"),
    ({"max_captures": 0}, "max_captures must be an integer >= 1"),
])
def test_a_bad_keyword_names_the_field_value_and_fix(kw: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError) as err:
        rannc.Config(**kw)  # type: ignore[arg-type]
    assert says in str(err.value)


def test_good_values_from_the_environment_are_typed() -> None:
    cfg = rannc.Config.resolve(environ={
        "RANNC_PARTITION_NUM": "2", "RANNC_REPLICAS": "[2,1]", "RANNC_TIMEOUT_S": "60",
        "RANNC_MEM_LIMIT_GB": "1.5", "RANNC_SAVE_DEPLOYMENT": "true",
        "RANNC_DEPLOYMENT_FILE": "123", "RANNC_PROFILE_CACHE_DIR": "/tmp/x", "RANNC_SEED": "7"})
    assert cfg.partition_num == 2 and cfg.replicas == [2, 1] and cfg.seed == 7
    assert cfg.timeout_s == 60.0 and isinstance(cfg.timeout_s, float)
    assert cfg.mem_limit_gb == 1.5 and cfg.save_deployment is True
    assert cfg.deployment_file == "123" and cfg.profile_cache_dir == "/tmp/x"


def test_every_field_has_a_docstring_that_help_shows() -> None:
    text = pydoc.render_doc(rannc.Config, renderer=pydoc.plaintext)
    for f in fields(rannc.Config):
        assert f"{f.name} (" in text, f.name
        assert f"RANNC_{f.name.upper()}" in text, f.name
    assert "torch.manual_seed(seed)" in text


def test_raNNC_names_point_at_their_real_replacement_not_a_lookalike() -> None:
    with pytest.warns(UserWarning) as got:
        rannc.Config.resolve(environ={"RANNC_MAX_PARTITION_NUM": "4",
                                      "RANNC_PARTITIONING_DRY_RUN_NP": "8"})
    text = " ".join(str(w.message) for w in got)
    assert "RANNC_MAX_PARTITION_NUM: RaNNC read it, rannc does not; it capped the stage count" in text
    assert "did you mean RANNC_PARTITION_NUM" not in text
    assert "RANNC_PARTITIONING_DRY_RUN_NP: RaNNC read it, rannc does not; use RANNC_DRY_RUN_NP" in text


class _Drop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(self.lin(x), 0.5, training=self.training)


@pytest.mark.layer("single_process")
def test_seed_seeds_torch_at_deployment() -> None:
    import copy

    torch.manual_seed(0)
    net = _Drop()
    ref = copy.deepcopy(net)
    model = rannc.RaNNCModule(net, seed=123)
    torch.rand(5)  # the script's own draws before the first call do not matter
    x = torch.ones(2, 4)
    out = model(x)
    torch.manual_seed(123)
    torch.testing.assert_close(out, ref(x), rtol=0, atol=0)  # the same dropout mask
    again = model(x)  # seeded once, at deployment: a later call draws new numbers
    assert not torch.equal(again, out)
