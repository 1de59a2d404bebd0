"""Writes on an expired lease surface as LeaseLostError, never as a raw gRPC error."""

from __future__ import annotations

import pytest

from elasticd.errors import LeaseLostError

pytestmark = pytest.mark.timeout(30)


def test_put_on_a_revoked_lease_raises_lease_lost(etcd_client):
    """A node whose lease expired gets LeaseLostError (the handler then re-registers)."""
    lease = etcd_client.grant_lease(2)
    etcd_client.revoke_lease(lease)
    with pytest.raises(LeaseLostError, match="lease"):
        etcd_client.put("/elasticd/t/rdzv/joins/0000000001/n0", b"1", lease=lease)
