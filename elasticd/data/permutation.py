"""A seeded permutation of ``[0, n)`` computed one position at a time.

Why not ``torch.randperm``: a shuffled epoch over 100M samples as an int64 tensor is 800 MB
per rank and ~1 s before the first index, and every rank of every restart pays it again.
An elastic sampler only ever needs the positions of *its* share of the next few global
batches, so we use a keyed bijection instead: ``index = P(position)`` costs O(1) memory and
any rank can evaluate any position without materialising the rest.

The bijection is a Feistel network over ``bits = bit_length(n - 1)`` bits (halves of
``ceil(bits/2)`` and ``floor(bits/2)`` bits, swapping widths each round) with the
``lowbias32`` integer hash as its round function, keyed by ``(seed, epoch, round)``. Feistel
networks are bijections for any round function; values that land in ``[n, 2**bits)`` are
walked through the network again ("cycle walking") until they fall inside ``[0, n)``,
which keeps it a bijection on ``[0, n)``. Because ``2**bits < 2n`` the expected number of
walks is below 2.

All tensor arithmetic stays below ``2**63`` so int64 never overflows (torch has no portable
wrapping unsigned 64-bit multiply); a pure-Python twin (:meth:`FeistelPermutation.index`)
computes the same function and pins the vectorised one in tests.

Changing anything here changes the data order of every existing checkpoint, so the
algorithm carries a name (:data:`PERMUTATION_ALGORITHM`) that sampler state records and
checks on load.
"""

from __future__ import annotations

import torch

PERMUTATION_ALGORITHM = "feistel6-lowbias32-v1"
"""Name of the permutation function, stored in sampler state; bump it on any change."""

MAX_DATASET_LEN = 1 << 62
"""Largest supported dataset: keeps every intermediate below 2**63 in int64 arithmetic."""

_ROUNDS = 6
# Below this many cycle-walking stragglers, walk them one by one in Python (measured).
_SCALAR_WALK_BELOW = 64
_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
# lowbias32 (Chris Wellons' hash-prospector) multiplies by 0x7FEB352D and 0x846CA68B modulo
# 2**32. The second constant is >= 2**31, so x * c could reach 2**64 and overflow int64;
# x * 0x846CA68B == x * 0x046CA68B + (x & 1) * 2**31 (mod 2**32) keeps every product < 2**63.
_MUL1 = 0x7FEB352D
_MUL2_LOW = 0x046CA68B
_MUL2 = 0x846CA68B


def _splitmix64(x: int) -> int:
    """One step of SplitMix64: a well-mixed 64-bit value from any integer."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def round_keys(seed: int, epoch: int, rounds: int = _ROUNDS) -> tuple[int, ...]:
    """Derive the 32-bit Feistel round keys for one (seed, epoch).

    Args:
        seed: Any Python int (negative and huge values are folded into 64 bits).
        epoch: The epoch number.
        rounds: How many keys to derive.

    Returns:
        ``rounds`` 32-bit keys; different (seed, epoch) pairs give unrelated keys.
    """
    state = _splitmix64(_splitmix64(seed & _MASK64) ^ (epoch & _MASK64))
    keys = []
    for _ in range(rounds):
        state = _splitmix64(state)
        keys.append(state & _MASK32)
    return tuple(keys)


def _lowbias32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * _MUL1) & _MASK32
    x ^= x >> 15
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 16)


def _lowbias32_tensor(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2_LOW + ((x & 1) << 31)) & _MASK32
    return x ^ (x >> 16)


class FeistelPermutation:
    """A pseudo-random bijection of ``[0, n)`` determined by ``(n, seed, epoch)`` only.

    ``perm(positions)`` maps an int64 tensor of positions in ``[0, n)`` to sample indices
    in ``[0, n)``; memory is proportional to the tensor passed in, never to ``n``.
    """

    def __init__(self, n: int, *, seed: int, epoch: int) -> None:
        """Build the permutation.

        Args:
            n: Size of the domain, ``1 <= n <= 2**62``.
            seed: Shuffle seed (any int).
            epoch: Epoch number; each epoch gets an unrelated permutation.

        Raises:
            ValueError: ``n`` is out of range.
        """
        if not 1 <= n <= MAX_DATASET_LEN:
            raise ValueError(f"permutation size must be in [1, 2**62], got {n}")
        self.n = n
        # At least 2 bits so both Feistel halves are non-empty; cycle walking absorbs the rest.
        self._bits = max(2, (n - 1).bit_length())
        self._keys = round_keys(seed, epoch)

    def _feistel_int(self, x: int) -> int:
        left_w = self._bits - self._bits // 2
        right_w = self._bits // 2
        left, right = x >> right_w, x & ((1 << right_w) - 1)
        for key in self._keys:
            # (L[lw], R[rw]) -> (R[rw], L ^ F(R)[lw]): invertible whatever F is.
            f = _lowbias32_int((right ^ key) & _MASK32) & ((1 << left_w) - 1)
            left, right = right, left ^ f
            left_w, right_w = right_w, left_w
        return (left << right_w) | right

    def _feistel_tensor(self, x: torch.Tensor) -> torch.Tensor:
        left_w = self._bits - self._bits // 2
        right_w = self._bits // 2
        left, right = x >> right_w, x & ((1 << right_w) - 1)
        for key in self._keys:
            # right < 2**31 and key < 2**32, so right ^ key is already a 32-bit value.
            f = _lowbias32_tensor(right ^ key) & ((1 << left_w) - 1)
            left, right = right, left ^ f
            left_w, right_w = right_w, left_w
        return (left << right_w) | right

    def index(self, position: int) -> int:
        """Sample index at ``position`` (pure Python; the reference for :meth:`__call__`).

        Raises:
            IndexError: ``position`` is outside ``[0, n)``.
        """
        if not 0 <= position < self.n:
            raise IndexError(f"position {position} outside [0, {self.n})")
        if self.n == 1:
            return 0
        x = self._feistel_int(position)
        while x >= self.n:
            x = self._feistel_int(x)
        return x

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        """Sample indices for an int64 tensor of positions in ``[0, n)`` (any shape).

        Returns:
            A new int64 tensor of the same shape. Positions are not range-checked here
            (callers compute them); out-of-range input gives unspecified output.
        """
        if self.n == 1:
            return torch.zeros_like(positions)
        out = self._feistel_tensor(positions.reshape(-1))
        # Cycle walking: re-encrypt only the stragglers. Each pass leaves fewer than half of
        # them outside on average, but a tensor pass costs ~100 small-op launches whatever
        # its size, so the last few stragglers are cheaper to walk in plain Python.
        pending = (out >= self.n).nonzero().reshape(-1)
        while pending.numel() > _SCALAR_WALK_BELOW:
            walked = self._feistel_tensor(out[pending])
            out[pending] = walked
            pending = pending[walked >= self.n]
        for i in pending.tolist():
            x = self._feistel_int(int(out[i]))
            while x >= self.n:
                x = self._feistel_int(x)
            out[i] = x
        return out.reshape(positions.shape)
