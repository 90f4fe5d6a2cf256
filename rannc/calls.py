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
    refused at capture with the fix). `rannc.check` calls the unwrapped model so too.
    A vision-language model (Llava, PaliGemma, Qwen2-VL: a config of configs) has no
    `use_cache` of its own: its language model's config asks, and its forward passes the
    keyword on through **kwargs."""
    asking = None if "use_cache" in kwargs or kwargs.get("past_key_values") is not None \
        else _asking_for_a_cache(model)
    if asking is None:
        return kwargs
    if say and model not in _SAID_CACHE_OFF:
        _SAID_CACHE_OFF.add(model)
        log.info("rannc: calls %s with use_cache=False (its %s.use_cache is True): a "
                 "key/value cache is for generation, so the outputs hold no past_key_values, "
                 "as under transformers' gradient checkpointing; set model.%s.use_cache = "
                 "False to say so yourself", type(model).__name__, asking, asking)
    return {**kwargs, "use_cache": False}


def _asking_for_a_cache(model: nn.Module) -> str | None:
    """Which config of `model` makes a call without `use_cache` return a key/value cache, as
    `model.`'s attribute path ("config", "config.text_config"), or None: its config asks for
    one and its forward takes the keyword -- or, for a model whose config has no `use_cache`
    of its own (a config of configs), its language model's config
    (`get_text_config(decoder=True)`) asks, a module inside with that config names the keyword,
    and the model's forward takes **kwargs to pass it on. (CLIP and SigLIP: no such module.)"""
    config = getattr(model, "config", None)
    own = getattr(config, "use_cache", None)
    if own is not None:
        return "config" if own is True and _takes_keyword(model, "use_cache") else None
    text_config = getattr(config, "get_text_config", None)
    text = text_config(decoder=True) if callable(text_config) else None
    if getattr(text, "use_cache", None) is not True or not _takes_keywords(model):
        return None
    if not any(getattr(m, "config", None) is text and _takes_keyword(m, "use_cache")
               for m in model.modules()):
        return None
    path = next((f"config.{k}" for k, v in vars(config).items() if v is text), None)
    return path or "config.get_text_config()"


def _forward_of(model: nn.Module) -> Any:
    """The forward that takes the call's keywords: a PEFT model's base model's (PEFT's forward
    passes its **kwargs on)."""
    base = getattr(model, "get_base_model", None)
    return (base() if callable(base) else model).forward


def _takes_keywords(model: nn.Module) -> bool:
    """Whether `model.forward` takes **kwargs."""
    try:
        params = inspect.signature(_forward_of(model)).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _takes_keyword(model: nn.Module, name: str) -> bool:
    """Whether `model.forward` names `name` (a PEFT model's base model's: PEFT's forward
    passes its **kwargs on). Not any **kwargs: most of transformers 5's forwards take them, an
    encoder's too (BertForPreTraining: it returns no cache, and its user would be told of one)."""
    try:
        return name in inspect.signature(_forward_of(model)).parameters
    except (TypeError, ValueError):  # a forward without a signature: leave its call as it is
        return False
