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


def _gpt2(batch: int) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 97, (batch, 10))
    return Case("gpt2", model, (), dict(input_ids=ids, labels=ids), lambda out: out.loss)


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


BUILDERS: dict[str, Callable[[int], Case]] = {
    "bert": _bert, "gpt2": _gpt2, "resnet": _resnet, "fork_join": _fork_join,
    "shared_param": _shared, "kwargs": _kwargs,
}


def make_case(name: str, batch: int = 4, seed: int = 0) -> Case:
    torch.manual_seed(seed)
    return BUILDERS[name](batch)
