"""The private parts of torch elastic that elasticd relies on, checked in one place.

elasticd subclasses torch's ``LocalElasticAgent`` (and its ``SubprocessHandler`` for warm
standbys) and so overrides or calls some of their private methods and attributes. A torch
upgrade that renames or reshapes one of them must fail here, with the name, rather than
as a silent change of behaviour. Two tests keep the list honest:

- ``test_every_private_torch_name_elasticd_touches_is_listed`` reads elasticd's source
  (AST) and finds every private name of a torch base class that elasticd's subclasses
  override, call or read; each must be in :data:`CONTRACT`;
- ``test_listed_private_names_exist_with_the_expected_signature`` checks each listed name
  on the installed torch: methods by their parameter names, attributes by the base
  class's ``__init__`` assigning them.

Tested torch versions: see docs/architecture.md ("torch contract").
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "elasticd"

LOCAL_AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent"
SUBPROCESS_HANDLER = ("torch.distributed.elastic.multiprocessing.subprocess_handler."
                      "subprocess_handler.SubprocessHandler")

# "<torch class>:<name>" -> parameter names of the method (without self), or None for an
# instance attribute set by the class (or a base) in __init__.
CONTRACT: dict[str, tuple[str, ...] | None] = {
    f"{LOCAL_AGENT}:_invoke_run": ("role",),
    f"{LOCAL_AGENT}:_start_workers": ("worker_group",),
    f"{LOCAL_AGENT}:_stop_workers": ("worker_group",),
    f"{LOCAL_AGENT}:_monitor_workers": ("worker_group",),
    f"{LOCAL_AGENT}:_rendezvous": ("worker_group",),
    f"{LOCAL_AGENT}:_initialize_workers": ("worker_group",),
    f"{LOCAL_AGENT}:_restart_workers": ("worker_group",),
    f"{LOCAL_AGENT}:_exit_barrier": (),
    f"{LOCAL_AGENT}:_record_worker_events": ("result",),
    f"{LOCAL_AGENT}:_worker_group": None,
    f"{LOCAL_AGENT}:_remaining_restarts": None,
    f"{LOCAL_AGENT}:_pcontext": None,
    f"{SUBPROCESS_HANDLER}:_popen": ("args", "env"),
    f"{SUBPROCESS_HANDLER}:_stdout": None,
    f"{SUBPROCESS_HANDLER}:_stderr": None,
}
# Module-level hooks replaced or read (module path: attribute).
MODULE_HOOKS = {
    "torch.distributed.elastic.multiprocessing.api": "get_subprocess_handler",
}


def _resolve(dotted: str) -> type:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _torch_bases(tree: ast.Module) -> dict[str, str]:
    """Names bound by ``from torch... import X`` in a module -> their full dotted path."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            for alias in node.names:
                out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return out


def _private_uses(cls: ast.ClassDef) -> set[str]:
    """Private names a class defines or reaches through ``self.``/``super().``."""
    names = set()
    for node in ast.walk(cls):
        if (isinstance(node, ast.FunctionDef) and node.name.startswith("_")
                and not node.name.startswith("__")):
            names.add(node.name)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            value = node.value
            is_self = isinstance(value, ast.Name) and value.id == "self"
            is_super = (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                        and value.func.id == "super")
            if is_self or is_super:
                names.add(node.attr)
    return names


def _discovered() -> set[str]:
    found = set()
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        torch_names = _torch_bases(tree)
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            for base in cls.bases:
                if not (isinstance(base, ast.Name) and base.id in torch_names):
                    continue
                base_path = torch_names[base.id]
                base_cls = _resolve(base_path)
                canonical = f"{base_cls.__module__}.{base_cls.__qualname__}"
                init_src = "".join(inspect.getsource(k.__init__) for k in base_cls.__mro__
                                   if k.__module__.startswith("torch") and "__init__" in k.__dict__)
                for name in _private_uses(cls):
                    if hasattr(base_cls, name) or f"self.{name} " in init_src or f"self.{name}:" in init_src:
                        found.add(f"{canonical}:{name}")
    return found


def test_every_private_torch_name_elasticd_touches_is_listed():
    """A private torch name used anywhere in elasticd/ without a CONTRACT entry fails here."""
    missing = _discovered() - set(CONTRACT)
    assert not missing, f"add these to CONTRACT (and check them on every torch upgrade): {sorted(missing)}"


