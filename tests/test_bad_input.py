"""Bad input, one test each: a clear error naming the problem, the values and the fix.

The cross-rank cases run in ONE 2-rank launch (tests/scripts/bad_input_check.py, about 25 s):
every rank must raise the same error at the same point (a rank raising alone would hang the
others, and the launch's timeout would fail the test), and the job must still train exactly
afterwards. The rest run in this process.
"""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import pytest
import torch
from mpi_harness import run_mpi
from torch import nn

import rannc
from rannc import validate
from rannc.errors import ConfigError, InputDeviceError
from rannc.graph.capture import flatten_inputs

pytestmark = pytest.mark.layer("single_process")

SCRIPT = Path(__file__).parent / "scripts" / "bad_input_check.py"

# case -> (error type, what the message must say: the problem and values, then the fix)
CASES: dict[str, tuple[str, list[str]]] = {
    "input_shape": ("InputMismatchError", [
        "'args[0]' differs across ranks in its shapes", "rank 0: a tensor [B, 8] float32",
        "rank 1: a tensor [B, 9] float32", "batch sizes (B) were [3, 5]", "Fix: pad it"]),
    "input_dtype": ("InputMismatchError", [
        "'args[0]' differs across ranks in its dtypes", "rank 0: a tensor [B, 8] float32",
        "rank 1: a tensor [B, 8] float64", "Fix: cast it to one dtype"]),
    "keyword_arguments": ("InputMismatchError", [
        "different keyword arguments", "rank 0: ['mask']", "rank 1: []",
        "Pass every keyword on every rank"]),
    "keyword_arguments_after_deployment": ("InputMismatchError", [
        "different keyword arguments", "rank 0: []", "rank 1: ['mask']",
        "Pass every keyword on every rank"]),
    "grad_mode": ("InputMismatchError", [
        "different modes", "rank 0: train mode, grad enabled", "rank 1: train mode, no_grad",
        "torch.no_grad() / torch.autocast around the call on every rank alike"]),
    "input_device": ("InputDeviceError", [
        "input 'args[0]' on meta", "this rank's device cpu", "x.to('cpu')"]),
    "replicas_do_not_divide_ranks": ("ConfigError", [
        "replicas=[2, 1] sum to 3", "does not divide the 2 ranks", "Fix: give counts"]),
    "no_plan_fits_memory": ("PlanInfeasibleError", [
        "no plan fits", "needs at least", "1.00 KB", "raise mem_limit_gb"]),
    "plan_file_other_world_size": ("PlanMismatchError", [
        "plan_for_3_ranks.json is for 3 ranks but 2 are running", "Launch 3 ranks",
        "plan again"]),
    "plan_file_other_model": ("PlanMismatchError", [
        "plan_of_other_model.json was made for another model", "fingerprint", "plan again"]),
    "backward_twice_on_a_pipelined_output": ("RaNNCError", [
        "backward() through the outputs of step", "a second time (retain_graph=True)",
        "Fix: add the losses and call backward() once"]),
    "parameter_replaced_after_deployment": ("RaNNCError", [
        "parameter(s) 'b.weight' of the model were replaced by other tensors after rannc "
        "deployed it", "neither trained nor summed over the replicas",
        "Fix: change a parameter in place (with torch.no_grad(): param.copy_(new))"]),
    "zero_rows_at_the_first_call": ("InputMismatchError", [
        "rank 1 passed a batch of 0 rows (local batch sizes [3, 0])", "captures the model",
        "Fix: give every rank at least one row"]),
    "graph_differs_across_ranks": ("CaptureError", [
        "the ranks captured different graphs (rank 0: graph", "local batch sizes [3, 5]",
        "depends on something other than the input shapes", "Fix: make forward() the same"]),
    "graph_order_differs_across_ranks": ("CaptureError", [
        "the ranks captured the same operations in a different order (rank 0: graph",
        "iterates a set", "PYTHONHASHSEED is", "Fix: launch every rank with the same "
        "PYTHONHASHSEED, e.g. `mpiexec -genv PYTHONHASHSEED 0 ...`"]),
    "attribute_differs_across_ranks": ("InputMismatchError", [
        "different values of its Python attributes", "rank 0: train mode, grad enabled, "
        "attributes changed since captured (scale 1.0 -> 0.5)", "rank 1: train mode, grad "
        "enabled, attributes as captured (", "Fix: set such attributes"]),
    "hook_added_on_one_rank": ("InputMismatchError", [
        "different module trees, dtypes or hooks", "rank 0: train mode, grad enabled, hooks: forward "
        "hooks on 'a' (1)", "rank 1: train mode, grad enabled)", "Fix: make such a change on "
        "every rank alike"]),
    "dtype_changed_on_one_rank": ("InputMismatchError", [
        "different module trees, dtypes or hooks", "rank 0: train mode, grad enabled, dtypes "
        "float64 from 'a.weight' (", "rank 1: train mode, grad enabled)",
        "the model converted to another dtype"]),
    "generate_after_deployment": ("RaNNCError", [
        "LlamaForCausalLM.generate() after rannc deployed the model on several ranks",
        "Fix: gather the model and generate from an unwrapped copy"]),
    "output_without_rows": ("CaptureError", [
        "FeatureMean's output '[0]' has shape (16,) and no batch dimension", "only where it is "
        "a scalar", "Fix: return it per row", "batch_first=False"]),
    "per_sample_input_not_batched": ("InputMismatchError", [
        "argument 'args[1]' differs across ranks in its shapes: rank 0: a tensor [3] int64",
        "rank 1: a tensor [5] int64", "If it holds one entry per sample (labels, offsets), it is "
        "not split by rows: rannc takes dim 0 of the first tensor input, 'args[0]', as the batch",
        "nn.EmbeddingBag, pass 2-D ids"]),
    "whole_inputs_differ_across_ranks": ("InputMismatchError", [
        "input(s) 'args[1]' (a tensor [4] int64 on cpu), 'args[2]' (a tensor [4] int64 on cpu)",
        "differ across ranks in their values, but are not split by rows", "first tensor input, "
        "'args[0]', as the batch (local sizes [", "nn.EmbeddingBag, pass 2-D ids",
        "pass the same values on every rank"]),
    "forced_stages_cannot_be_cut": ("PlanInfeasibleError", [
        "no plan exists for the forced settings (partition_num=2)", "lost the batch dimension",
        "Fix: force fewer stages"]),
    "int_from_values_returned": ("CaptureError", [
        "ReturnsSizes's output '['positive']' is a Python int computed from tensor values",
        "an int cannot be combined from them", "Fix: return it as a tensor"]),
    "meta_model_never_materialised": ("RaNNCError", [
        "of the model's parameters and buffers are on the meta device (e.g. a.weight",
        "never materialised", "model.to_empty(device='cpu')"]),
    "plan_file_bogus_schedule": ("PlanMismatchError", [
        "plan_file_bogus_schedule.json is not a valid plan for this model and 2 ranks",
        "schedule 'bogus' is not one of gpipe, 1f1b, scp", "Fix: plan again"]),
    "plan_file_shares_not_summing_to_1": ("PlanMismatchError", [
        "stage 0's row shares [0.3] must each be in (0, 1] and sum to 1", "Fix: plan again"]),
    "plan_file_recompute_beyond_1": ("PlanMismatchError", [
        "stage 1's recompute=2.0 is not a fraction in [0, 1]", "Fix: plan again"]),
    "plan_file_more_microbatches_than_rows": ("PlanMismatchError", [
        "microbatches=100 exceeds the 8 rows of the global batch", "Fix: plan again"]),
    "plan_file_parameter_moved_between_stages": ("PlanMismatchError", [
        "stage 0's parameters do not match its components: its components read ['a.weight'], "
        "which it does not list", "Fix: plan again"]),
    "plan_file_rank_in_two_stages": ("PlanMismatchError", [
        "rank 0 is in two stages (0 and 1)", "Fix: plan again"]),
    "plan_file_unreadable": ("RaNNCError", [
        "reading the plan file", "plan_not_json.json failed on rank 0",
        "JSONDecodeError", "Fix: delete the file, or load_deployment=False"]),
}


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> str:
    res = run_mpi(SCRIPT, 2, [str(tmp_path_factory.mktemp("plans"))], timeout=150)
    return res.stdout


