"""Stop conditions, incremental detokenization and streamed output chunks.

Stop strings may span token boundaries: streamed text holds back the last
``max(len(stop)) - 1`` characters until they can no longer start a stop
string, so text once sent is never retracted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xllm.core.detokenizer import IncrementalDetokenizer, TokenDecoder
from xllm.core.sequence import Sequence
from xllm.proto.engine.v1 import engine_pb2

STOP = engine_pb2.FINISH_REASON_STOP
LENGTH = engine_pb2.FINISH_REASON_LENGTH
ABORT = engine_pb2.FINISH_REASON_ABORT
ERROR = engine_pb2.FINISH_REASON_ERROR
HANDED_OFF = engine_pb2.FINISH_REASON_HANDED_OFF


@dataclass
class RequestOutput:
    """Output-side state of one request."""

    seq: Sequence
    detok: IncrementalDetokenizer
    text: str = ""
    sent_chars: int = 0
    finish_reason: int = engine_pb2.FINISH_REASON_UNSPECIFIED
    stop_reason: str = ""
    pending_ids: list[int] = field(default_factory=list)
    num_generated: int = 0  # tokens appended so far (the sequence may hold a placeholder beyond)
    pending_logprobs: list[engine_pb2.TokenLogprob] = field(default_factory=list)
    kv_target: engine_pb2.KVTarget | None = None  # prefill phase: where the KV goes
    error: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED


class OutputProcessor:
    """Applies one sampled token to a request and builds its stream chunk."""

    def __init__(self, decoder: TokenDecoder, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.decoder = decoder
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def new_request(self, seq: Sequence, sent_chars: int = 0) -> RequestOutput:
        """The output state of a new request. A resumed one (``seq.num_resumed`` > 0) replays its
        earlier output through the detokenizer and the stop checks, token by token as one run
        would have, and counts the first ``sent_chars`` characters of that text as delivered: what
        an earlier run held back (a possible stop string, a character split at the failure) comes
        out with the next chunk, and a stop string begun before the failure still matches. The
        replay may end the request (its earlier run had ended; only its final chunk was lost):
        ``finished`` is then set and :meth:`take_chunk` gives the final chunk."""
        earlier = seq.prompt_ids[seq.num_request_prompt_tokens:]
        detok = IncrementalDetokenizer.for_prompt(self.decoder, seq.prompt_ids[:seq.num_request_prompt_tokens],
                                                  seq.params.skip_special_tokens)
        out = RequestOutput(seq, detok)
        for token in earlier:
            if out.finished:
                break
            self.append_token(out, token, None)
        out.pending_ids = []
        out.sent_chars = min(sent_chars, len(out.text))
        return out

    def append_token(self, out: RequestOutput, token: int,
                     logprob: tuple[float, list[tuple[int, float]]] | None) -> None:
        """Record the request's next generated ``token`` and decide whether the request ends."""
        seq, p = out.seq, out.seq.params
        out.num_generated += 1
        out.pending_ids.append(token)
        if logprob is not None:
            chosen, top = logprob
            out.pending_logprobs.append(engine_pb2.TokenLogprob(
                token_id=token, logprob=chosen,
                top=[engine_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top]))
        if token in p.stop_token_ids:
            self._finish(out, STOP, str(token))
        elif not p.ignore_eos and token in self.eos_token_ids:
            self._finish(out, STOP, "")
        else:
            before = len(out.text)
            out.text += out.detok.push([token])
            if p.stop and self._check_stop_strings(out, before):
                return
        if not out.finished and (out.num_generated >= p.max_tokens
                                 or seq.num_request_prompt_tokens + out.num_generated >= self.max_model_len):
            self._finish(out, LENGTH, "")

    def abort(self, out: RequestOutput) -> None:
        self._finish(out, ABORT, "")

    def fail(self, out: RequestOutput, error: str) -> None:
        self._finish(out, ERROR, "")
        out.error = error

    @staticmethod
    def handed_off_chunk(out: RequestOutput) -> engine_pb2.GenerateResponse:
        """Prefill side: the request's last chunk here. No text: what the first token's chunk held
        back (a possible stop string) is the decode side's to release, from the same state."""
        out.finish_reason = HANDED_OFF
        seq = out.seq
        return engine_pb2.GenerateResponse(
            request_id=seq.request_id, finish_reason=HANDED_OFF,
            usage=_usage(out))

    def take_chunk(self, out: RequestOutput) -> engine_pb2.GenerateResponse:
        """The stream chunk for everything produced since the last call; the final
        chunk (finish reason set) carries all remaining text and the usage."""
        p = out.seq.params
        if out.finished:
            limit = len(out.text)
        else:
            hold = max((len(s) for s in p.stop), default=1) - 1
            limit = max(out.sent_chars, len(out.text) - hold)
        chunk = engine_pb2.GenerateResponse(
            request_id=out.seq.request_id,
            token_ids=out.pending_ids,
            text=out.text[out.sent_chars:limit],
            logprobs=out.pending_logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            error=out.error,
        )
        out.sent_chars = limit
        out.pending_ids = []
        out.pending_logprobs = []
        if out.finished:
            chunk.usage.CopyFrom(_usage(out))
        return chunk

    def _check_stop_strings(self, out: RequestOutput, before: int) -> bool:
        p = out.seq.params
        longest = max(len(s) for s in p.stop)
        start = max(0, before - longest + 1)
        best: tuple[int, str] | None = None
        for s in p.stop:
            idx = out.text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        idx, s = best
        out.text = out.text[: idx + (len(s) if p.include_stop_str_in_output else 0)]
        out.finish_reason, out.stop_reason = STOP, s
        return True

    @staticmethod
    def _finish(out: RequestOutput, reason: int, stop_reason: str) -> None:
        """End the request, releasing any text the detokenizer still held back."""
        out.finish_reason, out.stop_reason = reason, stop_reason
        out.text += out.detok.flush()


def _usage(out: RequestOutput) -> engine_pb2.Usage:
    """The whole request's usage (a resumed request: the client's prompt, every run's output)."""
    seq = out.seq
    prompt = seq.num_request_prompt_tokens
    return engine_pb2.Usage(prompt_tokens=prompt, completion_tokens=out.num_generated,
                            cached_prompt_tokens=min(seq.num_cached_prompt_tokens, prompt))
