from xllm.proto.kvstore.v1 import kv_events_pb2 as _kv_events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InstanceRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_ROLE_UNSPECIFIED: _ClassVar[InstanceRole]
    INSTANCE_ROLE_MIXED: _ClassVar[InstanceRole]
    INSTANCE_ROLE_PREFILL: _ClassVar[InstanceRole]
    INSTANCE_ROLE_DECODE: _ClassVar[InstanceRole]
    INSTANCE_ROLE_ENCODE: _ClassVar[InstanceRole]
INSTANCE_ROLE_UNSPECIFIED: InstanceRole
INSTANCE_ROLE_MIXED: InstanceRole
INSTANCE_ROLE_PREFILL: InstanceRole
INSTANCE_ROLE_DECODE: InstanceRole
INSTANCE_ROLE_ENCODE: InstanceRole

class ModelInfo(_message.Message):
    __slots__ = ("served_name", "max_model_len", "dtype", "block_size", "lora_names", "lora_hash_roots")
    SERVED_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    LORA_HASH_ROOTS_FIELD_NUMBER: _ClassVar[int]
    served_name: str
    max_model_len: int
    dtype: str
    block_size: int
    lora_names: _containers.RepeatedScalarFieldContainer[str]
    lora_hash_roots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, served_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., lora_names: _Optional[_Iterable[str]] = ..., lora_hash_roots: _Optional[_Iterable[int]] = ...) -> None: ...

class InstanceInfo(_message.Message):
    __slots__ = ("instance_id", "address", "role", "model", "start_time", "signature")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    role: InstanceRole
    model: ModelInfo
    start_time: float
    signature: RecordSignature
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[_Union[InstanceRole, str]] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., start_time: _Optional[float] = ..., signature: _Optional[_Union[RecordSignature, _Mapping]] = ...) -> None: ...

