from xllm.proto.kvstore.v1 import kv_events_pb2 as _kv_events_pb2
from xllm.proto.registry.v1 import instance_pb2 as _instance_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DisaggPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DISAGG_PHASE_NONE: _ClassVar[DisaggPhase]
    DISAGG_PHASE_PREFILL: _ClassVar[DisaggPhase]
    DISAGG_PHASE_DECODE: _ClassVar[DisaggPhase]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_HANDED_OFF: _ClassVar[FinishReason]

class MigrationStage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MIGRATION_STAGE_NONE: _ClassVar[MigrationStage]
    MIGRATION_STAGE_COPY: _ClassVar[MigrationStage]
    MIGRATION_STAGE_FINAL: _ClassVar[MigrationStage]

class ControlAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTROL_ACTION_UNSPECIFIED: _ClassVar[ControlAction]
    CONTROL_ACTION_SLEEP: _ClassVar[ControlAction]
    CONTROL_ACTION_WAKE_UP: _ClassVar[ControlAction]
    CONTROL_ACTION_UPDATE_WEIGHTS: _ClassVar[ControlAction]
    CONTROL_ACTION_IS_SLEEPING: _ClassVar[ControlAction]
DISAGG_PHASE_NONE: DisaggPhase
DISAGG_PHASE_PREFILL: DisaggPhase
DISAGG_PHASE_DECODE: DisaggPhase
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_HANDED_OFF: FinishReason
MIGRATION_STAGE_NONE: MigrationStage
MIGRATION_STAGE_COPY: MigrationStage
MIGRATION_STAGE_FINAL: MigrationStage
CONTROL_ACTION_UNSPECIFIED: ControlAction
CONTROL_ACTION_SLEEP: ControlAction
CONTROL_ACTION_WAKE_UP: ControlAction
CONTROL_ACTION_UPDATE_WEIGHTS: ControlAction
CONTROL_ACTION_IS_SLEEPING: ControlAction

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "logit_bias", "include_stop_str_in_output", "skip_special_tokens", "structured", "prompt_logprobs", "beam_width", "length_penalty", "early_stopping", "item_catalog")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BEAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    ITEM_CATALOG_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    structured: StructuredOutput
    prompt_logprobs: int
    beam_width: int
    length_penalty: float
    early_stopping: str
    item_catalog: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., beam_width: _Optional[int] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[str] = ..., item_catalog: _Optional[bool] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "regex", "choice", "grammar", "field")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    choice: StringList
    grammar: str
    field: str
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[StringList, _Mapping]] = ..., grammar: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class StringList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("transport", "address", "transfer_id", "matched_tokens", "layout")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    transport: str
    address: str
    transfer_id: str
    matched_tokens: int
    layout: str
    def __init__(self, transport: _Optional[str] = ..., address: _Optional[str] = ..., transfer_id: _Optional[str] = ..., matched_tokens: _Optional[int] = ..., layout: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "model", "arrival_time", "disagg_phase", "kv_target", "resumed_output_tokens", "resumed_sent_chars", "movable", "offline", "lora_name", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    DISAGG_PHASE_FIELD_NUMBER: _ClassVar[int]
    KV_TARGET_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_SENT_CHARS_FIELD_NUMBER: _ClassVar[int]
    MOVABLE_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    priority: int
    model: str
    arrival_time: float
    disagg_phase: DisaggPhase
    kv_target: KVTarget
    resumed_output_tokens: int
    resumed_sent_chars: int
    movable: bool
    offline: bool
    lora_name: str
    images: _containers.RepeatedCompositeFieldContainer[ImageInput]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., model: _Optional[str] = ..., arrival_time: _Optional[float] = ..., disagg_phase: _Optional[_Union[DisaggPhase, str]] = ..., kv_target: _Optional[_Union[KVTarget, _Mapping]] = ..., resumed_output_tokens: _Optional[int] = ..., resumed_sent_chars: _Optional[int] = ..., movable: _Optional[bool] = ..., offline: _Optional[bool] = ..., lora_name: _Optional[str] = ..., images: _Optional[_Iterable[_Union[ImageInput, _Mapping]]] = ...) -> None: ...

