"""A seeded permutation of ``[0, n)`` computed one position at a time.

Why not ``torch.randperm``: a shuffled epoch over 100M samples as an int64 tensor is 800 MB
per rank and ~1 s before the first index, and every rank of every restart pays it again.
An elastic sampler only ever needs the positions of *its* share of the next few global
batches, so we use a keyed bijection instead: ``index = P(position)`` costs O(1) memory and
any rank can evaluate any position without materialising the rest.

The bijection is a Feistel network over a mixed-radix domain ``[0, a*b)`` with
``a = ceil(sqrt(n))`` and ``b = ceil(n / a)``: a position is split into ``(L, R) = divmod(x,
b)`` and each round maps ``(L mod a, R mod b)`` to ``(R, (L + F(R)) mod a)`` (the radices swap
every round), with the ``lowbias32`` integer hash keyed by ``(seed, epoch, round)`` as ``F``.
Such a round is invertible whatever ``F`` is, so the network is a bijection of ``[0, a*b)``;
values that land in ``[n, a*b)`` are walked through it again ("cycle walking"), which
keeps it a bijection on ``[0, n)``. Because ``a*b - n < a``, fewer than one position in
``sqrt(n)`` needs a second pass (a power-of-two XOR Feistel would walk up to half of them,
and measured 2-3x slower). ``F`` is a 32-bit hash scaled onto ``[0, a)``; for ``n`` up to 2**40 the
scaling's bias is below 2**-12, beyond that the order is still a bijection but less uniform.

All tensor arithmetic stays below ``2**63`` so int64 never overflows (torch has no portable
wrapping unsigned 64-bit multiply); a pure-Python twin (:meth:`FeistelPermutation.index`)
computes the same function and pins the vectorised one in tests.

Changing anything here changes the data order of every existing checkpoint, so the
algorithm carries a name (:data:`PERMUTATION_ALGORITHM`) that sampler state records and
checks on load.
"""

from __future__ import annotations

import math

import torch

PERMUTATION_ALGORITHM = "feistel6-mixedradix-lowbias32-v1"
"""Name of the permutation function, stored in sampler state; bump it on any change."""

MAX_DATASET_LEN = 1 << 62
"""Largest supported dataset: keeps every intermediate below 2**63 in int64 arithmetic."""

_ROUNDS = 6
# Up to this many cycle-walking stragglers are walked one by one in Python (measured).
_SCALAR_WALK_BELOW = 128
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
    """lowbias32 of a fresh 32-bit tensor, computed in place (``x`` is consumed)."""
    x ^= x >> 16
    x *= _MUL1
    x &= _MASK32
    x ^= x >> 15
    high_bit = (x & 1) << 31
    x *= _MUL2_LOW
    x += high_bit
    x &= _MASK32
    x ^= x >> 16
    return x


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
        # The two radices: a*b >= n with a*b - n < a, so cycle walking is rare.
        self._a = max(1, math.isqrt(n - 1) + 1)
        self._b = -(-n // self._a)
        self._keys = round_keys(seed, epoch)

    def _feistel_int(self, x: int) -> int:
        p, q = self._a, self._b
        left, right = divmod(x, q)
        for key in self._keys:
            # (L mod p, R mod q) -> (R mod q, (L + F(R)) mod p): invertible whatever F is.
            # F(R) = lowbias32(R ^ key) scaled onto [0, p) by its high bits.
            f = (_lowbias32_int(right ^ key) * p) >> 32
            left, right = right, (left + f) % p
            p, q = q, p
        return left * q + right

    def _feistel_tensor(self, x: torch.Tensor) -> torch.Tensor:
        p, q = self._a, self._b
        left, right = x // q, x % q
        for key in self._keys:
            # right < 2**31 and key < 2**32, so right ^ key is already a 32-bit value.
            f = _lowbias32_tensor(right ^ key)
            # Map the 32-bit hash onto [0, p) by its high bits (Lemire's multiply-shift,
            # cheaper than a division); h * p < 2**32 * 2**31 stays inside int64.
            f *= p
            f >>= 32
            f += left
            f.remainder_(p)
            left, right = right, f
            p, q = q, p
        left *= q
        left += right
        return left

    def index(self, position: int) -> int:
        """Sample index at ``position`` (pure Python; the reference for :meth:`__call__`).

        Raises:
            IndexError: ``position`` is outside ``[0, n)``.
        """
        if not 0 <= position < self.n:
            raise IndexError(f"position {position} outside [0, {self.n})")
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
        out = self._feistel_tensor(positions.reshape(-1))
        # Cycle walking: re-encrypt only the stragglers (fewer than 1 in sqrt(n) per pass).
        # A tensor pass costs ~100 small-op launches whatever its size, so a few stragglers
        # are cheaper to walk in plain Python.
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