def test_contract_lists_nothing_elasticd_no_longer_uses():
    """CONTRACT shrinks when elasticd stops relying on a private name."""
    stale = set(CONTRACT) - _discovered()
    assert not stale, f"no longer used, remove from CONTRACT: {sorted(stale)}"


@pytest.mark.parametrize("entry", sorted(CONTRACT))
def test_listed_private_names_exist_with_the_expected_signature(entry):
    """Each private torch name elasticd relies on exists on the installed torch, methods
    with the parameters elasticd passes, attributes assigned by the class's __init__."""
    class_path, _, name = entry.partition(":")
    cls = _resolve(class_path)
    expected = CONTRACT[entry]
    if expected is None:
        init_src = "".join(inspect.getsource(k.__init__) for k in cls.__mro__
                           if k.__module__.startswith("torch") and "__init__" in k.__dict__)
        assert f"self.{name}" in init_src, f"{entry}: no longer set in __init__"
        return
    attr = getattr(cls, name, None)
    assert callable(attr), f"{entry}: gone from torch {importlib.import_module('torch').__version__}"
    params = tuple(p for p in inspect.signature(attr).parameters if p != "self")
    assert params == expected, f"{entry}: signature is now {params}"


@pytest.mark.parametrize(("module", "attr"), sorted(MODULE_HOOKS.items()))
def test_module_hooks_exist(module, attr):
    """Module-level functions elasticd swaps (warm standbys) are still there."""
    assert callable(getattr(importlib.import_module(module), attr, None)), f"{module}.{attr}"


# --- private names of torch modules (the worker half, checkpoints, teardown, warm imports) ---

# "<torch module>:<name>" -> what elasticd needs of it: "callable", "module", or "attr:<a>"
# (an object with attribute <a>). Found by test_every_private_torch_module_name_is_listed:
# imports of private modules or names, names reached through an import alias (``dist.`` ...)
# or a getattr with a private string, and private module names in strings ("torch._dynamo").
PRIVATE_MODULE_NAMES: dict[str, str] = {
    # worker/live_sharded.py: the round's store, for the FSDP2 peer replica's tickets and index exchange
    "torch.distributed.distributed_c10d:_get_default_store": "callable",
    # teardown.py: the groups a script's destroy_process_group would tear down under us
    "torch.distributed.distributed_c10d:_world": "attr:pg_map",
    # worker/sharded.py: a new round's mesh must not reuse a cached spec of the old one
    "torch.distributed.tensor.debug:_clear_python_sharding_prop_cache": "callable",
    "torch.distributed.tensor.debug:_clear_fast_path_sharding_prop_cache": "callable",
    # checkpoint/skeleton.py: the one walk of nested state
    "torch.utils:_pytree": "module",
    "torch.utils._pytree:tree_flatten": "callable",
    "torch.utils._pytree:tree_flatten_with_path": "callable",
    "torch.utils._pytree:TreeSpec": "attr:children",  # and is_leaf, type, context, num_children
    "torch.utils._pytree:tree_unflatten": "callable",
    "torch.utils._pytree:keystr": "callable",
    # agent/warm.py, teardown.py: imported ahead of the script (DDP's first use imports it)
    "torch:_dynamo": "module",
    # worker/context.py: every group torch creates, wrapped to record the sockets it opens
    "torch.distributed.distributed_c10d:_new_process_group_helper": "callable",
    # worker/process_group.py: the default group a reconfigure re-forms in place
    "torch.distributed.distributed_c10d:_get_default_group": "callable",
    # worker/process_group.py: torch 2.14's c10d reconfigure (ReconfigureLifecycle; older
    # torch takes the rebuild path, which choose_lifecycle says)
    "torch.distributed.distributed_c10d:_get_reconfigure_handle": "callable-since:2.14",
    "torch.distributed.distributed_c10d:_reconfigure": "callable-since:2.14",
}
# Module aliases that are variables, not imports (teardown.py looks the module up lazily).
_VARIABLE_ALIASES = {"c10d": "torch.distributed.distributed_c10d"}
_PRIVATE_MODULE_RE = re.compile(r"^torch(\.[A-Za-z0-9_]+)*\._[A-Za-z0-9_]+$")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Names bound to torch modules or objects by imports -> their dotted path."""
    out = dict(_VARIABLE_ALIASES)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    out[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else "torch")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return out


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _entry(dotted: str) -> str | None:
    """``a.b._c.d`` -> ``a.b._c:d``; ``a._b`` -> ``a:_b``; None without a private part."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if _private(part):
            if i + 1 < len(parts) and importlib.util.find_spec(".".join(parts[:i + 1])) is not None:
                return f"{'.'.join(parts[:i + 1])}:{parts[i + 1]}"
            return f"{'.'.join(parts[:i])}:{part}"
    return None


