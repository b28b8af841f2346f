"""What members of a cluster prove with the cluster token, without ever sending it.

The cluster token (``--cluster-token``; :mod:`xllm.engine_api.security`) never crosses the wire. Four
keys are derived from it, one per use (HMAC-SHA256 of the token over a purpose label, so no key
serves another purpose and none reveals the token):

- **record key**: an instance record written to the registry (etcd, the embedded registry) carries a
  :func:`sign_record` signature over its content (instance id, address, role, model, the time it was
  signed and the lease it is written under). A gateway with the credential accepts a record only if
  :func:`verify_record` passes: signed with this key, under the lease it names (etcd: a copy of a
  record written under another lease, or none, is a replay and refused), and not older than a bound
  when it is registered (the embedded registry's ``Register``). The same key signs heartbeats
  (:func:`sign_heartbeat`, labelled apart from records): a MAC over the whole heartbeat (load, KV cache
  events, counters, draining) with its instance id, seq and lease; a gateway applies one only if
  :func:`verify_heartbeat` passes for the lease its instance holds and its seq is above the last one
  applied, so a writer to etcd who reads a live lease can neither forge nor replay one.
- **call key**: every call to an internal service carries a per-call proof (:func:`make_proof`,
  metadata ``xllm-proof``): an HMAC over the method, a timestamp and a random nonce. Servers check it
  in constant time (:class:`ProofCheck`) and accept each nonce once within a replay window; a
  captured proof is worthless later, for another method, or a second time.
- **prove key**: before its first request to an instance, a gateway sends a fresh nonce in
  ``EngineService.Prove``; the instance answers ``HMAC(prove key, nonce || instance id || address)``
  (:func:`prove_mac`). Only then does the gateway send it anything else, so a stranger at an address
  in the registry never receives a request nor a proof.
- **stream key**: the gateways' resumable stream ids carry a MAC under it, so any gateway of the cluster
  can resume a stream another one started, and a client can neither forge one nor name another's.

No torch here.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import struct
import time
from dataclasses import dataclass

from xllm.proto.registry.v1 import instance_pb2

PROOF_KEY = "xllm-proof"
PROOF_VERSION = "v1"
PROOF_WINDOW = 30.0          # seconds a proof's timestamp may differ from the server's clock
RECORD_MAX_AGE = 60.0        # seconds a record may have been signed before it is registered
NONCE_BYTES = 16
MAX_REMEMBERED = 1 << 18     # nonces remembered per server (older proofs are refused once it is full)


def _derive(token: str, purpose: str) -> bytes:
    return hmac.new(token.encode(), b"xllm-cluster-key/v1/" + purpose.encode(), hashlib.sha256).digest()


def _mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over ``parts``, each length-prefixed (no two part lists give the same input)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(struct.pack(">I", len(part)))
        h.update(part)
    return h.digest()


@dataclass(frozen=True)
class ClusterKeys:
    """The keys derived from one cluster token (never shown in ``repr``)."""

    record: bytes
    call: bytes
    prove: bytes
    stream: bytes = b""  # the gateways' stream ids (xllm.gateway.openai.stream_ids): any gateway checks any's

    def __repr__(self) -> str:
        return "ClusterKeys(...)"

    @classmethod
    def from_token(cls, token: str) -> ClusterKeys:
        return cls(record=_derive(token, "record"), call=_derive(token, "call"), prove=_derive(token, "prove"),
                   stream=_derive(token, "stream"))


# ---- signed instance records --------------------------------------------------------------------
class RecordRefusedError(ValueError):
    """An instance record failed :func:`verify_record`; ``reason`` is one of ``unsigned``, ``bad_signature``,
    ``wrong_lease``, ``stale`` (the label of the refusal counter); a heartbeat that failed
    :func:`verify_heartbeat` has one of the ``heartbeat_*`` reasons."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _record_content(info: instance_pb2.InstanceInfo) -> bytes:
    unsigned = instance_pb2.InstanceInfo()
    unsigned.CopyFrom(info)
    unsigned.signature.mac = b""
    return unsigned.SerializeToString(deterministic=True)