class ImageInput(_message.Message):
    __slots__ = ("pixel_values", "grid_thw", "content_hash", "embedding")
    PIXEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    pixel_values: bytes
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    content_hash: bytes
    embedding: ImageEmbedding
    def __init__(self, pixel_values: _Optional[bytes] = ..., grid_thw: _Optional[_Iterable[int]] = ..., content_hash: _Optional[bytes] = ..., embedding: _Optional[_Union[ImageEmbedding, _Mapping]] = ...) -> None: ...

class ImageEmbedding(_message.Message):
    __slots__ = ("values", "crc32", "weights_identity")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    values: bytes
    crc32: int
    weights_identity: str
    def __init__(self, values: _Optional[bytes] = ..., crc32: _Optional[int] = ..., weights_identity: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish_reason", "stop_reason", "usage", "error", "kv_reservation", "disagg_stats", "move_offer", "prompt_logprobs", "beams")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    KV_RESERVATION_FIELD_NUMBER: _ClassVar[int]
    DISAGG_STATS_FIELD_NUMBER: _ClassVar[int]
    MOVE_OFFER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BEAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: FinishReason
    stop_reason: str
    usage: Usage
    error: str
    kv_reservation: KVTarget
    disagg_stats: DisaggStats
    move_offer: MoveOffer
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    beams: _containers.RepeatedCompositeFieldContainer[BeamHypothesis]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error: _Optional[str] = ..., kv_reservation: _Optional[_Union[KVTarget, _Mapping]] = ..., disagg_stats: _Optional[_Union[DisaggStats, _Mapping]] = ..., move_offer: _Optional[_Union[MoveOffer, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., beams: _Optional[_Iterable[_Union[BeamHypothesis, _Mapping]]] = ...) -> None: ...

class BeamHypothesis(_message.Message):
    __slots__ = ("token_ids", "text", "logprob", "score", "finish_reason", "item_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprob: float
    score: float
    finish_reason: FinishReason
    item_id: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., score: _Optional[float] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., item_id: _Optional[int] = ...) -> None: ...

class MoveOffer(_message.Message):
    __slots__ = ("num_tokens", "kv_bytes", "prefill_tokens_per_s")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    kv_bytes: int
    prefill_tokens_per_s: float
    def __init__(self, num_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ...) -> None: ...

class DisaggStats(_message.Message):
    __slots__ = ("queue_seconds", "prefill_seconds", "transfer_seconds", "transfer_bytes", "transferred_tokens", "transport", "recomputed", "failure", "overlapped_seconds", "store_blocks")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    OVERLAPPED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STORE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    prefill_seconds: float
    transfer_seconds: float
    transfer_bytes: int
    transferred_tokens: int
    transport: str
    recomputed: bool
    failure: str
    overlapped_seconds: float
    store_blocks: int
    def __init__(self, queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., transferred_tokens: _Optional[int] = ..., transport: _Optional[str] = ..., recomputed: _Optional[bool] = ..., failure: _Optional[str] = ..., overlapped_seconds: _Optional[float] = ..., store_blocks: _Optional[int] = ...) -> None: ...

class KVCommit(_message.Message):
    __slots__ = ("transfer_id", "num_tokens", "first_block", "num_blocks", "first_token", "layout", "block_crc32", "migration", "appended_tokens", "sent_chars", "store_hashes")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CRC32_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FIELD_NUMBER: _ClassVar[int]
    APPENDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SENT_CHARS_FIELD_NUMBER: _ClassVar[int]
    STORE_HASHES_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    num_tokens: int
    first_block: int
    num_blocks: int
    first_token: int
    layout: str
    block_crc32: _containers.RepeatedScalarFieldContainer[int]
    migration: MigrationStage
    appended_tokens: _containers.RepeatedScalarFieldContainer[int]
    sent_chars: int
    store_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transfer_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., first_token: _Optional[int] = ..., layout: _Optional[str] = ..., block_crc32: _Optional[_Iterable[int]] = ..., migration: _Optional[_Union[MigrationStage, str]] = ..., appended_tokens: _Optional[_Iterable[int]] = ..., sent_chars: _Optional[int] = ..., store_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KVPages(_message.Message):
    __slots__ = ("transfer_id", "range", "first_block", "data", "crc32")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    range: int
    first_block: int
    data: bytes
    crc32: int
    def __init__(self, transfer_id: _Optional[str] = ..., range: _Optional[int] = ..., first_block: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class KVTransferMessage(_message.Message):
    __slots__ = ("pages", "commit")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    pages: KVPages
    commit: KVCommit
    def __init__(self, pages: _Optional[_Union[KVPages, _Mapping]] = ..., commit: _Optional[_Union[KVCommit, _Mapping]] = ...) -> None: ...

class KVFdHandoff(_message.Message):
    __slots__ = ("commit", "source_pages", "memfd_offsets", "page_bytes")
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_PAGES_FIELD_NUMBER: _ClassVar[int]
    MEMFD_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    commit: KVCommit
    source_pages: _containers.RepeatedScalarFieldContainer[int]
    memfd_offsets: _containers.RepeatedScalarFieldContainer[int]
    page_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, commit: _Optional[_Union[KVCommit, _Mapping]] = ..., source_pages: _Optional[_Iterable[int]] = ..., memfd_offsets: _Optional[_Iterable[int]] = ..., page_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class KVTransferAck(_message.Message):
    __slots__ = ("installed", "error", "resend")
    INSTALLED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESEND_FIELD_NUMBER: _ClassVar[int]
    installed: bool
    error: str
    resend: bool
    def __init__(self, installed: _Optional[bool] = ..., error: _Optional[str] = ..., resend: _Optional[bool] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("request_id", "kv_target", "num_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TARGET_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_target: KVTarget
    num_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., kv_target: _Optional[_Union[KVTarget, _Mapping]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ("accepted", "error")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    error: str
    def __init__(self, accepted: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("healthy", "status")
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    healthy: bool
    status: str
    def __init__(self, healthy: _Optional[bool] = ..., status: _Optional[str] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetKVEventsRequest(_message.Message):
    __slots__ = ("since_version", "epoch", "snapshot")
    SINCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    since_version: int
    epoch: int
    snapshot: bool
    def __init__(self, since_version: _Optional[int] = ..., epoch: _Optional[int] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class ProveRequest(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    def __init__(self, nonce: _Optional[bytes] = ...) -> None: ...

class ProveResponse(_message.Message):
    __slots__ = ("instance_id", "address", "mac")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    mac: bytes
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., mac: _Optional[bytes] = ...) -> None: ...

class ReattachRequest(_message.Message):
    __slots__ = ("request_id", "from_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    from_token: int
    def __init__(self, request_id: _Optional[str] = ..., from_token: _Optional[int] = ...) -> None: ...

class LoadLoraRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoadLoraResponse(_message.Message):
    __slots__ = ("ok", "error", "param", "hash_root")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    HASH_ROOT_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    param: str
    hash_root: int
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., param: _Optional[str] = ..., hash_root: _Optional[int] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "pooling", "normalize")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    pooling: str
    normalize: bool
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., pooling: _Optional[str] = ..., normalize: _Optional[bool] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embedding",)
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    embedding: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, embedding: _Optional[_Iterable[float]] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("images", "request_id")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[ImageInput]
    request_id: str
    def __init__(self, images: _Optional[_Iterable[_Union[ImageInput, _Mapping]]] = ..., request_id: _Optional[str] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("embeddings",)
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[ImageEmbedding]
    def __init__(self, embeddings: _Optional[_Iterable[_Union[ImageEmbedding, _Mapping]]] = ...) -> None: ...

class ControlRequest(_message.Message):
    __slots__ = ("action", "level", "model_path")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    action: ControlAction
    level: int
    model_path: str
    def __init__(self, action: _Optional[_Union[ControlAction, str]] = ..., level: _Optional[int] = ..., model_path: _Optional[str] = ...) -> None: ...

class ControlResponse(_message.Message):
    __slots__ = ("ok", "error", "param", "sleeping_level", "woke_from", "weights_identity")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    SLEEPING_LEVEL_FIELD_NUMBER: _ClassVar[int]
    WOKE_FROM_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    param: str
    sleeping_level: int
    woke_from: int
    weights_identity: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., param: _Optional[str] = ..., sleeping_level: _Optional[int] = ..., woke_from: _Optional[int] = ..., weights_identity: _Optional[str] = ...) -> None: ...
