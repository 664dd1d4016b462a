"""How the internal sockets authenticate: the ``security`` part of a topology.

It lives in ``protocol`` because the transport (``protocol.transport``) reads it to key
every tcp:// socket; ``cluster.topology`` embeds it as ``Topology.security``.
"""

from __future__ import annotations

import os
from typing import Literal

import msgspec


class CurveSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """ZeroMQ CURVE keys for every tcp:// socket (``candor keygen DIR`` writes a key
    directory: server.key(_secret), client.key(_secret)). Binders need the server's
    secret key and admit only the public keys in ``authorized_keys_dir``; connectors
    need the server's public key and a client key pair. A file named explicitly wins
    over ``key_dir``."""

    key_dir: str | None = None
    server_secret_key_file: str | None = None
    server_public_key_file: str | None = None
    client_secret_key_file: str | None = None
    authorized_keys_dir: str | None = None

    def _path(self, explicit: str | None, name: str) -> str:
        if explicit is not None:
            return os.path.expanduser(explicit)
        if self.key_dir is None:
            raise ValueError(f"security.curve names neither {name!r} nor a key_dir")
        return os.path.join(os.path.expanduser(self.key_dir), name)

    def server_secret_path(self) -> str:
        return self._path(self.server_secret_key_file, "server.key_secret")

    def server_public_path(self) -> str:
        return self._path(self.server_public_key_file, "server.key")

    def client_secret_path(self) -> str:
        return self._path(self.client_secret_key_file, "client.key_secret")

    def authorized_keys_path(self) -> str:
        if self.authorized_keys_dir is not None:
            return os.path.expanduser(self.authorized_keys_dir)
        return self._path(None, "")


class TensorParallelTraffic(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How tensor-parallel traffic between nodes is protected, which CURVE does not
    cover: torch.distributed's rendezvous (a TCP store listening on every interface
    that any host reaching its port can join) and the gloo/NCCL collectives are plain.
    ``protection``: private_network (a network only the ranks' machines reach) or
    tunnel (an encrypted link, e.g. WireGuard or IPsec, between them). ``network``: its
    CIDR; every rank's node host and the rendezvous must lie in it (checked).
    ``interface``: the network interface the collectives bind to (GLOO_SOCKET_IFNAME,
    NCCL_SOCKET_IFNAME; an operator's own setting wins)."""

    protection: Literal["private_network", "tunnel"]
    network: str
    interface: str | None = None


class SecuritySpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How the internal sockets authenticate. ``curve`` unset: tcp sockets are plain
    (only for a private network you trust). ``tensor_parallel``: required when one
    replica's ranks span nodes, naming how their traffic is protected."""

    curve: CurveSpec | None = None
    tensor_parallel: TensorParallelTraffic | None = None
