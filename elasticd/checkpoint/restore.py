"""Turning verified bytes back into state, and state into the caller's objects.

Deserialisation is ``torch.load(weights_only=True)``: storage is untrusted, and the
weights-only unpickler builds tensors and plain containers and refuses everything else.
Before any object is touched, the loaded state is checked against the template (keys and
tensor shapes), so an incompatible model fails with one line naming the mismatch instead
of a stack trace from inside ``load_state_dict``, and fails before half the state is
overwritten.
"""

from __future__ import annotations

import io
import re
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from elasticd.checkpoint.api import CheckpointCorruptError, CheckpointMismatchError
from elasticd.checkpoint.shards import is_dtensor
from elasticd.checkpoint.staging import unwrap
from elasticd.errors import ConfigError, ElasticdError

_SHOWN = 4  # mismatched names shown in an error; the count says how many more
# weights_only loading is bypassable before torch 2.6 and had memory-safety bugs fixed up to
# 2.10; pyproject requires >=2.10, and this refuses a forced older install at load time.
MIN_TORCH = (2, 10)
SUPPORTED_TORCH = "torch>=2.10,<2.15"


def torch_problem(version: str) -> str | None:
    """Why checkpoints must not be loaded under torch ``version``, or None if it is safe.

    Args:
        version: ``torch.__version__`` (``"2.13.0+cpu"``, ``"2.10.0a0+git1234"``).
    """
    m = re.match(r"^(\d+)\.(\d+)", version)
    if m is None:
        return f"torch version {version!r} cannot be parsed"
    found = (int(m.group(1)), int(m.group(2)))
    if found < MIN_TORCH:
        return (f"torch {version} is too old to load checkpoints safely: its "
                "torch.load(weights_only=True) can be bypassed or crash on crafted files "
                f"(fixed in {MIN_TORCH[0]}.{MIN_TORCH[1]})")
    return None


def require_safe_torch() -> None:
    """Refuse to load anything from storage under a torch whose weights_only is unsound.

    Raises:
        ConfigError: the running torch is older than 2.10 (names the fix).
    """
    problem = torch_problem(torch.__version__)
    if problem is not None:
        raise ConfigError(f"{problem}; install {SUPPORTED_TORCH} (pip install 'torch==2.13.0')")


def deserialize(data: bytes | bytearray, name: str) -> Any:
    """Load verified bytes with ``torch.load(weights_only=True)`` onto the CPU.

    Raises:
        CheckpointCorruptError: the bytes are not a torch file, or hold anything but
            tensors and plain containers.
        MemoryError, OSError: not corruption; the caller fails the load.
        ConfigError: torch older than 2.10 (:func:`require_safe_torch`).
    """
    # BytesIO over a bytes object shares its buffer instead of copying it.
    return _load(io.BytesIO(data if isinstance(data, bytes) else bytes(data)), name, mmap=False)


def deserialize_file(path: str, name: str) -> Any:
    """Load a verified local file memory-mapped: tensors are views of the page cache.

    The caller copies them into the template and drops them; that is one copy in total
    instead of three (read buffer, storages, template), and no fresh allocation to fault in.

    Raises:
        CheckpointCorruptError, MemoryError, OSError, ConfigError: as :func:`deserialize`
            (FileNotFoundError: the file vanished since it was verified).
    """
    return _load(path, name, mmap=True)


