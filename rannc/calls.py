"""How rannc calls the model it wraps: the one keyword it adds to a user's call.

Its own module because the wrapper (`module.py`), the offline planner (`planner.plan`) and
`rannc.check`'s reference call all call the model so, and the planner must not import the
wrapper (that closes an import cycle: module -> deploy -> planner -> module).
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any

from torch import nn

log = logging.getLogger(__name__)

_SAID_CACHE_OFF: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def without_cache(model: nn.Module, kwargs: dict[str, Any], say: bool = True) -> dict[str, Any]:
    """`kwargs` with `use_cache=False` where a Hugging Face model's config asks for a key/value
    cache (`config.use_cache`: True in most pretrained configs) and the call passes neither
    `use_cache` nor a cache. Why: the cache is for generation, and its object is not a tensor
    rannc can split by rows, so every decoder loaded as it comes failed to capture until its
    user set use_cache=False by hand; transformers drops it the same way when it trains under
    gradient checkpointing. The outputs are the same but for the cache (`past_key_values` is
    None); said once per model, at INFO. A `use_cache=True` passed on purpose is kept (and
    refused at capture with the fix). `rannc.check` calls the unwrapped model so too."""
    if getattr(getattr(model, "config", None), "use_cache", None) is not True \
            or "use_cache" in kwargs or kwargs.get("past_key_values") is not None \
            or not _takes_keyword(model, "use_cache"):
        return kwargs
    if say and model not in _SAID_CACHE_OFF:
        _SAID_CACHE_OFF.add(model)
        log.info("rannc: calls %s with use_cache=False (its config.use_cache is True): a "
                 "key/value cache is for generation, so the outputs hold no past_key_values, "
                 "as under transformers' gradient checkpointing; set model.config.use_cache = "
                 "False to say so yourself", type(model).__name__)
    return {**kwargs, "use_cache": False}


def _takes_keyword(model: nn.Module, name: str) -> bool:
    """Whether `model.forward` names `name` (a PEFT model's base model's: PEFT's forward
    passes its **kwargs on). Not any **kwargs: most of transformers 5's forwards take them, an
    encoder's too (BertForPreTraining: it returns no cache, and its user would be told of one)."""
    base = getattr(model, "get_base_model", None)
    target = base() if callable(base) else model
    try:
        return name in inspect.signature(target.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature: leave its call as it is
        return False
