"""Hugging Face Trainer and Accelerate holding a RaNNCModule, on 2 ranks (torchrun or mpiexec).

    torchrun --nproc-per-node 2 tests/scripts/hf_check.py --out DIR            # accelerate, trainer
    torchrun --nproc-per-node 2 tests/scripts/hf_check.py --out DIR --plain    # plain Trainer save

Default mode: (1) Accelerate `prepare(model, opt, loader)` returns the RaNNCModule itself (no
DDP) and 4 SGD steps equal the unwrapped model's on the global batch, and Accelerate's
save_state / load_state resume it exactly; (2) rannc.hf.RaNNCTrainer
trains a tiny GPT-2 for 6 steps (2 stages, checkpoints at steps 3 and 6): the loss goes down, and a
fresh model resumed from checkpoint-3 ends with the same parameters as the uninterrupted run;
(3) RaNNCTrainer with unevenly masked labels (-100) equals the unwrapped model on the global batch;
(4) so does RaNNCTrainer fed by a padding collator whose batches differ in length across ranks
and between the calls of a gradient accumulation, padding to the longest across ranks, and
(5) to a multiple of 8 (pad_to_multiple_of: fewer captures).
Prints "PASS accelerate rank R", "PASS trainer rank R", "PASS trainer-masked rank R",
"PASS trainer-ragged rank R" and "PASS trainer-ragged8 rank R".
--plain: the plain transformers.Trainer trains, then its rank-0 checkpoint save raises a
RaNNCError naming rannc.hf.RaNNCTrainer (instead of hanging).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]
from model_zoo import make_case  # noqa: E402

import rannc  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6


def gpt2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return make_case("gpt2", batch=2).model


def check_accelerate(rank: int, out: str) -> None:
    """4 steps as above; then Accelerate's own checkpoint: `save_state` (every rank calls it,
    rank 0 writes: the model's and the optimizer's state_dict() are gathered onto it) and
    `load_state` into the deployed model (step 5 again) and into a fresh one (step 5): both
    equal the reference's step 5. SGD with momentum: the optimizer has state to lose."""
    from accelerate import Accelerator

    torch.manual_seed(0)
    data = torch.randint(0, 97, (4, 10))
    model = gpt2()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    wrapped = rannc.RaNNCModule(model, opt, partition_num=2, timeout_s=60)
    loader = torch.utils.data.DataLoader(data, batch_size=2)  # accelerate shards it by rank
    acc = Accelerator(cpu=True)
    m, o, dl = acc.prepare(wrapped, opt, loader)
    assert m is wrapped, type(m)  # not wrapped in DistributedDataParallel

    def train_step(m: Any, o: Any) -> torch.Tensor:
        batch = data[2 * rank:2 * rank + 2]
        loss = m(input_ids=batch, labels=batch).loss
        acc.backward(loss)
        o.step()
        o.zero_grad()
        return loss.detach()

    for _ in range(4):
        for batch in dl:
            assert batch.shape[0] == 2 and torch.equal(batch, data[2 * rank:2 * rank + 2])
            loss = train_step(m, o)
            ref_loss = ref(input_ids=data, labels=data).loss
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    acc.save_state(out + "-accelerate", safe_serialization=False)  # (see the README)
    acc.save_state(out + "-accelerate-safe")  # safetensors: loaded before a first call below
    with torch.no_grad():
        want = ref(input_ids=data, labels=data).loss  # step 5's
    ref(input_ids=data, labels=data).loss.backward()
    ref_opt.step()  # (the reference after step 5)
    train_step(m, o)
    acc.load_state(out + "-accelerate")  # into the deployed model: back to step 4
    torch.testing.assert_close(train_step(m, o), want, rtol=RTOL, atol=ATOL)
    assert_same_state(rank, wrapped.state_dict(), ref)
    # safetensors into the deployed model too (safetensors reads the model's state_dict() on
    # every rank: before, the other ranks got rank 0's gathered dict's refusal)
    acc.load_state(out + "-accelerate-safe")  # back to step 4
    torch.testing.assert_close(train_step(m, o), want, rtol=RTOL, atol=ATOL)
    assert_same_state(rank, wrapped.state_dict(), ref)
    model2 = gpt2(seed=5)  # other weights: the checkpoint must bring them back
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    acc2 = Accelerator(cpu=True)
    m2, o2 = acc2.prepare(rannc.RaNNCModule(model2, opt2, partition_num=2, timeout_s=60), opt2)
    acc2.load_state(out + "-accelerate-safe")  # before the first call
    torch.testing.assert_close(train_step(m2, o2), want, rtol=RTOL, atol=ATOL)
    assert_same_state(rank, m2.state_dict(), ref)
    print(f"PASS accelerate rank {rank}", flush=True)


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (16, 10), generator=g)
    return [{"input_ids": x, "labels": x} for x in ids]


