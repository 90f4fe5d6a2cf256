"""Hugging Face Trainer for a RaNNCModule: `rannc.hf.RaNNCTrainer` (imports transformers).

    model = rannc.RaNNCModule(model, opt)
    trainer = rannc.hf.RaNNCTrainer(model=model, args=args, train_dataset=ds,
                                    optimizers=(opt, None))   # opt: the one rannc was given
    trainer.train()                     # torchrun --nproc-per-node N, or mpiexec -n N
    trainer.train(resume_from_checkpoint=True)

Why a subclass: the plain `Trainer` trains a RaNNCModule (Accelerate leaves it unwrapped, see
`RaNNCModule._is_accelerate_prepared`), but it saves checkpoints from rank 0 alone
(`model.state_dict()`, `optimizer.state_dict()`), while a deployed RaNNCModule spreads its
parameters and optimizer state over the ranks: gathering them is a collective every rank must
join. RaNNCTrainer gathers them on every rank, lets rank 0 write them in Trainer's own layout
(`model.safetensors`, `optimizer.pt` keyed by parameter names), and loads them back on every
rank. The plain Trainer's rank-0 save fails at once with a RaNNCError naming this class.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any, cast

import torch
import torch.distributed as dist
from transformers import PreTrainedModel, Trainer
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINING_ARGS_NAME
from transformers.utils import can_return_loss, find_labels

from rannc import dist as rdist
from rannc.checkpoint import own_state_dict_reads
from rannc.errors import RaNNCError
from rannc.module import RaNNCModule

log = logging.getLogger(__name__)

# What a padding collator pads each keyword input with along the sequence (dim 1); None: the
# pad token. Only these are padded to the longest across ranks, and only with the attention mask
# that hides the new positions (see `RaNNCTrainer._prepare_inputs`).
_PADS: dict[str, int | None] = {
    "input_ids": None, "attention_mask": 0, "token_type_ids": 0, "labels": -100,
    "decoder_input_ids": None, "decoder_attention_mask": 0, "special_tokens_mask": 1,
}
# a padded key -> the mask that must come with it so the model ignores the padded positions
# (a decoder's inputs are causal: its new last positions cannot reach the earlier ones)
_NEEDS_MASK = {"input_ids": "attention_mask", "token_type_ids": "attention_mask"}


class RaNNCTrainer(Trainer):
    """`transformers.Trainer` whose checkpoints and `save_model()` work for a deployed RaNNCModule
    (call `save_model()` on every rank, as Trainer's own checkpointing does).

    `pad_across_ranks` (default True): a padding collator's token inputs (`input_ids` with their
    `attention_mask`, `labels`, ...) are padded on the right to the longest across ranks at each
    call, since a pipeline needs one shape on every rank; False: the collator must give every
    rank one length.

    `pad_to_multiple_of` (default None): those inputs are padded on, to a multiple of this many
    positions (also in one process), hidden the same way. Each new sequence length is a new
    input signature, captured again (seconds; `max_captures` kept); with dynamic padding nearly
    every batch has a length of its own, and a multiple such as 64 leaves a few. Losses and
    gradients are the unwrapped model's on the unpadded batch, up to rounding (`predict()`'s
    outputs carry the padded positions, labelled -100); the price is the padded positions'
    compute."""

    _rannc_trainer = True  # RaNNCModule.state_dict() lets this class's rank-0 writes through

    def __init__(self, model: Any = None, *args: Any, pad_across_ranks: bool = True,
                 pad_to_multiple_of: int | None = None, **kwargs: Any) -> None:
        if pad_to_multiple_of is not None and (isinstance(pad_to_multiple_of, bool)
                                               or not isinstance(pad_to_multiple_of, int)
                                               or pad_to_multiple_of < 1):
            raise RaNNCError(f"RaNNCTrainer(pad_to_multiple_of={pad_to_multiple_of!r}): give a "
                             "positive int (e.g. 64), or None to pad only to the longest across ranks")
        if not isinstance(model, RaNNCModule):
            raise RaNNCError(f"RaNNCTrainer trains a rannc.RaNNCModule, got {type(model).__name__}; "
                             "wrap the model first: RaNNCTrainer(model=rannc.RaNNCModule(model, opt))")
        opt, sched = kwargs.get("optimizers", (None, None))
        if opt is None and model.optimizer is not None:
            kwargs["optimizers"] = (model.optimizer, sched)  # rannc prunes this one after deployment
        elif opt is not None and opt is not model.optimizer:
            raise RaNNCError("RaNNCTrainer(optimizers=(opt, ...)): pass the optimizer the "
                             "RaNNCModule was given (RaNNCModule(model, opt)); rannc steps only the "
                             "parameters each rank holds through it")
        self._rannc_model: dict[str, Any] | None = None
        self._rannc_optim: dict[str, Any] | None = None
        self._pad_across_ranks = pad_across_ranks
        self._pad_multiple = pad_to_multiple_of or 1
        self._padded_logged = False
        super().__init__(model, *args, **kwargs)
        inner = model.module
        # Trainer reads these from the class of the model it holds; RaNNCModule.forward(*args,
        # **kwargs) names no labels, so evaluate() would compute no loss.
        if self.args.label_names is None:
            self.label_names = find_labels(type(inner))
        self.can_return_loss = can_return_loss(type(inner))
        # Whether the wrapped model's loss takes `num_items_in_batch` (Trainer's own test, made on
        # the wrapped model: RaNNCModule itself says no, for the plain Trainer's sake). With it,
        # Trainer passes the global count of labels that are not -100 and the loss is the global
        # token mean even when the ranks' rows hold different numbers of masked labels.
        self.model_accepts_loss_kwargs = bool(getattr(
            inner, "accepts_loss_kwargs",
            any(p.kind is inspect.Parameter.VAR_KEYWORD
                for p in inspect.signature(inner.forward).parameters.values())))

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        # Under DDP each rank's loss is its own tokens' sum over the global count, and Trainer
        # multiplies it by the number of processes because DDP averages gradients. A RaNNCModule
        # returns the global loss on every rank already (its pieces summed over the ranks), so
        # that factor must not be applied: the count is still gathered across ranks before this.
        average = self.args.average_tokens_across_devices
        self.args.average_tokens_across_devices = False
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self.args.average_tokens_across_devices = average

    @property
    def _wrapped(self) -> RaNNCModule:
        return cast(RaNNCModule, self.model)

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Trainer's, then the token inputs padded on the right to the longest across ranks
        (rounded up to `pad_to_multiple_of`).

        A padding collator (DataCollatorWithPadding, DataCollatorForSeq2Seq, ...) pads each
        rank's batch to its own longest sequence; under DDP each rank runs its own graph, but a
        pipeline's stages run every rank's rows, so every rank must pass one shape. The new
        positions are hidden as the collator's own are (attention mask 0, labels -100) and sit
        after every real token, so the real tokens' positions and outputs do not change. A
        batch with other inputs of differing shapes is left as it is (rannc then names them)."""
        inputs = super()._prepare_inputs(inputs)
        across = self._pad_across_ranks and rdist.get_world_size() > 1
        if not across and self._pad_multiple == 1:
            return inputs
        keys = sorted(k for k, v in inputs.items() if k in _PADS and isinstance(v, torch.Tensor)
                      and v.dim() >= 2 and not v.is_floating_point())
        if not keys:
            return inputs
        longest = torch.tensor([inputs[k].shape[1] for k in keys], device=inputs[keys[0]].device)
        if across:
            dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        m = self._pad_multiple
        want = {k: -(-n // m) * m for k, n in zip(keys, longest.tolist(), strict=True)}
        if all(want[k] == inputs[k].shape[1] for k in keys):
            return inputs
        if any(want[k] != inputs[k].shape[1] and _NEEDS_MASK.get(k, k) not in inputs for k in keys):
            return inputs  # (no mask to hide the new positions: rannc's check names the shapes)
        out = dict(inputs)
        for k in keys:
            extra = want[k] - inputs[k].shape[1]
            if extra:
                value = _PADS[k]
                if value is None:
                    value = self._pad_token_id()
                out[k] = torch.nn.functional.pad(inputs[k], (0, extra), value=value)
        if not self._padded_logged and rdist.get_rank() == 0:
            self._padded_logged = True
            log.info("rannc: each call's token inputs are padded on the right to %s (%s)",
                     " and ".join(["the longest across ranks"] * across
                                  + [f"a multiple of {m}"] * (m > 1)), ", ".join(keys))
        return out

    def _pad_token_id(self) -> int:
        for src in (self.processing_class, getattr(self._wrapped.module, "config", None)):
            pad = getattr(src, "pad_token_id", None)
            if isinstance(pad, int):
                return pad
        return 0  # (its positions are masked: any token id gives the same real outputs)

    def _set_signature_columns_if_needed(self) -> None:
        # The dataset columns to keep are the wrapped model's forward arguments (RaNNCModule's own
        # forward takes *args, **kwargs).
        if self._signature_columns is None:
            names = list(inspect.signature(self._wrapped.module.forward).parameters)
            cols: Any = names + list({"label", "label_ids", *self.label_names})
            self._signature_columns = cols

    def create_optimizer(self, model: Any = None) -> Any:
        """Trainer's own optimizer, where the RaNNCModule was given none: it becomes the model's
        at once (`RaNNCModule.take_optimizer`), so the plan counts its state and a resumed
        checkpoint's optimizer state loads into it before the first step."""
        opt = super().create_optimizer(model)
        if self._wrapped.optimizer is None:
            self._wrapped.take_optimizer(opt)
        return opt

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # Every rank gathers (collectives); Trainer then writes on rank 0.
        self._rannc_model = self._wrapped.state_dict()
        self._rannc_optim = None if self.args.save_only_model else self._wrapped.optimizer_state_dict()
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._rannc_model = self._rannc_optim = None

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self._rannc_model is not None:  # inside _save_checkpoint: already gathered
            super().save_model(output_dir, _internal_call)
            return
        self._rannc_model = self._wrapped.state_dict()  # a user's call: every rank gathers
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self._rannc_model = None

    def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
        sd = self._rannc_model if state_dict is None else state_dict
        inner = self._wrapped.module
        if not self.args.should_save or not isinstance(inner, PreTrainedModel):
            # (Trainer writes a bare state dict here; safetensors refuses tied entries that share
            # one tensor, so they become copies.)
            super()._save(output_dir, _untied(sd) if sd else sd)
            return
        # What Trainer does for a PreTrainedModel: save_pretrained (config.json, tied weights
        # once), the processing class and the training arguments.
        out = str(self.args.output_dir if output_dir is None else output_dir)
        os.makedirs(out, exist_ok=True)
        with own_state_dict_reads():  # (given the gathered state dict, it may still read keys)
            inner.save_pretrained(out, state_dict=sd)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(out)
        torch.save(self.args, os.path.join(out, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.args.should_save:
            return
        torch.save(self._rannc_optim, os.path.join(output_dir, OPTIMIZER_NAME))
        if self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, OPTIMIZER_NAME)
        if not os.path.isfile(path):
            return
        # Every rank reads the whole, name-keyed state and keeps what it holds.
        self._wrapped.load_optimizer_state_dict(torch.load(path, weights_only=True))
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))


def _untied(state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` with every tensor that an earlier entry shares (tied weights) copied."""
    seen: set[int] = set()
    out = {}
    for k, v in state_dict.items():
        if isinstance(v, torch.Tensor) and v.numel():
            ptr = v.untyped_storage().data_ptr()
            v = v.clone() if ptr in seen else v
            seen.add(ptr)
        out[k] = v
    return out
