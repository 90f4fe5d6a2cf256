"""DESIGN.md's "Nothing silently different" cases under mpiexec, against the unwrapped model on
the global batch (tests/scripts/semantics_check.py; fp32, rtol 1e-5). The cases that need the
same ranks run in one launch (tests/mpi_harness.py's `CaseLaunches`)."""

from __future__ import annotations

import re

import pytest
from mpi_harness import TESTS, Case, CaseLaunches, case_launches_fixture, case_of, case_params

# (timeout: the first test of a rank count waits for its whole launch)
pytestmark = [pytest.mark.layer("multi_rank"), pytest.mark.timeout(3600)]

SCRIPT = TESTS / "scripts" / "semantics_check.py"
CASES: dict[str, Case] = {}  # filled below, next to the tests that read them
launches = case_launches_fixture(SCRIPT, CASES)


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


@pytest.mark.parametrize(("n", "args"),
                         case_params(CASES, "input_grad", INPUT_GRAD, ["--case", "input_grad"]))
def test_inputs_requiring_grad_get_their_rows_gradient(n: int, args: list[str], launches: CaseLaunches,
                                                       request: pytest.FixtureRequest) -> None:
    """x.grad on every rank equals its rows of the unwrapped model's x.grad (two stages read
    x, so the owner sums what both send back), for 2 steps; without requires_grad, None.
    torch.autograd.grad(loss, x), backward(inputs=[x]) and create_graph=True are refused on
    every rank with .grad untouched, and the whole backward through the same outputs is exact
    after them."""
    res = launches.result(case_of(request))
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


@pytest.mark.parametrize(("n", "args"), case_params(CASES, "masked_lm", MASKED, ["--case", "masked_lm"]))
def test_num_items_in_batch_gives_the_global_token_mean(n: int, args: list[str], launches: CaseLaunches,
                                                        request: pytest.FixtureRequest) -> None:
    """With num_items_in_batch (the global count; an int, then a tensor) the pieces of the loss
    sum: loss, logits rows, gradients and parameters after 2 AdamW steps equal the unwrapped
    model's global token mean; a count differing across ranks raises on every rank. Without
    the count the loss is the pieces' row-weighted mean, and rank 0 says so once."""
    res = launches.result(case_of(request))
    _passed(res.stdout, f"masked_lm {args[1]}", n)
    said = res.stderr.count("is the mean over the targets of input 'labels' that are not -100, "
                            "and its rows keep different numbers of them")
    assert said == 1, res.stderr


@pytest.mark.layer("pure")
def test_batchnorm_sync_keeps_one_microbatch_in_the_plan() -> None:
    """The planner keeps one microbatch (for the whole plan) under batchnorm="sync" when the
    model has BatchNorm, and refuses a forced count above one; "local" plans as before."""
    import torch
    from torch import nn

    import rannc
    from rannc.errors import ConfigError

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 14 * 14, 5))
    x = torch.randn(32, 3, 16, 16)
    cluster = rannc.Cluster.homogeneous("V100-32GB", n=4, per_node=4)
    local = rannc.plan(model, (x,), cluster=cluster,
                       config=rannc.Config(microbatches=4, profiler="estimate"))
    assert local.microbatches == 4
    sync = rannc.plan(model, (x,), cluster=cluster,
                      config=rannc.Config(batchnorm="sync", profiler="estimate"))
    assert sync.microbatches == 1
    with pytest.raises(ConfigError, match="keeps one microbatch"):
        rannc.plan(model, (x,), cluster=cluster,
                   config=rannc.Config(batchnorm="sync", microbatches=2, profiler="estimate"))
    with pytest.raises(ConfigError, match="batchnorm='exact'"):
        rannc.plan(model, (x,), cluster=cluster, config=rannc.Config(batchnorm="exact"))