def sign_record(keys: ClusterKeys, info: instance_pb2.InstanceInfo, lease: int = 0,
                now: float | None = None) -> instance_pb2.InstanceInfo:
    """A copy of ``info`` signed now (``now``: Unix seconds) for the registry ``lease`` (0: none)."""
    signed = instance_pb2.InstanceInfo()
    signed.CopyFrom(info)
    signed.signature.Clear()
    signed.signature.issued_at = time.time() if now is None else now
    signed.signature.lease = lease
    signed.signature.mac = _mac(keys.record, b"record", _record_content(signed))
    return signed


def verify_record(keys: ClusterKeys, info: instance_pb2.InstanceInfo, lease: int | None = None,
                  max_age: float | None = None, now: float | None = None) -> None:
    """Raise :class:`RecordRefusedError` unless ``info`` was signed with ``keys``; with ``lease``, for
    that lease (the one the registry holds it under); with ``max_age``, at most that many seconds ago
    (and not in the future beyond the same bound)."""
    if not info.HasField("signature") or not info.signature.mac:
        raise RecordRefusedError("unsigned", f"instance record {info.instance_id!r} carries no signature")
    expected = _mac(keys.record, b"record", _record_content(info))
    if not hmac.compare_digest(expected, info.signature.mac):
        raise RecordRefusedError("bad_signature", f"instance record {info.instance_id!r}: the signature does not "
                                 "verify (not written by a holder of this cluster's credential, or altered)")
    if lease is not None and info.signature.lease != lease:
        raise RecordRefusedError("wrong_lease", f"instance record {info.instance_id!r} was signed for lease "
                                 f"{info.signature.lease:x}, found under {lease:x} (a copy of an old record)")
    if max_age is not None:
        age = (time.time() if now is None else now) - info.signature.issued_at
        if not -max_age <= age <= max_age:
            raise RecordRefusedError("stale", f"instance record {info.instance_id!r} was signed {age:.0f} s ago "
                                     f"(at most {max_age:g} s; check the clocks)")


# ---- signed heartbeats ----------------------------------------------------------------------------
def _heartbeat_content(hb: instance_pb2.Heartbeat) -> bytes:
    unsigned = instance_pb2.Heartbeat()
    unsigned.CopyFrom(hb)
    unsigned.signature.mac = b""
    return unsigned.SerializeToString(deterministic=True)


def sign_heartbeat(keys: ClusterKeys, hb: instance_pb2.Heartbeat, lease: int,
                   now: float | None = None) -> instance_pb2.Heartbeat:
    """A copy of ``hb`` signed now for the registry ``lease`` it is sent under (etcd's lease, or the
    embedded registry's lease id)."""
    signed = instance_pb2.Heartbeat()
    signed.CopyFrom(hb)
    signed.signature.Clear()
    signed.signature.issued_at = time.time() if now is None else now
    signed.signature.lease = lease
    signed.signature.mac = _mac(keys.record, b"heartbeat", _heartbeat_content(signed))
    return signed


def verify_heartbeat(keys: ClusterKeys, hb: instance_pb2.Heartbeat, lease: int, after_seq: int = 0) -> None:
    """Raise :class:`RecordRefusedError` unless ``hb`` was signed with ``keys`` for ``lease`` and its seq is
    above ``after_seq`` (the last one applied under that lease). Reasons: ``heartbeat_unsigned``,
    ``heartbeat_bad_signature``, ``heartbeat_wrong_lease``, ``heartbeat_replayed``."""
    if not hb.HasField("signature") or not hb.signature.mac:
        raise RecordRefusedError("heartbeat_unsigned", f"heartbeat of {hb.instance_id!r} carries no signature")
    expected = _mac(keys.record, b"heartbeat", _heartbeat_content(hb))
    if not hmac.compare_digest(expected, hb.signature.mac):
        raise RecordRefusedError("heartbeat_bad_signature", f"heartbeat of {hb.instance_id!r}: the signature does "
                                 "not verify (not written by a holder of this cluster's credential, or altered)")
    if hb.signature.lease != lease:
        raise RecordRefusedError("heartbeat_wrong_lease", f"heartbeat of {hb.instance_id!r} was signed for lease "
                                 f"{hb.signature.lease:x}, found under {lease:x} (a copy of an old one)")
    if hb.seq <= after_seq:
        raise RecordRefusedError("heartbeat_replayed", f"heartbeat of {hb.instance_id!r} has seq {hb.seq}, not above "
                                 f"{after_seq} already applied (a replay of an old one)")


# ---- per-call proofs ----------------------------------------------------------------------------
def _method(method: str | bytes) -> bytes:
    return method if isinstance(method, bytes) else method.encode()


