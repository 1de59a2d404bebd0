"""The state's skeleton: one walk of nested training state, with torch's pytree utilities.

Every part of elasticd that takes a state tree apart walks it here: the checkpoint stager
(tensors copied into host buffers, each DTensor left to the shard files), the shard reader
(each DTensor put back at its place) and the live state transports (tensors replaced by
their metadata). A leaf's place is its pytree key path as a string rooted at ``state``
(``state['model']['w']``, ``state['optim']['param_groups'][0]``): the same string names a
DTensor in the shard indexes, so a saved shard finds its place by path, with no tag
written into the state.

Two walks:

- *pytree* (``plain=False``): every container torch's pytree knows (dicts, lists, tuples,
  named tuples, ordered and default dicts, ``torch.Size``...). The transports use it:
  the state is rebuilt as it was.
- *plain* (``plain=True``): only what ``torch.load(weights_only=True)`` reads back is a
  container (exactly ``dict``, ``OrderedDict``, ``list``, ``tuple``); any other mapping is
  walked as a ``dict``; anything else is a leaf. Checkpoints use it, so an unloadable value
  is a leaf the stager can name and refuse.

Containers are rebuilt by pytree, which drops attributes; ``nn.Module.state_dict()`` keeps
per-module versions in its ``_metadata`` attribute (``load_state_dict`` uses them), so
:func:`map_leaves` carries it over.

Pure: no I/O, no process group.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from torch.utils import _pytree as pytree

ROOT = "state"
PLAIN_CONTAINERS: tuple[type, ...] = (dict, OrderedDict, list, tuple)

Leaf = tuple[str, Any]


def _stop(plain: bool, stop: Callable[[Any], bool] | None) -> Callable[[Any], bool] | None:
    if not plain:
        return stop
    if stop is None:
        return lambda x: type(x) not in PLAIN_CONTAINERS
    return lambda x: type(x) not in PLAIN_CONTAINERS or stop(x)


def leaves_with_paths(state: Any, *, plain: bool = False, root: str = ROOT,
                      stop: Callable[[Any], bool] | None = None) -> list[Leaf]:
    """Every leaf of ``state`` with its path, in pytree order.

    Args:
        state: the tree.
        plain: walk only the containers safe loading reads back (see the module docstring).
        root: the path of ``state`` itself.
        stop: containers to treat as leaves (a reader's legacy placeholders, say).
    """
    pairs, _ = pytree.tree_flatten_with_path(state, is_leaf=_stop(plain, stop))
    out: list[Leaf] = []
    for keys, leaf in pairs:
        path = root + pytree.keystr(keys)
        if plain and isinstance(leaf, Mapping) and type(leaf) not in PLAIN_CONTAINERS and not (
                stop is not None and stop(leaf)):
            out.extend(leaves_with_paths(dict(leaf), plain=True, root=path, stop=stop))
        else:
            out.append((path, leaf))
    return out


def map_leaves(state: Any, fn: Callable[[str, Any], Any], *, plain: bool = False,
               root: str = ROOT, stop: Callable[[Any], bool] | None = None) -> Any:
    """``state`` rebuilt with each leaf replaced by ``fn(path, leaf)``.

    Containers come back of their own type (plain: a mapping of another type comes back
    as a ``dict``), with ``_metadata`` carried over. Arguments as :func:`leaves_with_paths`.
    """
    pairs, spec = pytree.tree_flatten_with_path(state, is_leaf=_stop(plain, stop))
    out: list[Any] = []
    for keys, leaf in pairs:
        path = root + pytree.keystr(keys)
        if plain and isinstance(leaf, Mapping) and type(leaf) not in PLAIN_CONTAINERS and not (
                stop is not None and stop(leaf)):
            out.append(map_leaves(dict(leaf), fn, plain=True, root=path, stop=stop))
        else:
            out.append(fn(path, leaf))
    rebuilt = pytree.tree_unflatten(out, spec)
    _carry_metadata(state, rebuilt)
    return rebuilt


def _carry_metadata(src: Any, dst: Any) -> None:
    """Copy ``_metadata`` from each mapping of ``src`` to its rebuilt twin in ``dst``.

    Visits containers only (a second pytree walk with key paths costs more than the walk).
    """
    if isinstance(src, Mapping):
        if not isinstance(dst, Mapping):
            return  # a leaf replaced it
        meta = getattr(src, "_metadata", None)
        if meta is not None:
            dst._metadata = copy.deepcopy(meta)  # type: ignore[attr-defined]
        pairs: Any = ((value, dst[key]) for key, value in src.items() if key in dst)
    elif isinstance(src, (list, tuple)) and isinstance(dst, (list, tuple)) and len(src) == len(dst):
        pairs = zip(src, dst, strict=True)
    else:
        return
    for child, twin in pairs:
        if isinstance(child, (Mapping, list, tuple)):
            _carry_metadata(child, twin)
