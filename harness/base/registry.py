"""One tiny registry per swept axis (objective, aggregation, noise): name -> builder.

`build` checks keyword arguments against the builder's signature before any compute, so a
config typo fails at start-up with the valid names.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


def register(table: dict[str, Callable], name: str) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        if name in table:
            raise KeyError(f"duplicate registry name {name!r}")
        table[name] = fn
        return fn

    return deco


def lookup(table: dict[str, Callable], name: str, what: str) -> Callable:
    if name not in table:
        raise KeyError(f"unknown {what} {name!r}; valid: {', '.join(sorted(table))}")
    return table[name]


def check_kwargs(fn: Callable, kwargs: dict[str, Any], what: str) -> None:
    """Raise TypeError naming the bad keys and the valid ones if `fn` would not accept `kwargs`."""
    sig = inspect.signature(fn)
    params = sig.parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    bad = sorted(set(kwargs) - set(valid))
    if bad:
        raise TypeError(f"{what}: unknown argument(s) {bad}; valid: {valid}")


def build(table: dict[str, Callable], name: str, what: str, **kwargs: Any) -> Any:
    fn = lookup(table, name, what)
    check_kwargs(fn, kwargs, f"{what} {name!r}")
    return fn(**kwargs)