# (ranks, arguments): "sync" on a tiny transformers ResNet, 2 stages x replicas [2, 1] (the
# planner keeps one microbatch), and [1, 2] under 1F1B with recomputation; "local" with 2
# microbatches and replicas [2, 1], whose plan changes what BatchNorm computes (warned).
BATCHNORM = [
    (3, ["--bn-mode", "sync", "--replicas", "2,1", "--microbatches", "0", "--batch", "7"]),
    (3, ["--bn-mode", "sync", "--replicas", "1,2", "--microbatches", "0", "--batch", "8",
         "--schedule", "1f1b", "--checkpointing", "on"]),
    (3, ["--bn-mode", "local", "--replicas", "2,1", "--microbatches", "2", "--batch", "7"]),
    # one stage on every rank: the statistics ride in the loss's all-reduce over the world
    (3, ["--bn-mode", "local", "--partition-num", "1", "--microbatches", "2", "--batch", "9"]),
    # nn.SyncBatchNorm (converted for DDP), the planner's layout: "sync" for it
    (3, ["--bn-mode", "syncbn", "--microbatches", "0", "--batch", "7"]),
]


@pytest.mark.parametrize(("n", "args"), case_params(CASES, "batchnorm", BATCHNORM, ["--case", "batchnorm"]))
def test_batchnorm(n: int, args: list[str], launches: CaseLaunches, request: pytest.FixtureRequest) -> None:
    """sync: outputs, loss, gradients, running statistics (every step) and eval() outputs after
    2 AdamW steps equal the unwrapped model's. local: the outputs differ, the first
    BatchNorm's running statistics and every num_batches_tracked equal the unwrapped model's
    after one call and after two (deferred: once per call, from the global batch), on 2
    stages and on one stage on every rank, and rank 0 warns once,
    naming the modules and the plan."""
    res = launches.result(case_of(request))
    mode = args[1]
    _passed(res.stdout, f"batchnorm {mode}", n)
    warned = (res.stdout + res.stderr).count("rannc: BatchNorm in training (resnet.embedder")
    if mode == "local":
        assert warned == 1, res.stderr
        reps = 3 if "--partition-num" in args else 2
        assert f"plan: 2 microbatches; replicas of the stages holding it: stage 0: {reps}" \
            in res.stderr
    else:
        assert warned == 0
        assert "microbatches 1" in res.stdout


CASES["frozen_bn"] = Case(3, ["--case", "frozen_bn", "--replicas", "2,1", "--microbatches", "1",
                              "--batch", "7"])


@pytest.mark.cases("frozen_bn")
def test_a_submodule_switched_to_eval_and_back_is_captured_in_each_mode(launches: CaseLaunches) -> None:
    """The embedder (its BatchNorm) frozen with .eval() under model.train() for two steps,
    then trained again; 2 stages x replicas [2, 1], batchnorm="sync": outputs, loss, gradients
    and every buffer equal the unwrapped model's at every step (before, the graph captured in
    train mode kept running: its logits differed from the first frozen step on)."""
    res = launches.result("frozen_bn")
    _passed(res.stdout, "frozen_bn", 3)


CASES["attributes"] = Case(3, ["--case", "attributes", "--replicas", "2,1", "--microbatches", "2",
                               "--batch", "7"])


@pytest.mark.cases("attributes")
def test_python_attributes_read_in_forward_are_guarded(launches: CaseLaunches) -> None:
    """transformers' BERT on 3 ranks (2 stages x [2, 1]): an attention's scaling changed and
    set back, an activation module swapped, config.output_hidden_states set, between steps:
    each a capture of its own (set back: the first one again), exact at every step (before,
    the first capture kept running: outputs off, no hidden states)."""
    res = launches.result("attributes")
    _passed(res.stdout, "attributes", 3)


CASES["sum_loss"] = Case(3, ["--case", "sum_loss", "--replicas", "2,1", "--microbatches", "2",
                             "--batch", "7"])