class RecordSignature(_message.Message):
    __slots__ = ("issued_at", "lease", "mac")
    ISSUED_AT_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    issued_at: float
    lease: int
    mac: bytes
    def __init__(self, issued_at: _Optional[float] = ..., lease: _Optional[int] = ..., mac: _Optional[bytes] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("instance_id", "num_running", "num_waiting", "kv_usage", "kv_free_tokens", "recent_ttft", "recent_tpot", "timestamp", "pending_prefill_tokens", "prefill_tokens_per_s", "decode_context_tokens", "step_predictor", "offline_longest_wait", "offline_running", "offline_waiting", "offline_pending_prefill_tokens", "tier_load_tokens_per_s", "lora_resident", "lora_slots_free", "lora_load_seconds", "lora_parked")
    class TierLoadTokensPerSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECENT_TTFT_FIELD_NUMBER: _ClassVar[int]
    RECENT_TPOT_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_PREDICTOR_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_LONGEST_WAIT_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_RUNNING_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_WAITING_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_LOAD_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    LORA_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    LORA_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LORA_PARKED_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    num_running: int
    num_waiting: int
    kv_usage: float
    kv_free_tokens: int
    recent_ttft: float
    recent_tpot: float
    timestamp: float
    pending_prefill_tokens: int
    prefill_tokens_per_s: float
    decode_context_tokens: int
    step_predictor: StepTimePredictor
    offline_longest_wait: float
    offline_running: int
    offline_waiting: int
    offline_pending_prefill_tokens: int
    tier_load_tokens_per_s: _containers.ScalarMap[str, float]
    lora_resident: _containers.RepeatedScalarFieldContainer[str]
    lora_slots_free: int
    lora_load_seconds: float
    lora_parked: int
    def __init__(self, instance_id: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., kv_free_tokens: _Optional[int] = ..., recent_ttft: _Optional[float] = ..., recent_tpot: _Optional[float] = ..., timestamp: _Optional[float] = ..., pending_prefill_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_context_tokens: _Optional[int] = ..., step_predictor: _Optional[_Union[StepTimePredictor, _Mapping]] = ..., offline_longest_wait: _Optional[float] = ..., offline_running: _Optional[int] = ..., offline_waiting: _Optional[int] = ..., offline_pending_prefill_tokens: _Optional[int] = ..., tier_load_tokens_per_s: _Optional[_Mapping[str, float]] = ..., lora_resident: _Optional[_Iterable[str]] = ..., lora_slots_free: _Optional[int] = ..., lora_load_seconds: _Optional[float] = ..., lora_parked: _Optional[int] = ...) -> None: ...

class StepTimePredictor(_message.Message):
    __slots__ = ("coefficients", "correction", "profiled", "prediction_error", "token_budget", "measured_seconds", "predicted_seconds")
    COEFFICIENTS_FIELD_NUMBER: _ClassVar[int]
    CORRECTION_FIELD_NUMBER: _ClassVar[int]
    PROFILED_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_ERROR_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MEASURED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    coefficients: _containers.RepeatedScalarFieldContainer[float]
    correction: float
    profiled: bool
    prediction_error: float
    token_budget: int
    measured_seconds: float
    predicted_seconds: float
    def __init__(self, coefficients: _Optional[_Iterable[float]] = ..., correction: _Optional[float] = ..., profiled: _Optional[bool] = ..., prediction_error: _Optional[float] = ..., token_budget: _Optional[int] = ..., measured_seconds: _Optional[float] = ..., predicted_seconds: _Optional[float] = ...) -> None: ...

class EngineCounters(_message.Message):
    __slots__ = ("prompt_tokens", "generation_tokens", "finished_requests", "preemptions", "prefix_cache_queries", "prefix_cache_hits", "steps", "kv_handoffs_sent", "kv_handoffs_installed", "kv_handoff_failures", "kv_transfer_bytes", "kv_handoff_timeouts", "kv_reservations_expired", "kv_migrations_sent", "kv_migrations_installed", "kv_migration_failures", "offline_requests", "offline_prompt_tokens", "offline_generation_tokens", "offline_preemptions_kv", "offline_preemptions_batch_full", "offline_preemptions_slo", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos", "beam_steps", "beam_rows", "beam_candidates_scanned", "beam_early_terminations", "kv_handoff_store_blocks", "kv_handoff_store_fallbacks", "images_encoded", "image_cache_hits", "image_encode_seconds")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFFS_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFFS_INSTALLED_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFF_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFF_TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    KV_RESERVATIONS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    KV_MIGRATIONS_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_MIGRATIONS_INSTALLED_FIELD_NUMBER: _ClassVar[int]
    KV_MIGRATION_FAILURES_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_PREEMPTIONS_KV_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_PREEMPTIONS_BATCH_FULL_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_PREEMPTIONS_SLO_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    BEAM_STEPS_FIELD_NUMBER: _ClassVar[int]
    BEAM_ROWS_FIELD_NUMBER: _ClassVar[int]
    BEAM_CANDIDATES_SCANNED_FIELD_NUMBER: _ClassVar[int]
    BEAM_EARLY_TERMINATIONS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFF_STORE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFF_STORE_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_ENCODED_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ENCODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generation_tokens: int
    finished_requests: int
    preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    steps: int
    kv_handoffs_sent: int
    kv_handoffs_installed: int
    kv_handoff_failures: int
    kv_transfer_bytes: int
    kv_handoff_timeouts: int
    kv_reservations_expired: int
    kv_migrations_sent: int
    kv_migrations_installed: int
    kv_migration_failures: int
    offline_requests: int
    offline_prompt_tokens: int
    offline_generation_tokens: int
    offline_preemptions_kv: int
    offline_preemptions_batch_full: int
    offline_preemptions_slo: int
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    beam_steps: int
    beam_rows: int
    beam_candidates_scanned: int
    beam_early_terminations: int
    kv_handoff_store_blocks: int
    kv_handoff_store_fallbacks: int
    images_encoded: int
    image_cache_hits: int
    image_encode_seconds: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., generation_tokens: _Optional[int] = ..., finished_requests: _Optional[int] = ..., preemptions: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., steps: _Optional[int] = ..., kv_handoffs_sent: _Optional[int] = ..., kv_handoffs_installed: _Optional[int] = ..., kv_handoff_failures: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_handoff_timeouts: _Optional[int] = ..., kv_reservations_expired: _Optional[int] = ..., kv_migrations_sent: _Optional[int] = ..., kv_migrations_installed: _Optional[int] = ..., kv_migration_failures: _Optional[int] = ..., offline_requests: _Optional[int] = ..., offline_prompt_tokens: _Optional[int] = ..., offline_generation_tokens: _Optional[int] = ..., offline_preemptions_kv: _Optional[int] = ..., offline_preemptions_batch_full: _Optional[int] = ..., offline_preemptions_slo: _Optional[int] = ..., spec_decode_num_drafts: _Optional[int] = ..., spec_decode_num_draft_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., beam_steps: _Optional[int] = ..., beam_rows: _Optional[int] = ..., beam_candidates_scanned: _Optional[int] = ..., beam_early_terminations: _Optional[int] = ..., kv_handoff_store_blocks: _Optional[int] = ..., kv_handoff_store_fallbacks: _Optional[int] = ..., images_encoded: _Optional[int] = ..., image_cache_hits: _Optional[int] = ..., image_encode_seconds: _Optional[float] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("instance_id", "seq", "load", "kv_events", "counters", "draining", "unhealthy_reason", "kv_tiers", "signature")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_TIERS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    seq: int
    load: LoadReport
    kv_events: _kv_events_pb2.KVCacheEvents
    counters: EngineCounters
    draining: bool
    unhealthy_reason: str
    kv_tiers: _containers.RepeatedCompositeFieldContainer[KVTierStats]
    signature: RecordSignature
    def __init__(self, instance_id: _Optional[str] = ..., seq: _Optional[int] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., kv_events: _Optional[_Union[_kv_events_pb2.KVCacheEvents, _Mapping]] = ..., counters: _Optional[_Union[EngineCounters, _Mapping]] = ..., draining: _Optional[bool] = ..., unhealthy_reason: _Optional[str] = ..., kv_tiers: _Optional[_Iterable[_Union[KVTierStats, _Mapping]]] = ..., signature: _Optional[_Union[RecordSignature, _Mapping]] = ...) -> None: ...

class KVTierStats(_message.Message):
    __slots__ = ("tier", "queries", "hits", "corrupt", "bytes_read", "bytes_written", "blocks_written", "load_seconds", "evictions", "errors", "up", "used_bytes", "capacity_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    queries: int
    hits: int
    corrupt: int
    bytes_read: int
    bytes_written: int
    blocks_written: int
    load_seconds: float
    evictions: int
    errors: int
    up: bool
    used_bytes: int
    capacity_bytes: int
    def __init__(self, tier: _Optional[str] = ..., queries: _Optional[int] = ..., hits: _Optional[int] = ..., corrupt: _Optional[int] = ..., bytes_read: _Optional[int] = ..., bytes_written: _Optional[int] = ..., blocks_written: _Optional[int] = ..., load_seconds: _Optional[float] = ..., evictions: _Optional[int] = ..., errors: _Optional[int] = ..., up: _Optional[bool] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ...) -> None: ...
