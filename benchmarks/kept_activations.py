"""The planner's kept-activation bytes against what autograd really saves, BERT and GPT-2.

    PYTHONPATH=. .venv/bin/python benchmarks/kept_activations.py           # the table in BENCHMARKS.md
    PYTHONPATH=. .venv/bin/python benchmarks/kept_activations.py --smoke   # seconds

The estimate oracle counts as kept for backward what each op's gradient reads
(`rannc.profile.saved`, in `rannc.profile.estimate.GraphCosts.kept`, with this CPU's composite
attention and dropout kernels); the memory forecast multiplies it by the microbatches a stage
holds. (Before, it counted the output of every non-view task: BERT 0.90x, GPT-2 1.42x what
autograd saves.) What autograd keeps is measured here on the eager model: every
tensor that reaches `torch.autograd.graph.saved_tensors_hooks`'s pack hook during one
forward, by distinct storage, parameters excluded. One process, CPU, random weights.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

MB = 2**20


def build(name: str, a: argparse.Namespace) -> Any:
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    if name == "bert":
        return BertForMaskedLM(BertConfig(vocab_size=a.vocab, hidden_size=a.hidden,
                                          num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                          intermediate_size=4 * a.hidden))
    return GPT2LMHeadModel(GPT2Config(vocab_size=a.vocab, n_embd=a.hidden, n_layer=a.layers,
                                      n_head=a.heads, use_cache=False))


def measure(name: str, a: argparse.Namespace) -> tuple[float, float, float]:
    """(bytes autograd saves, the estimate's kept bytes, its largest task's working bytes)."""
    import torch

    from rannc.atomic.components import atomic_components
    from rannc.graph.capture import capture
    from rannc.profile.estimate import GraphCosts

    torch.manual_seed(0)
    net = build(name, a)
    ids = torch.randint(5, a.vocab, (a.batch, a.seq))
    kw = dict(input_ids=ids, labels=ids.clone())
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        net(**kw).loss  # noqa: B018  (the forward's saved tensors are what is measured)
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    saved = float(sum(n for ptr, n in storages.items() if ptr not in params))
    cap = capture(net, (), kw)
    costs = GraphCosts.of(cap.graph, atomic_components(cap.graph), fused=False)  # this CPU
    kept = float((costs.kept[:, 0] + costs.kept[:, 1] * a.batch).sum())
    work = float((costs.work[:, 0] + costs.work[:, 1] * a.batch).max())
    return saved, kept, work


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--smoke", action="store_true", help="2 layers, H64, vocabulary 512, batch 4 x 16")
    a = p.parse_args()
    if a.smoke:
        a.layers, a.hidden, a.heads, a.vocab, a.batch, a.seq = 2, 64, 2, 512, 4, 16
    logging.getLogger("transformers").setLevel(logging.ERROR)
    print(f"L{a.layers} H{a.hidden} A{a.heads} vocab {a.vocab}, batch {a.batch} x {a.seq}\n")
    print("| model | autograd saves MiB | estimate kept MiB | kept / saved | largest task's working MiB |")
    print("|---|---|---|---|---|")
    for name in ("bert", "gpt2"):
        saved, kept, work = measure(name, a)
        print(f"| {name} | {saved / MB:.1f} | {kept / MB:.1f} | {kept / saved:.2f} | {work / MB:.1f} |")


if __name__ == "__main__":
    main()