@pytest.mark.cases("sum_loss")
def test_a_loss_summed_over_rows_is_exact_and_a_contrastive_one_is_warned_about(
        launches: CaseLaunches) -> None:
    """transformers' BERT under reduction="sum" on 3 ranks (2 stages x [2, 1], 2 microbatches:
    6 pieces): loss and gradients equal the unwrapped model's (before: a sixth of them, the
    pieces' row-weighted mean). A contrastive term (in-batch pairs) is warned about once, by
    rank 0, naming where rows mix; the summed loss alone is not; a model updating buffers in
    forward under no_grad is warned about (its buffers, and its output reading them), and an
    embedding with scale_grad_by_freq=True (its gradient counted per piece; before, silently:
    up to 45x off on a row)."""
    res = launches.result("sum_loss")
    _passed(res.stdout, "sum_loss", 3)
    said = res.stderr.count("depends on several rows of the batch together")
    assert said == 1 and "from matmul in module '(the model itself)'" in res.stderr, res.stderr
    # (NoGradWrites reads its running mean before updating it: rows do not mix; its buffers:)
    assert res.stderr.count("buffer 'ema' and 1 more are updated in forward from the batch") == 1, \
        res.stderr
    assert res.stderr.count("the embedding in module '0' scales its weight's gradient by each "
                            "index's count in the batch") == 1, res.stderr


for _schedule in ("gpipe", "zero_bubble"):
    CASES[f"recompute_writes_{_schedule}"] = Case(2, [
        "--case", "recompute_writes", "--partition-num", "2", "--microbatches", "1",
        "--schedule", _schedule, "--checkpointing", "on", "--batch", "6"])


@pytest.mark.parametrize("schedule", [
    pytest.param(s, marks=pytest.mark.cases(f"recompute_writes_{s}")) for s in ("gpipe", "zero_bubble")])
def test_a_forward_run_again_reads_the_buffers_as_the_first_run_did(
        schedule: str, launches: CaseLaunches) -> None:
    """A buffer read, then updated under no_grad in forward; 2 stages, checkpointing on (the
    recomputation in backward), and zero-bubble (its late pass): loss, gradients and buffers
    equal the unwrapped model's (before: the run again read the updated buffer, gradients off)."""
    res = launches.result(f"recompute_writes_{schedule}")
    _passed(res.stdout, "recompute_writes", 2)


for _schedule in ("gpipe", "zero_bubble"):
    CASES[f"per_call_writes_{_schedule}"] = Case(2, [
        "--case", "per_call_writes", "--partition-num", "2", "--microbatches", "2",
        "--schedule", _schedule, "--batch", "6"])


@pytest.mark.parametrize("schedule", [
    pytest.param(s, marks=pytest.mark.cases(f"per_call_writes_{s}")) for s in ("gpipe", "zero_bubble")])
def test_buffers_updated_from_the_weights_alone_update_once_per_call(
        schedule: str, launches: CaseLaunches) -> None:
    """torch's spectral_norm and a counter, 2 stages, 2 microbatches: each microbatch starts
    from the call's values, so loss, gradients and buffers equal the unwrapped model's (before:
    updated once per microbatch, the gradients of the normalised weight off)."""
    res = launches.result(f"per_call_writes_{schedule}")
    _passed(res.stdout, "per_call_writes", 2)
    assert "updated in forward" not in res.stderr, res.stderr  # (nothing left to warn about)


CASES["composed"] = Case(3, ["--case", "composed", "--replicas", "2,1", "--microbatches", "2",
                             "--batch", "7"])


@pytest.mark.cases("composed")
def test_two_wrapped_models_composed_train_exactly(launches: CaseLaunches) -> None:
    """A GAN's generator and discriminator, each wrapped, on 3 ranks (2 stages x [2, 1], 2
    microbatches): the generator's outputs feed the discriminator through a user op, and a
    user loss reads them too. Both models' gradients equal the unwrapped models' for the
    ranks' mean loss over 3 AdamW steps (before: the generator's were a third of them)."""
    res = launches.result("composed")
    _passed(res.stdout, "composed", 3)