def trainer_args(out: str, **kw: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(**{**dict(
        output_dir=out, per_device_train_batch_size=2, max_steps=6, save_strategy="steps",
        save_steps=3, logging_steps=1, learning_rate=3e-3, report_to=[], seed=0, use_cpu=True,
        disable_tqdm=True), **kw})


def adamw(model: torch.nn.Module) -> Any:
    return torch.optim.AdamW(model.parameters(), lr=3e-3)


def two_optimizers(model: torch.nn.Module) -> list[Any]:
    """SGD with momentum over the blocks' matrices, AdamW over the rest (as Muon is used)."""
    params = dict(model.named_parameters())
    matrices = [n for n, p in params.items() if p.dim() == 2 and ".h." in n]
    return [torch.optim.SGD([params[n] for n in matrices], lr=0.05, momentum=0.9),
            torch.optim.AdamW([p for n, p in params.items() if n not in matrices], lr=3e-3)]


def check_trainer(rank: int, out: str, optimizers: Any = adamw, name: str = "trainer") -> None:
    """RaNNCTrainer on 2 stages: 6 steps, a checkpoint at step 3, and a run resumed from it
    ends with the same model. `optimizers`: the model's optimizer (or a list of them: an
    OptimizerSet that Trainer steps and checkpoints as one; None: Trainer builds its own, which
    RaNNCTrainer gives the model, so the resumed run loads its state)."""
    from rannc.hf import RaNNCTrainer

    model = gpt2()
    wrapped = rannc.RaNNCModule(model, optimizers(model), partition_num=2, timeout_s=60)
    trainer = RaNNCTrainer(model=wrapped, args=trainer_args(out), train_dataset=dataset())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    final = wrapped.state_dict()  # collective; the whole model on rank 0
    ckpt = Path(out) / "checkpoint-3"
    if rank == 0:
        assert (ckpt / "model.safetensors").is_file() and (ckpt / "optimizer.pt").is_file()
    rannc.barrier()

    model2 = gpt2(seed=5)  # other weights: the checkpoint must bring them back
    wrapped2 = rannc.RaNNCModule(model2, optimizers(model2), partition_num=2, timeout_s=60)
    trainer2 = RaNNCTrainer(model=wrapped2, args=trainer_args(out + "-resumed"),
                            train_dataset=dataset())
    trainer2.train(resume_from_checkpoint=str(ckpt))
    assert trainer2.state.global_step == 6
    resumed = wrapped2.state_dict()
    if rank == 0:
        assert list(resumed) == list(final)
        for k in final:
            torch.testing.assert_close(resumed[k], final[k], rtol=RTOL, atol=ATOL, msg=k)
    print(f"PASS {name} rank {rank}", flush=True)


def masked_dataset() -> list[dict[str, torch.Tensor]]:
    """Labels masked (-100) unevenly: the ranks' rows hold different numbers of counted tokens."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 97, (8, 10), generator=g)
    labels = ids.masked_fill(torch.rand(8, 10, generator=g) < torch.linspace(0.0, 0.8, 8)[:, None],
                             -100)
    return [{"input_ids": x, "labels": y} for x, y in zip(ids, labels, strict=True)]


def sgd_trainer(out: str, data: list[dict[str, torch.Tensor]], trainer_kw: dict[str, Any] | None = None,
                **kw: Any) -> tuple[Any, rannc.RaNNCModule, torch.nn.Module]:
    """RaNNCTrainer over a GPT-2 on 2 stages with SGD (lr 0.5, constant, no clipping, 2 steps),
    taking the rows in order (call c: rows 4c, 4c + 1 on rank 0; 4c + 2, 4c + 3 on rank 1),
    and an unwrapped copy of the model for the reference. `kw`: more TrainingArguments;
    `trainer_kw`: RaNNCTrainer's own options."""
    from rannc.hf import RaNNCTrainer

    class InOrder(RaNNCTrainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    model = gpt2()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    wrapped = rannc.RaNNCModule(model, opt, partition_num=2, timeout_s=60)
    collator = kw.pop("data_collator", None)
    trainer = InOrder(model=wrapped, args=trainer_args(
        out, **{**dict(save_strategy="no", max_grad_norm=0.0, lr_scheduler_type="constant",
                       learning_rate=0.5, max_steps=2), **kw}), train_dataset=data, data_collator=collator,
        **(trainer_kw or {}))
    return trainer, wrapped, ref


def label_count(trainer: Any, labels: list[torch.Tensor]) -> torch.Tensor:
    """Trainer's num_items_in_batch over these labels: those that are not -100, over
    labels[..., 1:] when it knows the loss shifts them."""
    shifted = getattr(trainer, "_loss_shifts_labels", False)
    return sum(((y[:, 1:] if shifted else y) != -100).sum() for y in labels)


def assert_same_state(rank: int, got: dict[str, torch.Tensor], ref: torch.nn.Module) -> None:
    if rank == 0:
        want = ref.state_dict()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL, msg=k)


def check_trainer_masked_labels(rank: int, out: str) -> None:
    """Two SGD steps of RaNNCTrainer with masked labels equal the unwrapped model's on the global
    batch: the loss is the mean over every rank's counted tokens (num_items_in_batch), not the
    mean of the ranks' means."""
    data = masked_dataset()
    trainer, wrapped, ref = sgd_trainer(out, data)
    trainer.train()
    got = wrapped.state_dict()

    # The unwrapped model as Trainer trains it in one process: the loss is divided by the count
    # of the batch's labels that are not -100, whatever each rank's share of them.
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(2):
        rows = data[4 * step:4 * step + 4]
        ids = torch.stack([r["input_ids"] for r in rows])
        labels = torch.stack([r["labels"] for r in rows])
        count = label_count(trainer, [labels])
        ref(input_ids=ids, labels=labels, num_items_in_batch=count).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert trainer.label_names == ["labels"], trainer.label_names
    ev = trainer.evaluate(data[:4])  # the labels are found: an eval loss, the same on every rank
    assert "eval_loss" in ev, ev
    assert_same_state(rank, got, ref)
    print(f"PASS trainer-masked rank {rank}", flush=True)


def check_trainer_bf16(rank: int, out: str) -> None:
    """RaNNCTrainer with bf16=True runs the model under bf16 autocast, as Trainer runs any model
    (Accelerate's prepare wraps its forward): its captures are under torch.autocast("cpu",
    torch.bfloat16), and two SGD steps equal the unwrapped model's under that autocast on the
    global batch to bf16's agreement. Before, it trained in float32, silently."""
    data = dataset()[:8]
    trainer, wrapped, ref = sgd_trainer(out, data, bf16=True)
    trainer.train()
    keys = [str(k) for k in wrapped._runtimes]  # (the call's autocast state is in its key)
    assert keys and all("('cpu', True, torch.bfloat16)" in k for k in keys), keys
    got = wrapped.state_dict()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(2):
        rows = data[4 * step:4 * step + 4]
        ids = torch.stack([r["input_ids"] for r in rows])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    if rank == 0:
        want = ref.state_dict()
        err = max((got[k] - want[k]).abs().max().item() for k in want)
        assert err < 2e-2, err  # (rounded in bf16 by rank and microbatch: as far as float32 is)
    print(f"PASS trainer-bf16 rank {rank}", flush=True)


def ragged_dataset() -> list[dict[str, torch.Tensor]]:
    """Rows of 3 to 10 tokens: padded per batch, rank 0's and rank 1's batches differ in length
    in every call (rows 4c, 4c + 1 on rank 0; 4c + 2, 4c + 3 on rank 1 in call c), and the
    calls of one accumulation differ in length too."""
    g = torch.Generator().manual_seed(3)
    lengths = [5, 7, 9, 4, 10, 3, 6, 8, 4, 6, 3, 5, 7, 9, 10, 4]
    rows = []
    for n in lengths:
        ids = torch.randint(1, 97, (n,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones(n, dtype=torch.long),
                     "labels": ids})
    return rows


def pad_batch(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """What DataCollatorWithPadding does (no tokenizer here): every row to the batch's longest,
    input_ids with 0, the attention mask with 0, labels with -100, on the right."""
    longest = max(len(r["input_ids"]) for r in rows)
    pads = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    return {k: torch.stack([torch.nn.functional.pad(r[k], (0, longest - len(r[k])), value=v)
                            for r in rows]) for k, v in pads.items()}


def check_trainer_ragged(rank: int, out: str, multiple: int | None = None) -> None:
    """A padding collator pads each rank's batch to its own longest row, so the ranks pass
    different sequence lengths; RaNNCTrainer pads them on to the longest across ranks (rounded
    up to `multiple`: RaNNCTrainer(pad_to_multiple_of=...), fewer lengths to capture). With
    gradient_accumulation_steps=2 (Trainer's no_sync on the first call of each step) the two calls
    of a step have different lengths too: two SGD steps equal the unwrapped model's on the
    global batch, whose loss is the sum over the step's tokens over their count (Trainer's)."""
    data = ragged_dataset()
    trainer, wrapped, ref = sgd_trainer(out, data, {"pad_to_multiple_of": multiple},
                                        gradient_accumulation_steps=2, data_collator=pad_batch)
    trainer.train()
    got = wrapped.state_dict()
    # evaluate() pads its ragged batches alike (eval mode: another captured graph). Both ranks
    # get the same 8 rows (one eval batch of 8 each, the shard filled by repeating rows).
    ev = trainer.evaluate(data[:8])
    # one capture per length the calls were padded to (the training calls' 4 rows each, the
    # eval call's 8), and mode
    m = multiple or 1
    lengths = {(-(-max(len(r["input_ids"]) for r in data[4 * c:4 * c + 4]) // m) * m, True)
               for c in range(4)}
    lengths.add((-(-max(len(r["input_ids"]) for r in data[:8]) // m) * m, False))
    assert len(wrapped._runtimes) == len(lengths), (sorted(wrapped._runtimes), sorted(lengths))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(2):
        calls = [pad_batch(data[4 * c:4 * c + 4]) for c in (2 * step, 2 * step + 1)]
        count = label_count(trainer, [b["labels"] for b in calls])
        for batch in calls:
            ref(**batch, num_items_in_batch=count).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    # Trainer's eval loss of the unwrapped model in one process: the loss over those 8 rows with
    # Trainer's count of their labels (the same count rule as in training)
    rows = pad_batch(data[:8])
    with torch.no_grad():
        want_eval = float(ref.eval()(**rows, num_items_in_batch=label_count(
            trainer, [rows["labels"]])).loss)
    assert math.isclose(ev["eval_loss"], want_eval, rel_tol=1e-5), (ev, want_eval)
    assert_same_state(rank, got, ref)
    print(f"PASS trainer-ragged{multiple or ''} rank {rank}", flush=True)


def check_plain_trainer_save(out: str) -> None:
    from transformers import Trainer

    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    wrapped = rannc.RaNNCModule(model, opt, partition_num=2, timeout_s=30)
    # remove_unused_columns=False: Trainer reads the columns from RaNNCModule.forward(*args, **kw)
    trainer = Trainer(model=wrapped, args=trainer_args(out, remove_unused_columns=False),
                      train_dataset=dataset(),
                      optimizers=(opt, None))
    trainer.train()  # the save at step 3 raises on rank 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--plain", action="store_true")
    a = p.parse_args()
    rank = rannc.get_rank()
    if a.plain:
        check_plain_trainer_save(a.out)
        return
    check_accelerate(rank, a.out)
    check_trainer(rank, a.out)
    check_trainer(rank, a.out + "-optimizers", two_optimizers, "trainer-optimizers")
    check_trainer(rank, a.out + "-own", lambda m: None, "trainer-own-optimizer")
    check_trainer_masked_labels(rank, a.out + "-masked")
    check_trainer_ragged(rank, a.out + "-ragged")
    check_trainer_ragged(rank, a.out + "-ragged8", multiple=8)
    check_trainer_bf16(rank, a.out + "-bf16")


if __name__ == "__main__":
    main()