def _private_module_names() -> set[str]:
    found = set()
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        aliases = _aliases(tree)
        for node in ast.walk(tree):
            dotted = None
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                for alias in node.names:
                    entry = _entry(f"{node.module}.{alias.name}")
                    if entry:
                        found.add(entry)
            elif isinstance(node, ast.Attribute):
                dotted = _dotted(node, aliases)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                base = _dotted(node.args[0], aliases)
                dotted = None if base is None else f"{base}.{node.args[1].value}"
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and _PRIVATE_MODULE_RE.match(node.value)):
                dotted = node.value
            entry = _entry(dotted) if dotted else None
            if entry:
                found.add(entry)
    return found


def test_every_private_torch_module_name_is_listed():
    """A private torch module or module-level name used anywhere in elasticd/ (an import,
    an alias's attribute, a getattr string, a module named in a string) must be in
    PRIVATE_MODULE_NAMES, and the list holds nothing elasticd no longer uses."""
    found = _private_module_names()
    missing, stale = found - set(PRIVATE_MODULE_NAMES), set(PRIVATE_MODULE_NAMES) - found
    assert not missing, f"add to PRIVATE_MODULE_NAMES (check on every torch upgrade): {sorted(missing)}"
    assert not stale, f"no longer used, remove from PRIVATE_MODULE_NAMES: {sorted(stale)}"


@pytest.mark.parametrize("entry", sorted(PRIVATE_MODULE_NAMES))
def test_private_module_names_exist_on_this_torch(entry):
    """Each private torch module name elasticd uses exists on the installed torch, as
    what elasticd needs it to be (a callable, a module, an object with an attribute)."""
    module, _, name = entry.partition(":")
    need = PRIVATE_MODULE_NAMES[entry]
    if need == "module":
        assert importlib.util.find_spec(f"{module}.{name}") is not None, f"{entry}: gone"
        return
    value = getattr(importlib.import_module(module), name, None)
    if need.startswith("callable-since:"):
        import torch

        since = tuple(int(x) for x in need.removeprefix("callable-since:").split("."))
        have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
        # Older torch: absent is expected (the lifecycle falls back to a rebuild); present
        # but not callable would mislead that check.
        assert callable(value) if have >= since else value is None or callable(value), \
            f"{entry}: gone or not callable on torch {torch.__version__}"
        return
    if need == "callable":
        assert callable(value), f"{entry}: gone or not callable"
    else:
        attr = need.removeprefix("attr:")
        assert value is not None and hasattr(value, attr), f"{entry}: gone or has no {attr}"


# Private attributes of torch *objects* (not modules) that the worker half reads by name
# (``getattr(obj, "_x")``): the alias walk above cannot tell their owner, so each is named
# here with where it lives on the installed torch and what elasticd needs of it.
WORKER_PRIVATE_ATTRIBUTES: dict[str, str] = {
    # worker/loop.py (shutdown_loader): stop a multi-process DataLoader's workers before a
    # fast exit or after a re-formation (their prefetched shares are the old world's)
    "_shutdown_workers": "torch.utils.data.dataloader._MultiProcessingDataLoaderIter",
    # worker/loop.py (_scheduled): torch's LRScheduler marks the optimizer.step it wraps
    "_wrapped_by_lr_sched": "torch.optim.lr_scheduler.LRScheduler",
}


def _worker_private_attribute_strings() -> set[str]:
    """Private names given as strings to getattr/hasattr on a non-torch-module object in
    elasticd/worker (torch module names are PRIVATE_MODULE_NAMES' business)."""
    found = set()
    for path in (ROOT / "worker").rglob("*.py"):
        tree = ast.parse(path.read_text())
        aliases = _aliases(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                    and _private(node.args[1].value) and _dotted(node.args[0], aliases) is None):
                found.add(node.args[1].value)
    return found


