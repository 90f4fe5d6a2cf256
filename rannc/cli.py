"""`rannc plan`: plan a model for a cluster you may not have (a dry run), from a factory.

    rannc plan examples/models/bert_factory.py:bert_large --devices 32 --per-node 8 \\
        --device V100-32GB --batch-size 256 --out plan.json --onnx plan.onnx

FACTORY is a function in FILE.py, or in an importable module named with dots
(`rannc plan mypackage.models:bert_large ...`, imported as `python -m` would). It is called
under `torch.device("meta")`, so the model and any tensors it creates cost no memory, with
`batch_size=B` when it takes that argument, and returns `(model, args, kwargs)` or
`(model, kwargs)`: the model and an example GLOBAL batch.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import logging
import sys
import time
from pathlib import Path
from typing import Any

from rannc.config import Config
from rannc.errors import ConfigError, RaNNCError


def load_factory(spec: str) -> Any:
    """The function `spec` names: `FILE.py:FACTORY` (a file path) or `module.path:FACTORY`."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise SystemExit(f"rannc plan: expected FILE.py:FACTORY or module:FACTORY, got {spec!r}")
    file = Path(path)
    if file.is_file():
        module = _module_from_file(file)
    elif path.endswith(".py") or "/" in path or "\\" in path:
        raise SystemExit(f"rannc plan: no such file {path!r}")
    else:
        try:
            module = importlib.import_module(path)
        except ImportError as e:
            raise SystemExit(f"rannc plan: cannot import module {path!r} ({e}); give FILE.py:FACTORY "
                             "for a file, or install the package that holds the module") from e
    factory = getattr(module, name, None)
    if not callable(factory):
        raise SystemExit(f"rannc plan: {path} has no function {name!r}")
    return factory


def _module_from_file(file: Path) -> Any:
    mod_spec = importlib.util.spec_from_file_location(file.stem, file)
    if mod_spec is None or mod_spec.loader is None:
        raise SystemExit(f"rannc plan: cannot load {str(file)!r} as a Python module")
    module = importlib.util.module_from_spec(mod_spec)
    sys.path.insert(0, str(file.resolve().parent))
    mod_spec.loader.exec_module(module)
    return module


def version() -> str:
    """The installed distribution's version (the package's own when run from a source tree)."""
    from importlib import metadata

    try:
        return metadata.version("rannc")
    except metadata.PackageNotFoundError:
        import rannc

        return rannc.__version__


def build(factory: Any, batch_size: int) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    import torch

    with torch.device("meta"):
        takes_batch = "batch_size" in inspect.signature(factory).parameters
        out = factory(batch_size=batch_size) if takes_batch else factory()
    if isinstance(out, tuple) and len(out) == 3:
        return out[0], tuple(out[1]), dict(out[2])
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        return out[0], (), dict(out[1])
    raise SystemExit("rannc plan: the factory must return (model, args, kwargs) or (model, kwargs)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rannc", description="rannc command line")
    p.add_argument("--version", action="version", version=f"rannc {version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("plan", help="plan a model for a cluster (dry run)")
    pp.add_argument("factory", help="FILE.py:FACTORY or module.path:FACTORY")
    pp.add_argument("--devices", type=int, default=0)
    pp.add_argument("--per-node", type=int, default=None)
    pp.add_argument("--device", default="V100-32GB", help="a known device name, or 'local'")
    pp.add_argument("--cluster", default=None,
                    help="a JSON cluster file (mixed devices, see rannc.Cluster.load) instead of "
                         "--devices/--per-node/--device")
    pp.add_argument("--batch-size", type=int, required=True, help="the global batch size")
    pp.add_argument("--out", default=None, help="write the plan as JSON here")
    pp.add_argument("--onnx", default=None, help="write the partitioned graph as ONNX here")
    pp.add_argument("--timeline", default=None,
                    help="draw the simulator's predicted timeline of one iteration as a PNG here")
    pp.add_argument("--config", default=None, help="Config fields as JSON, e.g. '{\"blocks\": 64}'")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)

    import json

    from rannc.planner import PlanStats, plan
    from rannc.profile.device import Cluster

    try:
        cfg = Config.resolve(None, **(json.loads(a.config) if a.config else {}))
        if a.cluster:
            cluster = Cluster.load(a.cluster)
        elif a.devices < 1:
            raise ConfigError("give --devices N (with --device and --per-node) or --cluster FILE")
        else:
            cluster = Cluster.homogeneous(a.device, n=a.devices, per_node=a.per_node or a.devices)
        t0 = time.perf_counter()
        model, args, kwargs = build(load_factory(a.factory), a.batch_size)
        stats = PlanStats()
        result = plan(model, args, kwargs, cluster=cluster, config=cfg, stats=stats)
    except RaNNCError as e:
        print(f"rannc plan: {e}", file=sys.stderr)
        return 1
    print(result.summary())
    steps = ", ".join(f"{k} {v:.2f} s" for k, v in stats.seconds.items())
    print(f"planned in {time.perf_counter() - t0:.1f} s ({steps}); {stats.components} atomic "
          f"components, {stats.blocks} blocks, {stats.candidates} candidate plans")
    if a.out:
        result.save(a.out)
        print(f"plan written to {a.out}")
    if a.timeline:
        from rannc.schedule import timeline_png
        from rannc.schedule.predict import predict

        tl = predict(result)
        where = a.cluster or f"{a.devices} x {a.device}"
        timeline_png(a.timeline, predicted=tl, title=f"{a.factory} on {where}, "
                     f"schedule {result.schedule}")
        print(f"predicted timeline written to {a.timeline} (bubble ratio {tl.bubble_ratio:.2f})")
    if a.onnx:
        result.to_onnx(a.onnx)
        print(f"partitioned graph written to {a.onnx} (open it in https://netron.app)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
