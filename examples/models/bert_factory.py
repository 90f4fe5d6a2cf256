"""Factories for `rannc plan FILE.py:FACTORY`: BERT pre-training models of several sizes with
an example global batch (sequence 128). Called under torch.device("meta") by the CLI."""

from __future__ import annotations

from typing import Any

import torch


def bert(layers: int, hidden: int, batch_size: int, seq: int = 128,
         vocab: int = 30522) -> tuple[Any, dict[str, Any]]:
    from transformers import BertConfig, BertForPreTraining

    cfg = BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 64,
                     intermediate_size=4 * hidden, vocab_size=vocab)
    model = BertForPreTraining(cfg)
    ids = torch.zeros(batch_size, seq, dtype=torch.long)
    kwargs = dict(input_ids=ids, token_type_ids=ids, attention_mask=torch.ones_like(ids),
                  labels=ids, next_sentence_label=torch.zeros(batch_size, dtype=torch.long))
    return model, kwargs


def bert_large(batch_size: int = 256) -> tuple[Any, dict[str, Any]]:
    return bert(24, 1024, batch_size)


def bert_24_2048(batch_size: int = 256) -> tuple[Any, dict[str, Any]]:
    return bert(24, 2048, batch_size)


def bert_96_1024(batch_size: int = 256) -> tuple[Any, dict[str, Any]]:
    return bert(96, 1024, batch_size)


def bert_96_2048(batch_size: int = 256) -> tuple[Any, dict[str, Any]]:
    return bert(96, 2048, batch_size)


def bert_256_1024(batch_size: int = 256) -> tuple[Any, dict[str, Any]]:
    return bert(256, 1024, batch_size)


def bert_256_2048(batch_size: int = 256) -> tuple[Any, dict[str, Any]]:
    """12.9 B parameters."""
    return bert(256, 2048, batch_size)