@pytest.mark.layer("multi_rank")
@pytest.mark.parametrize("name", sorted(CASES))
def test_cross_rank_bad_input_is_the_same_clear_error_on_every_rank(launch: str, name: str) -> None:
    kind, says = CASES[name]
    lines = re.findall(rf"^CASE {name} rank (\d) (.*)$", launch, re.MULTILINE)
    assert sorted(r for r, _ in lines) == ["0", "1"], launch
    (_, first), (_, second) = lines
    assert first == second, f"the ranks raised different errors:\n{first}\n{second}"
    assert first.startswith(f"{kind}: "), first
    for text in says:
        assert text in first, f"{text!r} missing from: {first}"


@pytest.mark.layer("multi_rank")
def test_job_still_trains_exactly_after_the_errors_with_a_bounded_capture_cache(launch: str) -> None:
    for when in ("after_errors_before_deployment", "after_errors_after_deployment",
                 "bags_padded", "inputs_returned", "sizes_returned", "plan_file_read_on_rank_0_only",
                 "at_the_end"):
        for r in (0, 1):
            assert re.search(rf"^USABLE {when} rank {r} ok", launch, re.MULTILINE), launch
    assert "DONE rank 0" in launch and "DONE rank 1" in launch
    # Five sequence lengths, max_captures=2: two runtimes kept (the planned one among them),
    # one warning saying to pad.
    for r in (0, 1):
        assert re.search(rf"^CACHE rank {r} runtimes 2 planned kept True hook warnings 0 "
                         r"warnings 1 .*max_captures"
                         ".*pad inputs to a "
                         "few bucket lengths", launch, re.MULTILINE), launch
    # the 2-stage plan in rank 0's file, not a plan of its own or rank 1's stale file
    assert re.findall(r"^LOADED rank \d stages (\d+)", launch, re.MULTILINE) == ["2", "2"], launch


