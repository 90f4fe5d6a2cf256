"""DESIGN.md's "Nothing silently different" cases under mpiexec, against the unwrapped model on
the global batch (tests/scripts/semantics_check.py; fp32, rtol 1e-5)."""

from __future__ import annotations

import re

import pytest
from mpi_harness import TESTS, run_mpi

SCRIPT = TESTS / "scripts" / "semantics_check.py"


def _passed(out: str, case: str, n: int) -> None:
    got = sorted(re.findall(rf"PASS {case} rank (\d+)", out))
    assert got == [str(r) for r in range(n)], out


# (ranks, arguments): 2 stages x replicas [2, 1] under fill-drain with uneven rows; replicas
# [1, 2] under 1F1B (input gradients computed inside forward, scaled in backward, plus the
# late pass for the batch output's gradient); the model's loss alone under 1F1B.
INPUT_GRAD = [
    (3, ["--replicas", "2,1", "--microbatches", "2", "--batch", "7"]),
    (3, ["--replicas", "1,2", "--microbatches", "3", "--batch", "9", "--schedule", "1f1b"]),
    (2, ["--partition-num", "2", "--microbatches", "4", "--batch", "8", "--schedule", "1f1b",
         "--own-weight", "0"]),
]


@pytest.mark.parametrize(("n", "args"), INPUT_GRAD,
                         ids=[f"{n}r-{'_'.join(x.lstrip('-') for x in a)}" for n, a in INPUT_GRAD])
def test_inputs_requiring_grad_get_their_rows_gradient(n: int, args: list[str]) -> None:
    """x.grad on every rank equals its rows of the unwrapped model's x.grad (two stages read
    x, so the owner sums what both send back), for 2 steps; without requires_grad, None."""
    res = run_mpi(SCRIPT, n, ["--case", "input_grad", *args])
    _passed(res.stdout, "input_grad", n)


# (ranks, arguments): a masked RoBERTa MLM (loss by Hugging Face's ForMaskedLMLoss) on 2 stages
# x replicas [2, 1]; a padded Llama (its own causal-LM loss, the count through **kwargs) on 2
# stages with 3 microbatches under fill-drain and under 1F1B (the loss gradient seeded inside
# forward). Rows hold 1 to 11 labelled tokens, so every piece's count differs.
MASKED = [
    (3, ["--model", "roberta", "--replicas", "2,1", "--microbatches", "2", "--batch", "7"]),
    (2, ["--model", "llama", "--partition-num", "2", "--microbatches", "3", "--batch", "7"]),
    (3, ["--model", "llama", "--replicas", "1,2", "--microbatches", "2", "--batch", "8",
         "--schedule", "1f1b"]),
]


@pytest.mark.parametrize(("n", "args"), MASKED,
                         ids=[f"{n}r-{'_'.join(x.lstrip('-') for x in a)}" for n, a in MASKED])
def test_num_items_in_batch_gives_the_global_token_mean(n: int, args: list[str]) -> None:
    """With num_items_in_batch (the global count; an int, then a tensor) the pieces of the loss
    sum: loss, logits rows, gradients and parameters after 2 AdamW steps equal the unwrapped
    model's global token mean; a count differing across ranks raises on every rank."""
    res = run_mpi(SCRIPT, n, ["--case", "masked_lm", *args])
    _passed(res.stdout, f"masked_lm {args[1]}", n)