CASES["save_pretrained"] = Case(3, ["--case", "save_pretrained", "--replicas", "2,1",
                                    "--microbatches", "2", "--batch", "7"])


@pytest.mark.cases("save_pretrained")
def test_save_pretrained_on_every_rank_writes_the_whole_trained_model(launches: CaseLaunches) -> None:
    """transformers' BERT and a PEFT LoRA adapter on a Llama, on 3 ranks (2 stages x [2, 1]),
    trained exactly; `model.save_pretrained(path)` on every rank: rank 0 writes the whole
    trained model, which loads back equal to the unwrapped one's (before, every parameter
    another rank holds was written as an empty tensor); `model.module.state_dict()` is refused
    on every rank, and so are copies (`copy.deepcopy` and `torch.save` of the model or of
    `model.module`: before, an EMA copied after wrapping held empty tensors); a new sequence
    length afterwards is captured and trained exactly."""
    res = launches.result("save_pretrained")
    _passed(res.stdout, "save_pretrained", 3)


CASES["param_groups"] = Case(3, ["--case", "param_groups", "--replicas", "2,1", "--microbatches", "2",
                                 "--batch", "7", "--schedule", "1f1b", "--zero-stage", "1"])


@pytest.mark.cases("param_groups")
def test_a_param_group_added_after_deployment(launches: CaseLaunches) -> None:
    """Phased fine-tuning of transformers' BERT on 3 ranks (2 stages x [2, 1], 1F1B, ZeRO-1):
    the head trained first, then the backbone unfrozen and added with
    `optimizer.add_param_group`, then a layer frozen again: exact at every step; the added
    group is pruned to what the rank holds (before: it kept the released parameters and
    `optimizer_state_dict()` failed with a zip() error); the state dict by name equals the
    unwrapped optimizer's; a checkpoint resumes into an optimizer built with both groups."""
    res = launches.result("param_groups")
    _passed(res.stdout, "param_groups", 3)


CASES["late_optimizer"] = Case(3, ["--case", "late_optimizer", "--replicas", "2,1", "--microbatches",
                                   "2", "--batch", "7", "--schedule", "1f1b", "--zero-stage", "1"])


@pytest.mark.cases("late_optimizer")
def test_an_optimizer_built_after_wrapping(launches: CaseLaunches) -> None:
    """transformers' BERT wrapped first, its AdamW built after on `model.parameters()` (DDP's
    habit), on 3 ranks (2 stages x [2, 1], 1F1B, ZeRO-1): exact; `optimizer.state_dict()` on
    rank 0 equals the unwrapped optimizer's (before: rank 0's own parameters' state alone), and
    it and a checkpoint (before: no optimizer state) both resume exactly
    (semantics_check.check_late_optimizer)."""
    res = launches.result("late_optimizer")
    _passed(res.stdout, "late_optimizer", 3)


CASES["dtype_change"] = Case(3, ["--case", "dtype_change", "--replicas", "2,1", "--microbatches", "2",
                                 "--batch", "7"])


@pytest.mark.cases("dtype_change")
def test_a_model_converted_to_another_dtype_after_deployment(launches: CaseLaunches) -> None:
    """A Llama on 3 ranks (2 stages x [2, 1], 2 microbatches), trained in float32, converted
    to bfloat16 (a backward, then evaluation), and back: each dtype is a capture of its own,
    outputs and gradients equal the unwrapped model's in each (before: gloo aborted every rank
    on the first bfloat16 call, its messages another size than expected)."""
    res = launches.result("dtype_change")
    _passed(res.stdout, "dtype_change", 3)


CASES["optimizers"] = Case(3, ["--case", "optimizers", "--replicas", "2,1", "--microbatches", "2",
                               "--batch", "7", "--schedule", "1f1b", "--zero-stage", "1"])


