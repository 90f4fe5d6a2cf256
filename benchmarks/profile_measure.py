"""The measure oracle against the roofline estimate on this machine, for a Hugging Face BERT.

Captures BertForPreTraining, cuts its atomic components into `--blocks` contiguous blocks of
about equal estimated time, and prints per block the estimated and measured forward/backward
milliseconds and kept activation bytes, the calibration factor (measured / estimated time of
the whole model), the seconds profiling took, and the seconds a second oracle takes on the
same disk cache. The estimate uses `measure_local_device()` (this machine's measured FLOP/s
and bandwidth), as `rannc.plan` does by default.

    PYTHONPATH=. .venv/bin/python benchmarks/profile_measure.py                     # test BERT
    PYTHONPATH=. .venv/bin/python benchmarks/profile_measure.py --layers 4 --hidden 256 \\
        --heads 4 --seq 128 --batch 8 --batch-sizes 1 8
    PYTHONPATH=. .venv/bin/python benchmarks/profile_measure.py --device cuda --layers 24 \\
        --hidden 1024 --heads 16 --seq 512 --batch 8 --batch-sizes 1 2 4 8   # BERT-Large
    PYTHONPATH=. .venv/bin/python benchmarks/profile_measure.py --smoke   # seconds
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time

import torch

from rannc.atomic.components import atomic_components
from rannc.graph.capture import capture, flatten_inputs
from rannc.profile.device import measure_local_device
from rannc.profile.estimate import GraphCosts
from rannc.profile.measure import MeasureOracle, _chunks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=99)
    p.add_argument("--seq", type=int, default=12)
    p.add_argument("--batch", type=int, default=4, help="example batch (default 4)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--smoke", action="store_true", help="1 layer, 2 blocks, one batch size: seconds")
    a = p.parse_args(argv)
    if a.smoke:
        a.layers, a.blocks, a.batch_sizes, a.threads = 1, 2, [2], a.threads or 1
    return a


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                     num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                     max_position_embeddings=max(64, args.seq), hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    dev = torch.device(args.device)
    model = BertForPreTraining(cfg).to(dev)
    b, s = args.batch, args.seq
    kw = dict(input_ids=torch.randint(0, args.vocab, (b, s), device=dev),
              attention_mask=torch.ones(b, s, dtype=torch.long, device=dev),
              token_type_ids=torch.randint(0, 2, (b, s), device=dev),
              labels=torch.randint(0, args.vocab, (b, s), device=dev),
              next_sentence_label=torch.randint(0, 2, (b,), device=dev))
    cap = capture(model, (), kw)
    atomic = atomic_components(cap.graph)
    leaves, _ = flatten_inputs((), kw)
    costs = GraphCosts.of(cap.graph, atomic)
    spec = measure_local_device()
    n = len(atomic.components)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"BERT {args.layers}x{args.hidden}, seq {s}: {nparams / 1e6:.2f} M parameters, {n} atomic "
          f"components; device {dev} ({spec.name}: {spec.flops / 1e9:.1f} GFLOP/s, "
          f"{spec.mem_bandwidth / 1e9:.1f} GB/s measured); torch threads {torch.get_num_threads()}")
    sizes = sorted(set(args.batch_sizes))
    block_of = _chunks(costs.component_time(spec, max(sizes)), args.blocks)
    with tempfile.TemporaryDirectory() as cache_dir:
        oracle = MeasureOracle(cap, atomic, model, leaves, dev, costs, spec, cache_dir=cache_dir)
        t0 = time.perf_counter()
        factor = oracle.calibration(sizes[0])
        t1 = time.perf_counter()
        prof = oracle.block_profile(block_of, sizes)
        t2 = time.perf_counter()
        again = MeasureOracle(cap, atomic, model, leaves, dev, costs, spec, cache_dir=cache_dir)
        again.calibration(sizes[0])
        again.block_profile(block_of, sizes)
        t3 = time.perf_counter()
    est = costs.block_profile(spec, block_of, sizes)
    k = prof.fwd.shape[0]
    print(f"calibration at batch {sizes[0]}: measured/estimated = {factor:.2f} ({t1 - t0:.1f} s); "
          f"profile of {k} blocks x {len(sizes)} batch sizes: {t2 - t1:.1f} s; "
          f"again from the disk cache: {t3 - t2:.2f} s; fallbacks: {len(oracle.fallbacks)}")
    print()
    print("| block | batch | fwd est ms | fwd meas ms | bwd est ms | bwd meas ms | kept est KB "
          "| kept meas KB |")
    print("|---|---|---|---|---|---|---|---|")
    for j in range(k):
        for i, bs in enumerate(sizes):
            print(f"| {j} | {bs} | {est.fwd[j, i] * 1e3:.3f} | {prof.fwd[j, i] * 1e3:.3f} | "
                  f"{est.bwd[j, i] * 1e3:.3f} | {prof.bwd[j, i] * 1e3:.3f} | "
                  f"{est.kept[j, i] / 1e3:.1f} | {prof.kept[j, i] / 1e3:.1f} |")
    for i, bs in enumerate(sizes):
        e = float((est.fwd[:, i] + est.bwd[:, i]).sum())
        m = float((prof.fwd[:, i] + prof.bwd[:, i]).sum())
        ke, km = float(est.kept[:, i].sum()), float(prof.kept[:, i].sum())
        print(f"| all | {bs} | total fwd+bwd est {e * 1e3:.3f} ms | measured {m * 1e3:.3f} ms | "
              f"ratio {m / e:.2f} | kept est {ke / 1e3:.1f} KB | measured {km / 1e3:.1f} KB | "
              f"ratio {km / max(ke, 1):.2f} |")


if __name__ == "__main__":
    main()