@pytest.mark.timeout(60)
def test_every_private_attribute_the_worker_half_reads_by_name_is_listed():
    """A private torch attribute read by name in elasticd/worker is in WORKER_PRIVATE_ATTRIBUTES, and nothing stale is."""
    found = _worker_private_attribute_strings()
    missing, stale = found - set(WORKER_PRIVATE_ATTRIBUTES), set(WORKER_PRIVATE_ATTRIBUTES) - found
    assert not missing, f"add to WORKER_PRIVATE_ATTRIBUTES (check on every torch upgrade): {sorted(missing)}"
    assert not stale, f"no longer used, remove from WORKER_PRIVATE_ATTRIBUTES: {sorted(stale)}"


@pytest.mark.timeout(60)
def test_worker_private_attributes_exist_on_this_torch():
    """A multi-process DataLoader iterator has a callable _shutdown_workers, and an LR
    scheduler marks the optimizer.step it wraps with _wrapped_by_lr_sched."""
    import torch
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    assert callable(getattr(_MultiProcessingDataLoaderIter, "_shutdown_workers", None))
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert not getattr(optimizer.step, "_wrapped_by_lr_sched", False)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    assert getattr(optimizer.step, "_wrapped_by_lr_sched", False) is True


def test_state_dicts_carry_their_module_versions_in_metadata():
    """``nn.Module.state_dict()`` keeps per-module versions in ``_metadata`` (the stager,
    the skeleton and restore carry it; ``load_state_dict`` reads it) and a DTensor names
    its box through ``__create_chunk_list__`` (the shard files)."""
    import torch
    from torch.distributed.tensor import DTensor

    sd = torch.nn.Sequential(torch.nn.BatchNorm1d(2)).state_dict()
    assert sd._metadata["0"]["version"] >= 1  # type: ignore[attr-defined]
    assert callable(getattr(DTensor, "__create_chunk_list__", None))


# --- behaviour relied on, beyond names ----------------------------------------------------


class _OneNodeHandler:
    """A rendezvous handler that forms a one-node round over an in-process store."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.store = dist.HashStore()
        self.round = 0

    def next_rendezvous(self):  # noqa: ANN201 - torch's RendezvousInfo
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

        self.round += 1
        return RendezvousInfo(self.store, 0, 1, RendezvousStoreInfo("127.0.0.1", 29500 + self.round))

    def get_backend(self) -> str:
        return "static"

    def get_run_id(self) -> str:
        return "contract"

    def shutdown(self) -> bool:
        return True


def test_rendezvous_replaces_the_workers_and_forgets_their_pids(tmp_path):
    """torch's ``_rendezvous`` gives the group new ``Worker`` objects (ranks assigned, ``id``
    None) and its monitor reports UNKNOWN while the ids do not match the running pids: a
    live re-formation (workers kept) must give each new Worker its pid back, which
    ``TorchWorkerGroup`` does, after which the monitor sees the workers again."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    from elasticd.agent.worker_group import TorchWorkerGroup

    handler = _OneNodeHandler()
    spec = WorkerSpec(role="trainer", local_world_size=2, rdzv_handler=handler,  # type: ignore[arg-type]
                      entrypoint="true", max_restarts=0)
    agent = LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)))
    wg = agent._worker_group
    agent._rendezvous(wg)
    first = list(wg.workers)
    for w, pid in zip(first, (4101, 4102), strict=True):
        w.id = pid  # as torch's _start_workers sets them
    pids = {0: 4101, 1: 4102}
    agent._pcontext = SimpleNamespace(pids=lambda: pids, wait=lambda *_: None)  # type: ignore[assignment]

    agent._rendezvous(wg)  # torch's own: the running processes are forgotten
    assert all(a is not b for a, b in zip(first, wg.workers, strict=True))
    assert [w.id for w in wg.workers] == [None, None]
    assert [w.local_rank for w in wg.workers] == [0, 1] and wg.workers[1].global_rank == 1
    assert agent._monitor_workers(wg).state is WorkerState.UNKNOWN

    port = TorchWorkerGroup(wg, agent._rendezvous, lambda: pids, lambda: handler.round)
    order = port.rejoin_keeping_workers()
    assert [w.id for w in wg.workers] == [4101, 4102]
    assert order.round == handler.round and order.ranks == {0: 0, 1: 1} and order.world_size == 2
    assert (order.master_addr, order.master_port) == ("127.0.0.1", 29500 + handler.round)
    assert agent._monitor_workers(wg).state is WorkerState.HEALTHY  # wait(0) None: running
