"""Synthetic inputs for block formation: random DAGs and a BERT-like layered chain.

Used by tests/test_coarsen.py and benchmarks/coarsen_scale.py. Components are
numbered in a topological order, as `CoarsenProblem` requires.
"""

from __future__ import annotations

import math
import random

from rannc.coarsen.blocks import CoarsenProblem

Value = tuple[int, list[int], float]


def random_problem(rng: random.Random, n: int) -> CoarsenProblem:
    """A random DAG: usually a chain with skip edges, sometimes a sparse forest;
    values with one to several consumers; a few components 10x heavier; memory
    limits from none to tight; k from 1 to n + 2."""
    values: list[Value] = []
    chain = rng.random() < 0.7
    for c in range(n - 1):
        if chain or rng.random() < 0.5:
            consumers = [c + 1]
            while rng.random() < 0.4:  # fan-out: the same value read further on
                consumers.append(rng.randrange(c + 1, n))
            values.append((c, consumers, rng.choice([1.0, 2.0, 10 * rng.random()])))
    for _ in range(rng.randint(0, n) if n >= 2 else 0):  # skip edges
        a = rng.randrange(n - 1)
        consumers = rng.sample(range(a + 1, n), min(n - a - 1, rng.randint(1, 3)))
        values.append((a, consumers, 5 * rng.random()))
    rng.shuffle(values)
    time = [rng.random() * (10 if rng.random() < 0.1 else 1) for _ in range(n)]
    memory = [rng.random() * (4 if rng.random() < 0.05 else 1) for _ in range(n)]
    mem_limit = rng.choice([math.inf, math.inf, 5.0, 2.0, 1.0, 0.5])
    return CoarsenProblem(n, values, time, memory, mem_limit, rng.randint(1, n + 2))


class _Builder:
    """Appends components; each produces one value read by the components that list it."""

    def __init__(self) -> None:
        self.time: list[float] = []
        self.memory: list[float] = []
        self.values: list[Value] = []

    def op(self, inputs: list[int], time: float, memory: float, out_bytes: float) -> int:
        c = len(self.time)
        self.time.append(time)
        self.memory.append(memory)
        self.values.append((c, [], out_bytes))
        for i in inputs:
            self.values[i][1].append(c)
        return c

    def chain(self, x: int, n_ops: int, time: float, memory: float, out_bytes: float) -> int:
        for _ in range(n_ops):
            x = self.op([x], time, memory, out_bytes)
        return x


def bert_like(layers: int, mem_limit: float = math.inf, k: int = 32) -> CoarsenProblem:
    """An encoder stack as fine-grained as an exported BERT: 58 components per layer
    (q/k/v projections fanning out from the layer input, attention with a mask value
    produced once and read by every layer, dropout as rand/ge/mul/div, layer norm as
    nine element-wise ops, residual adds skipping ~20 components), plus embeddings
    and a head. Linear layers cost 1 (4 for the MLP), attention matmuls 0.5, the
    rest 0.02; memory is the parameters plus saved activations (arbitrary units)."""
    b = _Builder()
    act, scores = 4.0e6, 8.0e6  # bytes of one activation / one attention score tensor

    def dropout(x: int, nbytes: float) -> int:
        r = b.op([x], 0.02, 0.1, nbytes)
        keep = b.op([r], 0.02, 0.1, nbytes / 4)
        y = b.op([x, keep], 0.02, 0.1, nbytes)
        return b.op([y], 0.02, 0.1, nbytes)

    def layer_norm(x: int) -> int:
        mean = b.op([x], 0.02, 0.1, act / 1024)
        centred = b.op([x, mean], 0.02, 0.1, act)
        sq = b.op([centred], 0.02, 0.1, act)
        var = b.op([sq], 0.02, 0.1, act / 1024)
        var_eps = b.op([var], 0.02, 0.1, act / 1024)
        std = b.op([var_eps], 0.02, 0.1, act / 1024)
        normed = b.op([centred, std], 0.02, 0.1, act)
        scaled = b.op([normed], 0.02, 0.2, act)
        return b.op([scaled], 0.02, 0.2, act)

    ids = b.op([], 0.01, 0.1, act / 256)
    emb = b.chain(b.op([ids], 0.1, 8.0, act), 2, 0.05, 1.0, act)
    h = dropout(layer_norm(emb), act)
    mask = b.chain(b.op([ids], 0.01, 0.1, scores / 64), 3, 0.01, 0.1, scores / 64)
    for _ in range(layers):
        heads = []
        for _ in range(3):  # q, k, v: linear, view, permute
            heads.append(b.chain(b.op([h], 1.0, 4.0, act), 2, 0.02, 0.1, act))
        query, key, value = heads
        key_t = b.op([key], 0.02, 0.1, act)
        s = b.op([query, key_t], 0.5, 1.0, scores)
        s = b.op([s], 0.02, 0.5, scores)
        s = b.op([s, mask], 0.02, 0.5, scores)
        s = b.op([s], 0.1, 0.5, scores)  # softmax
        p = dropout(s, scores)
        ctx = b.op([p, value], 0.5, 1.0, act)
        ctx = b.chain(ctx, 3, 0.02, 0.1, act)  # permute, contiguous, view
        o = dropout(b.op([ctx], 1.0, 4.0, act), act)
        h1 = layer_norm(b.op([o, h], 0.02, 0.1, act))
        i = b.op([h1], 4.0, 16.0, 4 * act)
        g = b.chain(i, 5, 0.05, 0.5, 4 * act)  # gelu
        o2 = dropout(b.op([g], 4.0, 16.0, act), act)
        h = layer_norm(b.op([o2, h1], 0.02, 0.1, act))
    pooled = b.chain(b.op([h], 1.0, 4.0, act), 3, 0.05, 0.2, act)
    b.op([pooled, ids], 2.0, 30.0, 4.0)  # loss
    return CoarsenProblem(len(b.time), b.values, b.time, b.memory, mem_limit, k)