@pytest.mark.cases("optimizers")
def test_two_optimizers_for_one_model(launches: CaseLaunches) -> None:
    """transformers' BERT trained with one optimizer over its hidden matrices (as Muon is used)
    and AdamW over the rest, `RaNNCModule(model, [sgd, adamw])`, on 3 ranks (2 stages x [2, 1], 1F1B, ZeRO-1):
    exact at every step, both optimizers' state by name in optimizer_state_dict() and in a
    checkpoint that resumes exactly (before: a list failed at the first call)."""
    res = launches.result("optimizers")
    _passed(res.stdout, "optimizers", 3)


CASES["lbfgs"] = Case(3, ["--case", "lbfgs", "--batch", "7"])


@pytest.mark.cases("lbfgs")
def test_lbfgs_is_planned_on_one_stage_and_refused_on_a_forced_split(launches: CaseLaunches) -> None:
    """torch.optim.LBFGS (its step couples every parameter) with a closure on transformers'
    BERT, 3 ranks: planned on one stage, losses and parameters equal the unwrapped model's over
    3 steps; partition_num=2 forced is a ConfigError on every rank naming LBFGS (before: each
    rank stepped its own stage's parameters, silently other numbers)."""
    res = launches.result("lbfgs")
    _passed(res.stdout, "lbfgs", 3)


CASES["param_hooks_gpipe"] = Case(3, ["--case", "param_hooks", "--replicas", "2,1", "--microbatches",
                                      "2", "--batch", "7", "--schedule", "gpipe"])
CASES["param_hooks_zero_bubble"] = Case(3, ["--case", "param_hooks", "--partition-num", "3",
                                            "--microbatches", "2", "--batch", "7", "--schedule",
                                            "zero_bubble"])


@pytest.mark.parametrize("layout", [
    pytest.param(s, marks=pytest.mark.cases(f"param_hooks_{s}")) for s in ("gpipe", "zero_bubble")])
def test_parameter_gradient_hooks_run_once_on_the_whole_gradient(layout: str,
                                                                 launches: CaseLaunches) -> None:
    """A clamp and a scaling registered with `p.register_hook`, and an SGD step fused into
    backward with `p.register_post_accumulate_grad_hook`, on transformers' BERT on 3 ranks
    (2 stages x [2, 1] fill-drain, 3 stages zero-bubble; 2 microbatches): each runs once per
    backward on the whole gradient, as in the unwrapped model (before: once per microbatch on
    pieces, the clamp off, the fused step failing with an in-place modification error)."""
    res = launches.result(f"param_hooks_{layout}")
    _passed(res.stdout, "param_hooks", 3)


SPARSE_LAYOUTS = {
    # 2 stages x [2, 1]: the embedding's stage replicated, the other rank holding none of it
    "rep21": Case(3, ["--replicas", "2,1", "--microbatches", "2", "--batch", "7"]),
    # one replica per stage, under the eager zero-bubble schedule (its early overflow check)
    "pn2-zb": Case(2, ["--partition-num", "2", "--microbatches", "2", "--schedule", "zero_bubble",
                       "--batch", "6"]),
    # data parallelism alone (every rank holds every parameter)
    "dp": Case(2, ["--replicas", "2", "--batch", "6"]),
}
for _lay, _c in SPARSE_LAYOUTS.items():
    CASES[f"sparse_grad_{_lay}"] = Case(_c.ranks, ["--case", "sparse_grad", *_c.args])


@pytest.mark.parametrize("layout", [pytest.param(lay, marks=pytest.mark.cases(f"sparse_grad_{lay}"))
                                    for lay in SPARSE_LAYOUTS])
def test_a_sparse_gradient_stays_sparse_for_sparse_adam(layout: str, launches: CaseLaunches) -> None:
    """nn.Embedding(sparse=True) stepped by SparseAdam: its gradient is sparse over the rows the
    global batch looked up, with the unwrapped model's values, and parameters follow over 3
    steps (semantics_check.check_sparse_grad says what failed before)."""
    res = launches.result(f"sparse_grad_{layout}")
    _passed(res.stdout, "sparse_grad", SPARSE_LAYOUTS[layout].ranks)


