"""Trust between the ranks of one instance: who may join a group whose rendezvous is reachable from
the network.

gloo's rendezvous (torch's TCP store on ``--master-addr:--master-port``) and its connections carry no
authentication. So a group whose address is not loopback needs the cluster token (the rule every
internal service follows, :meth:`xllm.engine_api.security.ClusterSecurity.check_bind`), and right after
the rendezvous, before any weight, plan or KV byte flows, every rank proves to every other that it holds
the token (:func:`prove_group`): each rank draws a fresh nonce, the nonces are gathered, and each rank
answers with an HMAC over all of them and its rank; a rank whose answer does not verify fails the group
(:class:`~xllm.core.parallel.comm.CollectiveError`) on every rank. The traffic itself is not encrypted:
ranks on different hosts belong on a private network.
"""

from __future__ import annotations

import hmac
import secrets

import torch

from xllm.core.parallel.comm import CollectiveError, Communicator
from xllm.engine_api.credential import ClusterKeys, rank_mac
from xllm.engine_api.security import SecurityConfigError, is_loopback

NONCE_BYTES = 32


def check_group_address(host: str, keys: ClusterKeys | None) -> None:
    """Refuse a rendezvous address beyond loopback without the cluster token (``SecurityConfigError``
    naming the flags)."""
    if keys is None and not is_loopback(host):
        raise SecurityConfigError(
            f"--master-addr {host} is not loopback: ranks on several hosts need the cluster token "
            "(--cluster-token, --cluster-token-file or $XLLM_CLUSTER_TOKEN) on every host")


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def prove_group(comm: Communicator, keys: ClusterKeys | None) -> None:
    """Every rank of ``comm`` proves it holds ``keys``' token to every other (collective: every rank
    calls it, with the same token). No-op without keys (a loopback group) or with one rank."""
    if keys is None or comm.size == 1:
        return
    nonces = comm.all_gather(_tensor(secrets.token_bytes(NONCE_BYTES)))
    transcript = b"".join(bytes(n.numpy()) for n in nonces)
    macs = comm.all_gather(_tensor(rank_mac(keys, transcript, comm.rank)))
    bad = [r for r, mac in enumerate(macs)
           if not hmac.compare_digest(rank_mac(keys, transcript, r), bytes(mac.numpy()))]
    if bad:
        raise CollectiveError(f"rank(s) {bad} did not prove the cluster credential: the group is refused "
                              "(is the same cluster token set on every host?)")