def _load(source: Any, name: str, *, mmap: bool) -> Any:
    require_safe_torch()
    try:
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except (MemoryError, OSError):
        # Out of memory or a failing disk says nothing about the bytes (already CRC-checked):
        # the caller fails the load instead of skipping to an older checkpoint.
        raise
    except Exception as exc:  # noqa: BLE001 - any failure on untrusted bytes means "corrupt"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointCorruptError(
            f"{name} could not be read by weights_only loading: {first}") from None


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def _module_mismatch(module: torch.nn.Module, value: Any) -> str | None:
    if not isinstance(value, Mapping):
        return f"holds a {type(value).__name__}, not a state dict"
    expected = module.state_dict()
    missing = [k for k in expected if k not in value]
    unexpected = [k for k in value if k not in expected]
    shapes = [f"{k} (checkpoint {list(value[k].shape)} vs model {list(t.shape)})"
              for k, t in expected.items()
              if k in value and isinstance(value[k], torch.Tensor) and value[k].shape != t.shape]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing keys: {_names(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected keys: {_names(unexpected)}")
    if shapes:
        problems.append(f"{len(shapes)} shape mismatches: {_names(shapes)}")
    return "; ".join(problems) or None


def _tensor_mismatches(target: Any, value: Any, path: str, out: list[str]) -> None:
    if isinstance(target, torch.Tensor):
        if not isinstance(value, torch.Tensor):
            out.append(f"{path} (checkpoint has a {type(value).__name__})")
        elif value.shape != target.shape:
            out.append(f"{path} (checkpoint {list(value.shape)} vs {list(target.shape)})")
    elif isinstance(target, Mapping) and isinstance(value, Mapping):
        for k, v in target.items():
            if k in value:
                _tensor_mismatches(v, value[k], f"{path}[{k!r}]", out)


def check_fits(template: Mapping[str, Any], loaded: Mapping[str, Any], where: str) -> None:
    """Raise if ``loaded`` cannot be applied to ``template``; touches nothing.

    Raises:
        CheckpointMismatchError: a template key is absent from the checkpoint, a module's
            keys or shapes differ, or a tensor in a dict has another shape.
    """
    for key, target in template.items():
        if key not in loaded:
            raise CheckpointMismatchError(
                f"{where} has no {key!r} (it holds {', '.join(sorted(loaded)) or 'nothing'}); "
                "load with a template whose keys match what was saved"
            )
        target, value = unwrap(target), loaded[key]
        if isinstance(target, torch.nn.Module):
            problem = _module_mismatch(target, value)
            if problem:
                raise CheckpointMismatchError(
                    f"{where} does not fit the model under {key!r}: {problem}. Was the "
                    "model changed, or does the URL/job point at another run's checkpoints?"
                )
        elif isinstance(target, (torch.Tensor, Mapping)):
            bad: list[str] = []
            _tensor_mismatches(target, value, key, bad)
            if bad:
                raise CheckpointMismatchError(
                    f"{where} does not fit {key!r}: {len(bad)} tensor mismatches: {_names(bad)}")


def owned(obj: Any) -> Any:
    """``obj`` with every tensor cloned, so nothing refers to a memory-mapped file.

    DTensors are kept as they are: the state file never holds one (the stager writes their
    shards apart), so each was assembled by the resharding load in private memory
    (``shards.fill``), and a copy would only double a sharded load's last pass."""
    if is_dtensor(obj):
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, Mapping):
        out: Any = type(obj)() if type(obj) in (dict, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = owned(v)
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out._metadata = meta
        return out
    if type(obj) in (list, tuple):
        return type(obj)(owned(v) for v in obj)
    return obj


def apply(template: MutableMapping[str, Any], loaded: Mapping[str, Any], where: str,
          *, mapped: bool = False) -> None:
    """Fill ``template`` in place from ``loaded`` (after :func:`check_fits`).

    Objects with ``load_state_dict`` get it called; tensors are copied into; dicts are
    merged (tensors copied into, other values replaced).

    Args:
        template: the caller's objects by key.
        loaded: the checkpoint's state.
        where: names the checkpoint in errors.
        mapped: ``loaded`` holds memory-mapped tensors: anything that would keep a
            reference to them gets a private copy instead. (Modules copy into their
            parameters; an optimizer's ``load_state_dict`` would keep the tensors as its
            state, and a mapped file deleted on another NFS client faults on access.)

    Raises:
        CheckpointMismatchError: as :func:`check_fits`, or an object's
            ``load_state_dict`` refused the state (message names the key and the object).
    """
    check_fits(template, loaded, where)
    keep = owned if mapped else _same
    for key, target in template.items():
        target, value = unwrap(target), loaded[key]
        if isinstance(target, torch.Tensor):
            with torch.no_grad():
                target.copy_(value)
        elif callable(getattr(target, "load_state_dict", None)):
            try:
                target.load_state_dict(value if isinstance(target, torch.nn.Module) else keep(value))
            except ElasticdError:
                raise  # already says what is wrong (e.g. the sampler's data order)
            except Exception as exc:  # noqa: BLE001 - wrapped with the key named
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
                raise CheckpointMismatchError(
                    f"{where}: {key!r} does not fit the {type(target).__name__} given: {first}"
                ) from exc
        elif isinstance(target, MutableMapping) and isinstance(value, Mapping):
            _merge(target, value, keep)


def _same(obj: Any) -> Any:
    return obj


def _merge(target: MutableMapping[Any, Any], value: Mapping[Any, Any], keep: Any) -> None:
    for k, v in value.items():
        current = target.get(k)
        if isinstance(current, torch.Tensor) and isinstance(v, torch.Tensor):
            with torch.no_grad():
                current.copy_(v)
        elif isinstance(current, MutableMapping) and isinstance(v, Mapping):
            _merge(current, v, keep)
        else:
            target[k] = keep(v)
