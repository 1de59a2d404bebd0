"""The worker's own sockets: which ones its process groups opened, and shutting those down.

Live re-formation must wake a collective stuck on a frozen peer (gloo's ``abort()`` does
not wake a local wait); closing the group's connections does. It must never touch a
user's own connections (a data server, object storage, a tracker), so the group's sockets
are recorded when each group is created: the ``socket:[inode]`` links of /proc/self/fd
that appeared meanwhile.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator


def socket_links() -> set[str]:
    """This process's open sockets, as ``socket:[inode]`` links of /proc/self/fd."""
    links: set[str] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no procfs: nothing is known, so nothing will be shut down
        return links
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            links.add(link)
    return links


def _group_streams(links: frozenset[str]) -> Iterator[socket.socket]:
    """Duplicates of our process groups' TCP stream sockets (``links``), closed after use;
    listeners and unconnected ones are included (the caller's ``getpeername`` sorts them)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no procfs: nothing is known
        return
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}") not in links:
                continue
            s = socket.socket(fileno=os.dup(int(name)))
        except (OSError, ValueError):
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                yield s
        finally:
            s.close()  # closes our duplicate only


def shutdown_group_connections(links: frozenset[str]) -> int:
    """Shut down the TCP connections our process groups opened (``links``), nothing else.

    Used only while the old group's collective is stuck on a frozen peer and a newer round
    was ordered: the waiting thread sees the connection closed and fails, as after a kill.
    gloo gives no other way to wake a local wait (``abort()`` does not). ``links`` are the
    sockets that appeared while the groups were created (``context.socket_links``), so a
    user's own connections (a data server, object storage, a tracker) are never touched.

    Returns:
        How many sockets were shut down.
    """
    count = 0
    for s in _group_streams(links):
        try:
            s.getpeername()  # raises for listeners and unconnected sockets
            s.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
    return count


def group_endpoints(links: frozenset[str]) -> tuple[list[str], frozenset[str]]:
    """The addresses of our process groups' connected TCP sockets (``links``).

    The state transfer listens on the address the group already uses and admits only the
    group's peers, so it opens no path the group did not have.

    Returns:
        (our local addresses, most used first; the peers' addresses).
    """
    local: dict[str, int] = {}
    peers: set[str] = set()
    for s in _group_streams(links):
        try:
            peers.add(s.getpeername()[0])  # raises for listeners and unconnected sockets
            here = s.getsockname()[0]
            local[here] = local.get(here, 0) + 1
        except OSError:
            pass
    return sorted(local, key=lambda a: -local[a]), frozenset(peers)