# -- one process ------------------------------------------------------------------------------
class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = _Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)


class _Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on a tensor's value: torch.export cannot capture it
            return x * 2
        return x


def test_model_torch_export_cannot_capture() -> None:
    with pytest.raises(rannc.CaptureError) as info:
        rannc.RaNNCModule(_Branchy())(torch.randn(4, 3))
    text = str(info.value)
    assert "could not capture" in text and "module 'gate'" in text, text
    assert "Fix: rewrite that line with torch.where" in text, text
    assert info.value.module_path == "gate"


class _Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _ReturnsObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> _Holder:
        return _Holder(self.a(x))


def test_output_not_a_tensor_number_or_pytree() -> None:
    with pytest.raises(rannc.OutputTypeError) as info:
        rannc.RaNNCModule(_ReturnsObject())(torch.randn(4, 3))
    text = str(info.value)
    assert "_ReturnsObject.forward returns (in its output) a " in text and "_Holder" in text, text
    assert "not a tensor, a number or a pytree" in text, text
    assert "return the tensors in a tuple or dict" in text, text
    assert "register_pytree_node(_Holder" in text, text


def test_a_rannc_module_wrapped_again() -> None:
    inner = rannc.RaNNCModule(nn.Linear(2, 2))
    with pytest.raises(rannc.RaNNCError, match=r"already a RaNNCModule \(around Linear\).*"
                                               r"Fix: wrap the original model once"):
        rannc.RaNNCModule(inner)


