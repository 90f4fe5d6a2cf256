"""Factories for the `rannc plan` command tests."""

from __future__ import annotations

from typing import Any

import torch


def tiny_bert(batch_size: int = 8) -> tuple[Any, dict[str, Any]]:
    from transformers import BertConfig, BertForPreTraining

    cfg = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)
    ids = torch.zeros(batch_size, 12, dtype=torch.long)
    return BertForPreTraining(cfg), dict(input_ids=ids, labels=ids)


def not_a_pair() -> int:
    return 3
