"""Pre-train a small BERT through rannc: the unmodified Hugging Face model plus one line.

    python examples/train_bert.py --steps 20

The data is synthetic (random token sequences with 15% of positions masked), so
the script needs no download; the loss falls as the model memorises it.
"""

from __future__ import annotations

import argparse
import logging

import torch
from transformers import BertConfig, BertForPreTraining

import rannc


def synthetic_batches(n: int, batch: int, seq: int, vocab: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """`n` fixed batches of masked-language-model and next-sentence examples."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(5, vocab, (batch, seq), generator=g)
        labels = torch.full_like(ids, -100)
        masked = torch.rand(batch, seq, generator=g) < 0.15
        labels[masked] = ids[masked]
        ids = ids.masked_fill(masked, 4)  # 4 plays [MASK]
        out.append(dict(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            token_type_ids=(torch.arange(seq) >= seq // 2).long().expand(batch, seq),
            labels=labels,
            next_sentence_label=torch.randint(0, 2, (batch,), generator=g),
        ))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="local batch per rank")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO if rannc.get_rank() == 0 else logging.WARNING,
                        format="%(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=1000, hidden_size=args.hidden, num_hidden_layers=args.layers,
                     num_attention_heads=max(1, args.hidden // 64), intermediate_size=4 * args.hidden,
                     max_position_embeddings=args.seq)
    model = BertForPreTraining(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model = rannc.RaNNCModule(model, opt)  # the one line

    batches = synthetic_batches(4, args.batch, args.seq, cfg.vocab_size, seed=rannc.get_rank())
    first = last = 0.0
    for step in range(args.steps):
        loss = model(**batches[step % len(batches)]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        last = loss.item()
        first = first or last
        if rannc.get_rank() == 0:
            print(f"step {step:3d}  loss {last:.4f}", flush=True)
    if rannc.get_rank() == 0:
        print(f"rank 0 of {rannc.get_world_size()}: loss {first:.4f} -> {last:.4f}")


if __name__ == "__main__":
    main()
