"""The planner's memory forecast against `torch.cuda.max_memory_allocated`, one process, one GPU.

    PYTHONPATH=. python benchmarks/gpu_memory.py            # one CUDA GPU: the table in BENCHMARKS.md
    PYTHONPATH=. .venv/bin/python benchmarks/gpu_memory.py --smoke   # CPU, seconds: the script runs

The GPU half of `benchmarks/memory_forecast.py` (which measures CPU processes, where the C
allocator's heap and the captured graphs sit in the same memory as the tensors). Per cell
(Hugging Face BERT, GPT-2 or Llama from a config with random weights; fp32, or bf16 under
`torch.autocast`; a global batch), in this one process:

* forecast: `rannc.plan` of the model on this device (one stage, one microbatch, AdamW's state
  factor: what one process runs), `predicted["memory_bytes"]` of its stage, and the terms the
  memory model adds up (`benchmarks/memory_forecast.forecast_terms`);
* rannc: the model wrapped in `rannc.RaNNCModule` with AdamW, `--steps` steps; the peak of
  `torch.cuda.max_memory_allocated` over steps 2 to the last (reset after step 1), less what was
  allocated before the model was built (the batch);
* plain: the same model and steps without rannc, for reference.

measured / forecast is the figure of merit (issue goal: within 15 %, 0.87 to 1.15). One process
runs the whole captured graph as one stage; stages of a pipeline need one GPU per rank.
`--loop` as in `memory_forecast.py`: `drop` (the default, Trainer's loop) lets the batch outputs
go before backward and `zero_grad()` free the gradients; `hold` keeps the outputs through the
step and zeroes the gradients in place, what the forecast reserves for (on the CPU at this
shape the tensor peak was 0.78 of the forecast with drop and 0.99 with hold).
Each cell's row is also appended to `--jsonl` (so a run cut short keeps the cells it finished).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from memory_forecast import forecast_terms  # noqa: E402

import rannc  # noqa: E402
from rannc.module import optimizer_state_factor  # noqa: E402

MiB = float(2**20)
MODELS = ("bert", "gpt2", "llama")


def build(kind: str, a: argparse.Namespace) -> torch.nn.Module:
    import transformers as tr

    torch.manual_seed(0)
    heads = max(1, a.hidden // 64)
    if kind == "bert":
        return tr.BertForMaskedLM(tr.BertConfig(
            vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
            num_attention_heads=heads, intermediate_size=4 * a.hidden,
            max_position_embeddings=max(512, a.seq)))
    if kind == "gpt2":
        return tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=a.vocab, n_embd=a.hidden, n_layer=a.layers,
                                                n_head=heads, n_positions=max(512, a.seq),
                                                use_cache=False))
    return tr.LlamaForCausalLM(tr.LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
        intermediate_size=a.hidden * 11 // 4, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 3), max_position_embeddings=a.seq, use_cache=False))


def batch(a: argparse.Namespace, rows: int, dev: torch.device) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, a.vocab, (rows, a.seq), generator=torch.Generator().manual_seed(1))
    return dict(input_ids=ids.to(dev), labels=ids.to(dev))


def run(model: torch.nn.Module, opt: torch.optim.Optimizer, kw: dict[str, torch.Tensor], steps: int,
        bf16: bool, dev: torch.device, loop: str = "drop") -> tuple[float, float]:
    """(peak bytes allocated over steps 2..steps; the last loss). `loop`: "drop" or "hold"
    (the module docstring)."""
    cuda = dev.type == "cuda"
    loss = torch.zeros(())
    for step in range(steps):
        with torch.autocast(dev.type, torch.bfloat16, enabled=bf16):
            out = model(**kw)
        loss = out.loss
        if loop == "drop":
            del out
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=loop == "drop")
        out = None
        if step == 0 and cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
    peak = float(torch.cuda.max_memory_allocated(dev)) if cuda else float("nan")
    return peak, float(loss.detach())


def cell(kind: str, dtype: str, rows: int, a: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    bf16 = dtype == "bf16"
    kw = batch(a, rows, dev)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    base = float(torch.cuda.memory_allocated(dev)) if dev.type == "cuda" else 0.0
    net = build(kind, a).to(dev)
    factor = optimizer_state_factor(torch.optim.AdamW(net.parameters(), lr=1e-4))
    with torch.autocast(dev.type, torch.bfloat16, enabled=bf16):
        plan = rannc.plan(net, kwargs=kw, config=rannc.Config(
            partition_num=1, microbatches=1, checkpointing="off", opt_param_factor=factor,
            progress=False))
    st = plan.stages[0]
    terms = forecast_terms(plan, st, factor, fused=dev.type == "cuda")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    peak_r, loss_r = run(rannc.RaNNCModule(net, opt), opt, kw, a.steps, bf16, dev, a.loop)
    del opt, net
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    plain = build(kind, a).to(dev)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    peak_p, loss_p = run(plain, opt, kw, a.steps, bf16, dev, a.loop)
    del opt, plain
    gc.collect()
    forecast = float(st.predicted["memory_bytes"])
    return dict(model=kind, dtype=dtype, rows=rows, seq=a.seq, loop=a.loop, forecast=forecast,
                rannc=peak_r - base, plain=peak_p - base, loss_rannc=loss_r, loss_plain=loss_p,
                terms=terms, params=sum(p.numel() for p in build(kind, a).parameters()))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 32], help="global batch sizes")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--loop", default="drop", choices=("drop", "hold"),
                   help="drop: outputs dropped before backward, gradients freed (Trainer's loop); "
                        "hold: outputs live through the step, gradients zeroed in place")
    p.add_argument("--jsonl", default="", help="append each cell's row here")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: the script runs")
    a = p.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if a.smoke:
        a.models, a.dtypes, a.rows = ["llama"], ["fp32"], [2]
        a.layers, a.hidden, a.vocab, a.seq, a.steps = 2, 64, 128, 16, 2
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (nothing measured)"
    print(f"device {name}; torch {torch.__version__}; L{a.layers} H{a.hidden} vocab {a.vocab} "
          f"seq {a.seq}; AdamW; {a.steps} steps, peak over steps 2..{a.steps}; loop {a.loop}\n")
    head = ["model", "dtype", "batch", "forecast MiB", "rannc peak MiB", "rannc / forecast",
            "plain peak MiB", "rannc / plain", "params+grads+Adam MiB", "kept MiB", "work MiB",
            "loss rannc / plain"]
    print("| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|", flush=True)
    for kind in a.models:
        for dtype in a.dtypes:
            for rows in a.rows:
                r = cell(kind, dtype, rows, a, dev)
                if a.jsonl:
                    with open(a.jsonl, "a") as f:
                        f.write(json.dumps(r) + "\n")
                t = r["terms"]
                static = t["params"] + t["grads"] + t["optimizer"]
                print(f"| {kind} | {dtype} | {rows} x {a.seq} | {r['forecast'] / MiB:.0f} | "
                      f"{r['rannc'] / MiB:.0f} | {r['rannc'] / r['forecast']:.3f} | "
                      f"{r['plain'] / MiB:.0f} | {r['rannc'] / r['plain']:.3f} | {static / MiB:.0f} | "
                      f"{t['kept'] / MiB:.0f} | {t['work'] / MiB:.0f} | "
                      f"{r['loss_rannc']:.4f} / {r['loss_plain']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