CASES["stored"] = Case(3, ["--case", "stored", "--replicas", "2,1", "--microbatches", "2",
                           "--batch", "7"])


@pytest.mark.cases("stored")
def test_tensors_forward_stores_on_modules_are_the_calls(launches: CaseLaunches) -> None:
    """Layers storing auxiliary losses and gate probabilities on themselves (MoE style), the
    loop adding the stored losses, on 3 ranks (2 stages x [2, 1], 2 microbatches): stored
    losses global, stored probabilities this rank's rows, gradients exact over 3 steps (before:
    zero losses, None probabilities)."""
    res = launches.result("stored")
    _passed(res.stdout, "stored", 3)


CASES["unused_count"] = Case(2, ["--case", "unused_count", "--partition-num", "2", "--microbatches", "2",
                                  "--batch", "6"])


@pytest.mark.cases("unused_count")
def test_a_count_no_loss_uses_is_warned_about(launches: CaseLaunches) -> None:
    """RobertaForMaskedLM's own loss ignores num_items_in_batch (transformers 5): rank 0 warns
    once that the scalar outputs stay row-weighted means; with rows keeping uneven numbers of
    labels, not again to pass the count."""
    res = launches.result("unused_count")
    _passed(res.stdout, "unused_count", 2)
    out = res.stdout + res.stderr
    assert out.count("but no scalar output of the model is computed") == 1, out
    assert "its rows keep different numbers of them" not in out, out


CASES["functional_bn"] = Case(2, ["--case", "functional_bn", "--replicas", "2", "--microbatches", "0",
                                  "--batch", "8"])


@pytest.mark.cases("functional_bn")
def test_batchnorm_sync_on_a_functionalised_graph(launches: CaseLaunches) -> None:
    """A model writing through a view is captured functionalised (BatchNorm as
    _native_batch_norm_legit_functional and write-backs): sync stays exact over 2 replicas."""
    res = launches.result("functional_bn")
    _passed(res.stdout, "functional_bn", 2)


# (ranks, arguments): one stage x 3 replicas under fill-drain (the backward starts from each
# rank's own loss gradient and is corrected once the ranks agree) and under 1F1B; 2 stages x
# [1, 2] under fill-drain (the agreement first, as before).
LOSS_GRAD = [
    (3, ["--partition-num", "1", "--microbatches", "1", "--batch", "9"]),
    (3, ["--partition-num", "1", "--microbatches", "2", "--batch", "9", "--schedule", "1f1b"]),
    (3, ["--replicas", "1,2", "--microbatches", "2", "--batch", "9"]),
]


@pytest.mark.parametrize(("n", "args"), case_params(CASES, "loss_grad", LOSS_GRAD, ["--case", "loss_grad"]))
def test_different_loss_gradients_on_the_ranks_give_ddp_gradients(
        n: int, args: list[str], launches: CaseLaunches, request: pytest.FixtureRequest) -> None:
    """Ranks back-propagating different loss gradients (one of them 0; then all 2; then under
    no_sync()) get the unwrapped model's gradients for the mean loss gradient, summed over
    the calls, as under DDP."""
    res = launches.result(case_of(request))
    _passed(res.stdout, "loss_grad", n)


CASES["gathered_zero1"] = Case(3, ["--case", "gathered", "--replicas", "2,1", "--microbatches", "2",
                                   "--batch", "7", "--schedule", "1f1b", "--zero-stage", "1"])
CASES["gathered_zero_bubble"] = Case(2, ["--case", "gathered", "--partition-num", "2",
                                         "--microbatches", "2", "--batch", "7", "--schedule",
                                         "zero_bubble"])


@pytest.mark.parametrize(("layout", "n"), [
    pytest.param(s, n, marks=pytest.mark.cases(f"gathered_{s}"))
    for s, n in (("zero1", 3), ("zero_bubble", 2))])
