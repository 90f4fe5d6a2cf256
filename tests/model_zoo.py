"""The models the exactness tests run, each with example inputs and a scalar loss.

Dropout is 0 everywhere so the wrapped and unwrapped runs can be compared exactly.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from examples.models.resnet import bit_resnet
from examples.models.toy import ForkJoin, KwargsModel, SharedParam

# Hugging Face warns about our tiny vocabularies; the warnings are noise in test logs.
logging.getLogger("transformers").setLevel(logging.ERROR)


@dataclass
class Case:
    name: str
    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss: Callable[[Any], torch.Tensor]  # model output -> scalar

    def fresh(self) -> Case:
        return Case(self.name, copy.deepcopy(self.model), self.args, self.kwargs, self.loss)


def _bert(batch: int) -> Case:
    from transformers import BertConfig, BertForPreTraining

    cfg = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    model = BertForPreTraining(cfg)
    s = 12
    kw = dict(input_ids=torch.randint(0, 99, (batch, s)),
              attention_mask=(torch.rand(batch, s) > 0.2).long(),
              token_type_ids=torch.randint(0, 2, (batch, s)),
              labels=torch.randint(0, 99, (batch, s)),
              next_sentence_label=torch.randint(0, 2, (batch,)))
    return Case("bert", model, (), kw, lambda out: out.loss)


def _llama(batch: int) -> Case:
    """Llama: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU (what selective
    recomputation drops most of), untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      use_cache=False)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 97, (batch, 10))
    return Case("llama", model, (), dict(input_ids=ids, labels=ids), lambda out: out.loss)


def _gpt2(batch: int) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 97, (batch, 10))
    return Case("gpt2", model, (), dict(input_ids=ids, labels=ids), lambda out: out.loss)


def _t5(batch: int) -> Case:
    """T5 given only labels (decoder inputs made by shift_tokens_right, a write into new_zeros)
    and a padded attention mask (each row's mask picked by an arange over the batch)."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
                   num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                   use_cache=False)
    model = T5ForConditionalGeneration(cfg)
    s = 7
    mask = torch.ones(batch, s, dtype=torch.long)
    for i in range(batch):
        mask[i, s - i % 3:] = 0
    kw = dict(input_ids=torch.randint(1, 64, (batch, s)), attention_mask=mask,
              labels=torch.randint(1, 64, (batch, 5)))
    return Case("t5", model, (), kw, lambda out: out.loss)


def _resnet(batch: int) -> Case:
    model = bit_resnet(50, 1, num_classes=5, blocks=(1, 1), base_channels=8)
    x = torch.randn(batch, 3, 16, 16)
    y = torch.randint(0, 5, (batch,))
    return Case("resnet", model, (x,), {}, lambda out: nn.functional.cross_entropy(out, y))


def _fork_join(batch: int) -> Case:
    return Case("fork_join", ForkJoin(16), (torch.randn(batch, 16),), {},
                lambda out: (out ** 2).mean())


def _shared(batch: int) -> Case:
    return Case("shared_param", SharedParam(16), (torch.randn(batch, 16),), {},
                lambda out: out.pow(2).sum())


def _kwargs(batch: int) -> Case:
    kw = dict(mask=(torch.rand(batch, 16) > 0.3).float(), scale=0.5, extra=None)
    return Case("kwargs", KwargsModel(16), (torch.randn(batch, 16),), kw,
                lambda out: out["loss"] + out["out"].mean())


class Writes(nn.Module):
    """Every way forward() writes into a tensor it made: through slices, tensor and boolean
    indices, scatters, fills, transpose and view aliases, and into buffers (a counter and an
    input-dependent running mean). Each result feeds the output, so a lost write changes it."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.mid = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.register_buffer("calls", torch.zeros(2))
        self.register_buffer("ema", torch.zeros(d))
        self.idx = torch.tensor([3, 0, 5])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + self.ema  # the running mean as it was before this call
        self.ema.mul_(0.9).add_(0.1 * x.mean(0))  # an input-dependent buffer update
        s = h.new_zeros(h.shape)
        s[..., 1:] = h[..., :-1]  # shift right: copy_ into a slice (shift_tokens_right)
        c = h.clone()
        c[:, 0] = 5.0  # fill_ through select
        c[:, self.idx] = s[:, :3]  # index_put_ with a tensor index
        c[h > 0.5] = -1.0  # index_put_ with a boolean mask
        z = torch.zeros_like(h)
        z.scatter_(1, torch.argsort(h, dim=1), h)  # scatter_
        z[:, :2].zero_()
        z[:, 2:4].mul_(3.0)
        t = self.mid(c).clone()
        t.transpose(0, 1)[1].add_(2.0)  # write through a transpose alias (column 1)
        t.view(-1)[::3].sub_(0.5)  # write through a view alias
        m = torch.zeros_like(h).masked_scatter_(h < 0, torch.ones_like(h) * 7.0)
        self.calls[0] += 1  # a buffer written through a view
        return self.out(s + t + z + m)


class NoGradWrites(nn.Module):
    """Buffers updated inside `torch.no_grad()` in forward, as EMA codebooks and running
    normalisers do: a running mean of the inputs and a call counter (torch.export records the
    block as one region op whose own schema does not say it writes them)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + self.ema  # the running mean as it was before this call
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * x.mean(0))
            self.calls.add_(1)
        return self.out(torch.tanh(self.mid(torch.tanh(h))))


def _no_grad_writes(batch: int) -> Case:
    return Case("writes_no_grad", NoGradWrites(), (torch.randn(batch, 8),), {},
                lambda out: (out ** 2).mean())


def _writes(batch: int) -> Case:
    return Case("writes", Writes(), (torch.randn(batch, 8),), {}, lambda out: (out ** 2).mean())


BUILDERS: dict[str, Callable[[int], Case]] = {
    "bert": _bert, "gpt2": _gpt2, "llama": _llama, "t5": _t5, "resnet": _resnet, "fork_join": _fork_join,
    "shared_param": _shared, "kwargs": _kwargs, "writes": _writes,
    "writes_no_grad": _no_grad_writes,
}


def make_case(name: str, batch: int = 4, seed: int = 0) -> Case:
    torch.manual_seed(seed)
    return BUILDERS[name](batch)


class AuxLayer(nn.Module):
    """A mixture-of-experts-like layer that stores its auxiliary loss and its gate's
    probabilities on itself (as many MoE implementations do, for the training loop to add up)
    instead of returning them."""

    def __init__(self, d: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.gate = nn.Linear(d, experts)
        self.aux_loss = torch.zeros(())
        self.probs: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None  # the layer's input (the first's: the model's)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x
        p = self.gate(x).softmax(-1)
        self.aux_loss = (p ** 2).sum(-1).mean() * p.shape[-1]
        self.probs = p.detach()
        return torch.tanh(self.lin(x)) * p.max(-1, keepdim=True).values


class StoresAux(nn.Module):
    """Three AuxLayers and a head; forward returns the logits only."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[AuxLayer(d) for _ in range(3)])
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))

    def aux(self) -> torch.Tensor:
        return sum((m.aux_loss for m in self.layers), torch.zeros(()))
