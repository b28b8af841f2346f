from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVCacheEvents(_message.Message):
    __slots__ = ("instance_id", "block_size", "epoch", "base_version", "version", "snapshot", "stored", "removed", "tiers", "tier_scopes")
    class TierScopesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    TIER_SCOPES_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    block_size: int
    epoch: int
    base_version: int
    version: int
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierBlocks]
    tier_scopes: _containers.ScalarMap[str, str]
    def __init__(self, instance_id: _Optional[str] = ..., block_size: _Optional[int] = ..., epoch: _Optional[int] = ..., base_version: _Optional[int] = ..., version: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., tiers: _Optional[_Iterable[_Union[TierBlocks, _Mapping]]] = ..., tier_scopes: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TierBlocks(_message.Message):
    __slots__ = ("tier", "stored", "removed")
    TIER_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    tier: str
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tier: _Optional[str] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ...) -> None: ...