def make_proof(keys: ClusterKeys, method: str | bytes, now: float | None = None, nonce: bytes | None = None) -> str:
    """The ``xllm-proof`` metadata value for one call of ``method`` (``/package.Service/Method``)."""
    ts = str(int((time.time() if now is None else now) * 1000))
    nonce = nonce or secrets.token_bytes(NONCE_BYTES)
    mac = _mac(keys.call, PROOF_VERSION.encode(), _method(method), ts.encode(), nonce)
    return f"{PROOF_VERSION}.{ts}.{nonce.hex()}.{mac.hex()}"


class ProofCheck:
    """A server's check of per-call proofs: valid MAC (constant time), timestamp within ``window`` s
    of this clock, nonce never seen before within the window.

    Remembers at most ``max_remembered`` nonces: when full, the oldest are forgotten and every proof
    not newer than them is refused from then on (a replay can never get through, a flood of calls only
    narrows the window). Not thread-safe: one event loop calls it.
    """

    def __init__(self, keys: ClusterKeys, window: float = PROOF_WINDOW, max_remembered: int = MAX_REMEMBERED,
                 clock=time.time) -> None:
        self.keys = keys
        self.window = window
        self.max_remembered = max_remembered
        self.clock = clock
        self._seen: collections.OrderedDict[bytes, float] = collections.OrderedDict()  # nonce -> proof time
        self._floor = float("-inf")  # proofs at or before this time are refused (their nonces were forgotten)

    def check(self, value: str | bytes | None, method: str | bytes) -> str | None:
        """``None`` if ``value`` proves the call, else why not (``missing``, ``malformed``,
        ``bad_mac``, ``expired``, ``replayed``)."""
        if not value:
            return "missing"
        if isinstance(value, bytes):
            value = value.decode("ascii", "replace")
        parts = value.split(".")
        if len(parts) != 4 or parts[0] != PROOF_VERSION or not parts[1].isdigit() or len(parts[1]) > 16:
            return "malformed"
        try:
            nonce, mac = bytes.fromhex(parts[2]), bytes.fromhex(parts[3])
        except ValueError:
            return "malformed"
        if not NONCE_BYTES <= len(nonce) <= 64:
            return "malformed"
        expected = _mac(self.keys.call, PROOF_VERSION.encode(), _method(method), parts[1].encode(), nonce)
        if not hmac.compare_digest(expected, mac):
            return "bad_mac"
        ts, now = int(parts[1]) / 1000, self.clock()
        if abs(now - ts) > self.window or ts <= self._floor:
            return "expired"
        if nonce in self._seen:
            return "replayed"
        self._forget(now)  # room for this one (which may raise the floor past its own time)
        if ts <= self._floor:
            return "expired"
        self._seen[nonce] = ts
        return None

    def _forget(self, now: float) -> None:
        while self._seen:
            nonce, ts = next(iter(self._seen.items()))
            if ts >= now - self.window and len(self._seen) < self.max_remembered:
                return
            del self._seen[nonce]
            if ts >= now - self.window:  # forgotten while still in the window: refuse its era from now on
                self._floor = max(self._floor, ts)


# ---- Prove: an instance shows it holds the credential ---------------------------------------------
def new_nonce() -> bytes:
    return secrets.token_bytes(32)


def prove_mac(keys: ClusterKeys, nonce: bytes, instance_id: str, address: str) -> bytes:
    """The answer to a ``Prove`` challenge ``nonce`` by the instance ``instance_id`` at ``address``."""
    return _mac(keys.prove, b"prove", nonce, instance_id.encode(), address.encode())


def proven(keys: ClusterKeys, nonce: bytes, instance_id: str, address: str, mac: bytes) -> bool:
    """Whether ``mac`` answers the challenge ``nonce`` for ``instance_id`` at ``address`` (constant time)."""
    return hmac.compare_digest(prove_mac(keys, nonce, instance_id, address), mac)


# ---- ranks of one instance ------------------------------------------------------------------------
def rank_mac(keys: ClusterKeys, transcript: bytes, rank: int) -> bytes:
    """Rank ``rank``'s proof over ``transcript`` (every rank's fresh nonce, in rank order) that it holds
    the cluster credential (:func:`xllm.core.parallel.trust.prove_group`)."""
    return _mac(keys.prove, b"tp-rank", transcript, str(rank).encode())