def test_lazy_modules_are_refused_until_their_first_call() -> None:
    """A lazy module's parameters have no shape before its first call: refused at wrapping
    (before, torch.export's "uninitialized parameter" came with advice about control flow);
    after one call of the model, wrapped and exact."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.LazyLinear(3), nn.ReLU(), nn.LazyLinear(2))
    with pytest.raises(rannc.errors.CaptureError,
                       match=r"module\(s\) '1' \(LazyLinear\), '3' \(LazyLinear\) still hold "
                             r"uninitialized parameters.*Fix: call the model once on a sample "
                             r"batch before wrapping it"):
        rannc.RaNNCModule(net)
    x = torch.randn(5, 4)
    with torch.no_grad():
        net(x)
    ref = copy.deepcopy(net)
    torch.testing.assert_close(rannc.RaNNCModule(net)(x), ref(x), rtol=0, atol=0)


def test_a_meta_model_called_with_real_inputs() -> None:
    with torch.device("meta"):
        net = nn.Linear(2, 2)
    with pytest.raises(rannc.RaNNCError, match=r"2 of the model's parameters and buffers are on "
                                               r"the meta device \(e.g. weight, bias\).*never "
                                               r"materialised.*model.to_empty"):
        rannc.RaNNCModule(net)(torch.randn(3, 2))


def test_a_batch_of_0_rows_at_the_first_call() -> None:
    with pytest.raises(rannc.InputMismatchError, match=r"the call passed a batch of 0 rows "
                                                       r"\(local batch sizes \[0\]\)"):
        rannc.RaNNCModule(nn.Linear(2, 2))(torch.randn(0, 2))


def test_the_capture_cache_is_bounded_and_warns_once() -> None:
    model = rannc.RaNNCModule(nn.Linear(4, 4), max_captures=3)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for length in range(1, 7):
            model(torch.randn(2, length, 4))
    assert len(model._deployments) == 3
    said = [str(w.message) for w in got if "max_captures" in str(w.message)]
    assert len(said) == 1 and "pad inputs to a few bucket lengths" in said[0], said
    kept = list(model._deployments.values())  # lengths 4, 5, 6, least recently used first
    model(torch.randn(2, 4, 4))  # kept: no capture, and now the most recently used
    assert list(model._deployments.values()) == [kept[1], kept[2], kept[0]]
    model(torch.randn(2, 1, 4))  # captured again; length 5 goes
    assert list(model._deployments.values())[:2] == [kept[2], kept[0]]


def test_dropped_captures_give_back_what_torch_keeps_of_them() -> None:
    """torch.fx keeps the generated source of every graph module it compiles, process-wide, and
    a capture makes several; torch.export's ShapeEnv of each capture (with its fake tensors)
    is kept alive by a cycle through C++ that the garbage collector cannot see. A model called
    with a new input shape at every call grew both at every call. What a dropped capture left
    goes with it, and all of a wrapped model's when it is gone (`rannc.graph.leftovers`)."""
    import gc

    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.graph_module import _loader

    def shape_envs() -> int:
        gc.collect()
        gc.collect()  # (a ShapeEnv given back in the first pass is freed in the second)
        return sum(isinstance(o, ShapeEnv) for o in gc.get_objects())

    def train(sizes: list[tuple[int, int]]) -> None:  # (its frame, and the model, gone at return)
        model = rannc.RaNNCModule(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)),
                                  max_captures=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the capture cache's own warning)
            for length in range(1, 9):
                model(torch.randn(2, length, 4)).sum().backward()
                sizes.append((len(_loader.eval_cache), shape_envs()))

    start = len(_loader.eval_cache), shape_envs()
    sizes: list[tuple[int, int]] = []
    train(sizes)
    sources, envs = [s for s, _ in sizes], [e for _, e in sizes]
    assert sources[0] > start[0]
    assert len(set(sources[1:])) == 1 and sources[1] > sources[0], sources  # bounded from the 2nd on
    assert envs == [start[1] + 1] + [start[1] + 2] * 7, envs  # one a capture, two kept
    assert (len(_loader.eval_cache), shape_envs()) == start


def test_zero_microbatches() -> None:
    with pytest.raises(ConfigError, match=r"Config.microbatches=0 is not valid: microbatches must "
                                          r"be an integer >= 1, or None \(unset\). Fix: pass "
                                          r"microbatches=2"):
        rannc.RaNNCModule(nn.Linear(2, 2), microbatches=0)


def test_unknown_schedule() -> None:
    with pytest.raises(ConfigError, match=r"Config.schedule='zigzag' is not valid: schedule must "
                                          r"be one of 'auto', 'gpipe', '1f1b', 'scp', 'zero_bubble', "
                                          r"'zero_bubble_lag1', 'zero_bubble_lag0', "
                                          r"'interleaved_1f1b', 'zero_bubble_v'. Fix: pass "
                                          r"schedule='auto'"):
        rannc.RaNNCModule(nn.Linear(2, 2), schedule="zigzag")


def test_unknown_option_name() -> None:
    with pytest.raises(ConfigError, match=r"unknown rannc option\(s\) \['microbatch'\]\. Did you "
                                          r"mean: 'microbatch' -> 'microbatches'\?"):
        rannc.RaNNCModule(nn.Linear(2, 2), microbatch=2)


