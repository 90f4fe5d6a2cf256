"""Train a small BERT with dropout for 20 steps under a fixed seed and deterministic mode, then
print a digest of every parameter (tests/test_determinism.py runs it twice and compares).

    mpiexec -n 3 python tests/scripts/determinism_check.py --seed 0 --save-plan PLAN
    mpiexec -n 3 python tests/scripts/determinism_check.py --seed 0 --load-plan PLAN

The layout is fixed (2 stages, the second replicated, 4 microbatches, 1F1B with recomputation),
and the second run loads the first's plan: where the stages are cut depends on the speeds
measured at start-up, and moved by one component between launches here. Dropout makes the
RNG part of what must repeat.
"""

from __future__ import annotations

import argparse
import hashlib

import torch
from transformers import BertConfig, BertForPreTraining

import rannc
from rannc import dist as rdist


def digest(sd: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(sd):
        h.update(name.encode())
        h.update(sd[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-plan", default="", help="write the plan to this file")
    p.add_argument("--load-plan", default="", help="read the plan from this file")
    a = p.parse_args()
    plan_file = {"save_deployment": True, "deployment_file": a.save_plan} if a.save_plan else \
        {"load_deployment": True, "deployment_file": a.load_plan} if a.load_plan else {}
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(a.seed)
    cfg = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.1,
                     attention_probs_dropout_prob=0.1)
    model = BertForPreTraining(cfg)
    initial = digest(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = rannc.RaNNCModule(model, opt, seed=a.seed, partition_num=2, replicas=[1, 2],
                          microbatches=4, schedule="1f1b", checkpointing="on",
                          profiler="estimate", timeout_s=60, **plan_file)
    rank, world = rdist.get_rank(), rdist.get_world_size()
    data = torch.Generator().manual_seed(a.seed + 1)
    for _ in range(a.steps):
        batch, s = 12, 16
        kw = dict(input_ids=torch.randint(0, 99, (batch, s), generator=data),
                  attention_mask=(torch.rand(batch, s, generator=data) > 0.2).long(),
                  token_type_ids=torch.randint(0, 2, (batch, s), generator=data),
                  labels=torch.randint(0, 99, (batch, s), generator=data),
                  next_sentence_label=torch.randint(0, 2, (batch,), generator=data))
        per = batch // world
        mine = {k: v[rank * per:(rank + 1) * per] for k, v in kw.items()}
        loss = m(**mine).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    sd = m.state_dict()  # gathered on rank 0
    if rank == 0:
        print(f"DIGEST {digest(sd)} initial {initial} loss {loss.item():.6f}", flush=True)
    rdist.shutdown()


if __name__ == "__main__":
    main()