def test_gathered_parameters_for_an_ema_and_reinitialisation(layout: str, n: int,
                                                             launches: CaseLaunches) -> None:
    """`model.gathered_parameters()` on transformers' BERT (3 ranks, 2 stages x [2, 1], 1F1B,
    ZeRO-1; 2 ranks, zero-bubble): torch's AveragedModel and a hand-written EMA over
    `model.parameters()` equal the unwrapped model's EMA on every rank (before: the wrapper
    listed only the held parameters, and the EMA failed or paired other layers); layers
    re-initialised after wrapping under modifier_rank=0 equal the unwrapped model's and
    training stays exact (before: other random draws, silently); the same outside the block
    warns at the next call, and a write without modifier_rank raises on every rank."""
    res = launches.result(f"gathered_{layout}")
    _passed(res.stdout, "gathered", n)


CASES["interleaved"] = Case(3, ["--case", "interleaved", "--replicas", "2,1", "--microbatches", "2",
                                "--batch", "7", "--schedule", "gpipe"])


@pytest.mark.cases("interleaved")
def test_a_value_interleaving_samples_is_not_cut(launches: CaseLaunches) -> None:
    """torch's nn.MultiheadAttention under a masked mean, 3 ranks (2 stages x [2, 1], 2
    microbatches): losses, outputs and gradients equal the unwrapped model's at two steps
    (before: the plan cut at the attention's (seq * batch, embed) value, loss off by 2.4e-3)."""
    res = launches.result("interleaved")
    _passed(res.stdout, "interleaved", 3)


CASES["unused_loss"] = Case(3, ["--case", "unused_loss", "--replicas", "2,1", "--microbatches", "2",
                                "--batch", "7", "--schedule", "gpipe"])
CASES["unused_loss_eager"] = Case(3, ["--case", "unused_loss", "--replicas", "2,1",
                                      "--microbatches", "2", "--batch", "7", "--schedule", "1f1b"])


@pytest.mark.cases("unused_loss", "unused_loss_eager")
def test_a_loss_left_out_leaves_its_parameters_without_a_gradient(launches: CaseLaunches) -> None:
    """transformers' GPT2DoubleHeadsModel (its LM loss and its multiple-choice loss apart,
    steps back-propagating one, the other, both) and a model with an auxiliary scalar beside
    its batch output, trained on the batch output: a parameter only the left-out loss reaches
    keeps .grad None, as in PyTorch, and SGD with momentum and weight decay leaves it as the
    unwrapped model's does; before, it got zeros (seeded with the scalar's zero gradient),
    which the optimizer decayed and moved. Fill-drain and 1F1B (the eager line, its late pass,
    its buckets summed in forward where replicas share a stage), replicas [2, 1] on 3 ranks
    (semantics_check.check_unused_loss)."""
    _passed(launches.result("unused_loss").stdout, "unused_loss", 3)
    _passed(launches.result("unused_loss_eager").stdout, "unused_loss", 3)


CASES["batch_branch"] = Case(3, ["--case", "batch_branch", "--replicas", "2,1", "--microbatches", "0",
                                 "--batch", "24", "--schedule", "1f1b"])


@pytest.mark.cases("batch_branch")
def test_a_model_branching_on_the_batch_size_runs_its_pieces_branch(launches: CaseLaunches) -> None:
    """A model whose code branches on the batch size at 8 rows (as diffusers' upsampling does at
    64), each rank's batch of 8 rows: captured (before: torch.export's "Constraints violated
    (batch)") for the pieces' branch, the planner taking enough microbatches (pieces of at
    most 7 rows), rank 0 warning once that the global batch takes the other branch; exact
    against the unwrapped model on the global batch, replicas [2, 1] on 3 ranks under 1F1B. A
    later batch whose pieces would take the other branch is refused on every rank, forced
    microbatches too few at planning (semantics_check.check_batch_branch)."""
    _passed(launches.result("batch_branch").stdout, "batch_branch", 3)