@pytest.mark.layer("multi_rank")
def test_partition_num_beyond_the_ranks_and_replicas_of_another_length() -> None:
    with pytest.raises(ConfigError, match=r"partition_num=4 stages need at least that many ranks "
                                          r"but 2 run.*launch at least 4 ranks"):
        validate.check_config(rannc.Config(partition_num=4), 2)
    with pytest.raises(ConfigError, match=r"partition_num=3 but replicas=\[1, 1\] lists 2 stages"):
        validate.check_config(rannc.Config(partition_num=3, replicas=[1, 1]), 2)
    validate.check_config(rannc.Config(replicas=[1, 1]), 4)  # two copies of the pipeline: fine


# -- the signature the ranks compare ----------------------------------------------------------
def _sig(*args: object, **kwargs: object) -> validate.CallSignature:
    _, layout = flatten_inputs(args, kwargs)
    return validate.call_signature(args, kwargs, layout.batch_leaves)


def _digest(*args: object, **kwargs: object) -> int:
    leaves, layout = flatten_inputs(args, kwargs)
    return validate.call_digest(layout, leaves)


@pytest.mark.layer("pure")
def test_local_batch_sizes_may_differ_nothing_else_may() -> None:
    long = torch.long
    base = _digest(torch.zeros(3, 5), mask=torch.ones(3, 5, dtype=long))
    assert _digest(torch.zeros(7, 5), mask=torch.ones(7, 5, dtype=long)) == base
    others = [_digest(torch.zeros(3, 6), mask=torch.ones(3, 5, dtype=long)),  # a size
              _digest(torch.zeros(3, 5), mask=torch.ones(3, 5)),  # a dtype
              _digest(torch.zeros(3, 5)),  # a keyword
              _digest(torch.zeros(3, 5), torch.ones(3, 5, dtype=long)),  # positional, not keyword
              _digest(torch.zeros(3, 5, device="meta"), mask=torch.ones(3, 5, dtype=long)),  # device
              _digest(torch.zeros(3, 5), mask=torch.ones(3, 5, dtype=long), flag=True)]  # a value
    assert len({base, *others}) == 1 + len(others)


@pytest.mark.layer("pure")
def test_mismatch_names_the_nested_argument_and_groups_ranks() -> None:
    ok = _sig(torch.zeros(2, 4), batch={"ids": torch.zeros(2, 16, dtype=torch.long)})
    bad = _sig(torch.zeros(2, 4), batch={"ids": torch.zeros(2, 32, dtype=torch.long)})
    text = validate.describe_mismatch([ok, bad, ok], [2, 2, 2])
    assert "argument \"batch['ids']\" differs across ranks in its shapes" in text, text
    assert "ranks 0, 2: a tensor [B, 16] int64 on cpu; rank 1: a tensor [B, 32] int64" in text


@pytest.mark.layer("pure")
def test_input_device_check_reads_device_types_only() -> None:
    sig = _sig(torch.zeros(2, 4), mask=torch.zeros(2, 4))
    validate.check_devices(sig, torch.device("cpu"))
    with pytest.raises(InputDeviceError, match=r"inputs 'args\[0\]' on cpu, 'mask' on cpu are not "
                                               r"on this rank's device cuda:1.*x.to\('cuda:1'\)"):
        validate.check_devices(sig, torch.device("cuda", 1))


@pytest.mark.layer("pure")
def test_a_mistyped_environment_variable_is_named_with_the_likely_one() -> None:
    with pytest.warns(UserWarning, match=r"rannc ignores the environment variable "
                                         r"RANNC_PARTITON_NUM: did you mean RANNC_PARTITION_NUM\?"):
        cfg = rannc.Config.resolve(environ={"RANNC_PARTITON_NUM": "2", "RANNC_BACKEND": "gloo"})
    assert cfg.partition_num is None


@pytest.mark.layer("pure")
def test_launch_variables_are_not_reported_as_unknown() -> None:
    from rannc import dist
    from rannc.config import LAUNCH_ENV
    assert {dist.BACKEND_ENV, dist.MASTER_ADDR_ENV, dist.ABORT_ON_ERROR_ENV} == set(LAUNCH_ENV)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rannc.Config.resolve(environ={k: "1" for k in LAUNCH_ENV} | {"RANNC_MICROBATCHES": "2"})
