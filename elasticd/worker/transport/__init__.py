"""Live re-formation's state transports: one contract (:mod:`.api`), two implementations.

:mod:`.api` says what every transport must handle; :mod:`.tree` is the pytree skeleton
that every one of them moves tensors under; :mod:`.tcp` carries CPU tensors over plain
TCP (:mod:`elasticd.worker.transfer`), :mod:`.collective` any tensors through the process
group's own broadcast (gloo, NCCL). :func:`elasticd.worker.state_broadcast.broadcast_state`
picks one and runs it. Nothing is imported here: a submodule loads only what it needs.
"""
