from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SchedulerMessage(_message.Message):
    __slots__ = ("configure", "step", "shutdown")
    CONFIGURE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    configure: Configure
    step: Step
    shutdown: Shutdown
    def __init__(self, configure: _Optional[_Union[Configure, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ...) -> None: ...

class Configure(_message.Message):
    __slots__ = ("block_size", "max_blocks", "max_num_seqs")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    max_blocks: int
    max_num_seqs: int
    def __init__(self, block_size: _Optional[int] = ..., max_blocks: _Optional[int] = ..., max_num_seqs: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "has_seed", "seed", "logprobs", "want_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WANT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    has_seed: bool
    seed: int
    logprobs: int
    want_logprobs: bool
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., want_logprobs: _Optional[bool] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "token_ids", "prompt_len", "block_ids", "num_computed_tokens", "num_new_tokens", "sampling")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: bytes
    prompt_len: int
    block_ids: bytes
    num_computed_tokens: int
    num_new_tokens: int
    sampling: SamplingParams
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[bytes] = ..., prompt_len: _Optional[int] = ..., block_ids: _Optional[bytes] = ..., num_computed_tokens: _Optional[int] = ..., num_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class RunningSequences(_message.Message):
    __slots__ = ("seq_ids", "num_computed_tokens", "num_new_tokens", "num_new_blocks", "new_block_ids")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: bytes
    num_computed_tokens: bytes
    num_new_tokens: bytes
    num_new_blocks: bytes
    new_block_ids: bytes
    def __init__(self, seq_ids: _Optional[bytes] = ..., num_computed_tokens: _Optional[bytes] = ..., num_new_tokens: _Optional[bytes] = ..., num_new_blocks: _Optional[bytes] = ..., new_block_ids: _Optional[bytes] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("step_id", "lane", "new_sequences", "running", "released_seq_ids", "traceparents", "urgent")
    class TraceparentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    URGENT_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    lane: int
    new_sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    running: RunningSequences
    released_seq_ids: bytes
    traceparents: _containers.ScalarMap[int, str]
    urgent: bool
    def __init__(self, step_id: _Optional[int] = ..., lane: _Optional[int] = ..., new_sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., running: _Optional[_Union[RunningSequences, _Mapping]] = ..., released_seq_ids: _Optional[bytes] = ..., traceparents: _Optional[_Mapping[int, str]] = ..., urgent: _Optional[bool] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("hello", "ready", "result", "error", "heartbeat")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    ready: Ready
    result: StepResult
    error: WorkerError
    heartbeat: Heartbeat
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., ready: _Optional[_Union[Ready, _Mapping]] = ..., result: _Optional[_Union[StepResult, _Mapping]] = ..., error: _Optional[_Union[WorkerError, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("worker_id", "pid")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    pid: int
    def __init__(self, worker_id: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("worker_id", "pid")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    pid: int
    def __init__(self, worker_id: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...

class Ready(_message.Message):
    __slots__ = ("worker_id", "model_name", "context_length", "vocab_size", "dtype", "attention_backend", "device", "block_size", "num_blocks", "lookahead", "kv_cache_dtype")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    model_name: str
    context_length: int
    vocab_size: int
    dtype: str
    attention_backend: str
    device: str
    block_size: int
    num_blocks: int
    lookahead: bool
    kv_cache_dtype: str
    def __init__(self, worker_id: _Optional[int] = ..., model_name: _Optional[str] = ..., context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., attention_backend: _Optional[str] = ..., device: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., lookahead: _Optional[bool] = ..., kv_cache_dtype: _Optional[str] = ...) -> None: ...

class SequenceLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: bytes
    top_logprobs: bytes
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[bytes] = ..., top_logprobs: _Optional[bytes] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "lane", "seq_ids", "token_ids", "logprobs", "staging_seconds", "exposed_staging_seconds", "compute_seconds", "wait_seconds", "forecast", "sampling_seconds")
    class LogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: SequenceLogprobs
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[SequenceLogprobs, _Mapping]] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STAGING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_STAGING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORECAST_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    lane: int
    seq_ids: bytes
    token_ids: bytes
    logprobs: _containers.MessageMap[int, SequenceLogprobs]
    staging_seconds: float
    exposed_staging_seconds: float
    compute_seconds: float
    wait_seconds: float
    forecast: bool
    sampling_seconds: float
    def __init__(self, step_id: _Optional[int] = ..., lane: _Optional[int] = ..., seq_ids: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ..., logprobs: _Optional[_Mapping[int, SequenceLogprobs]] = ..., staging_seconds: _Optional[float] = ..., exposed_staging_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ..., forecast: _Optional[bool] = ..., sampling_seconds: _Optional[float] = ...) -> None: ...

class WorkerError(_message.Message):
    __slots__ = ("step_id", "message")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    message: str
    def __init__(self, step_id: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
