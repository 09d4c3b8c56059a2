"""Incremental detokenization and stop-string detection for one request.

Method: windowed re-decoding (prefix_offset / read_offset). Each new token is
decoded together with the few tokens before it, and the text beyond the
previous window's text is emitted once it no longer ends in U+FFFD (an
incomplete UTF-8 character). This needs only `tokenizer.decode`, so it works
for any tokenizer, keeps SentencePiece leading spaces right (the window always
starts one emission earlier, or in the prompt), and - unlike
`tokenizers.decoders.DecodeStream`, which has no flush - lets us release bytes
that never become valid UTF-8 when the request finishes, so the final text
always equals `tokenizer.decode(output_ids)`.

Emission points always fall on UTF-8 character boundaries (a decode that does
not end in U+FFFD ends on a complete character), so the concatenation of the
emitted pieces equals decoding everything at once. Bytes that are invalid for
good (a lone continuation byte, a truncated character followed by ASCII) are
emitted as U+FFFD, exactly as `tokenizer.decode` does, as soon as a later
character proves them invalid, or at finish. A generated literal U+FFFD is
likewise held until the next token or finish. Cost per token: one decode of a
short window (plus one more when text is emitted), independent of the total
length; the text is kept as a list of chunks so appending is O(new text).
(Only a long run of tokens that all end mid-character makes the window grow.)
"""

from __future__ import annotations

from typing import Any

# Prompt tokens used as left context for decoding the first generated tokens.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas; finds stop strings."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self._decode_kwargs: dict[str, Any] = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:
            # Only slow (Python) tokenizers use it; don't pass the default to tokenizers that might reject it.
            self._decode_kwargs["spaces_between_special_tokens"] = False
        self.stop: list[str] = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        # As in vLLM, text of the first `min_tokens` generated tokens is never searched for stop strings.
        self.min_tokens = min_tokens
        # Chars a streamed output must hold back: a stop string may still start inside them.
        self._stop_buffer_length = (
            max(len(s) for s in self.stop) - 1 if self.stop and not include_stop_str_in_output else 0
        )
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

        self._token_ids: list[int] = []
        # Decode window: ids from prefix_offset on. Text of window[:read] was already emitted.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        prefix_text = self._decode(context) if context else ""
        if prefix_text.endswith(_REPLACEMENT_CHAR):
            # Prompt ends mid-character (or on invalid bytes): as context it would corrupt the first output char.
            context, prefix_text = [], ""
        self._window: list[int] = context
        self._read = len(context)
        self._prefix_text = prefix_text

        self._chunks: list[str] = []  # output text, in pieces (joined lazily)
        self._num_chars = 0
        self._sent = 0  # chars already returned by delta calls
        self.stop_str_hit: str | None = None  # the stop string that ended the text, if any

    # ------------------------------------------------------------------ state
    @property
    def output_token_ids(self) -> list[int]:
        """All generated ids, including a stop token excluded from the text. Do not mutate."""
        return self._token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def output_text(self) -> str:
        """The text so far (joined on demand, then cached as a single chunk)."""
        if len(self._chunks) != 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0]

    # ---------------------------------------------------------------- updates
    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append generated ids; return the stop string that ended the output, if any.

        With `stop_terminated` the engine already stopped on the last id (EOS/stop token): its text is
        never shown, and since the request is over any held-back partial bytes are released. Stop strings
        are looked for after each id: when one completes, the ids after it are not kept (several ids come
        at once from accepted speculative drafts; the output is what one id per step would have given).
        """
        if not new_token_ids:
            return None
        if self.stop_str_hit is not None:
            self._token_ids.extend(new_token_ids)
            return None  # text already ended at a stop string
        to_decode = new_token_ids[:-1] if stop_terminated else new_token_ids
        for token_id in to_decode:
            self._token_ids.append(token_id)
            self._window.append(token_id)
            stop = self._stop_in_new_text(self._append(self._decode_step(flush=False)))
            if stop is not None:
                return stop
        if stop_terminated:
            self._token_ids.append(new_token_ids[-1])
            return self._stop_in_new_text(self._append(self._decode_step(flush=True)))
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to report now: only the unsent part if `delta`, else all of it.

        Until finished, the last len(longest stop)-1 chars are held back so a reported delta is never later
        cut off by a stop string.
        """
        if finished and self.stop_str_hit is None:
            # Release text held behind bytes that never completed (those become U+FFFD). It may still hold a
            # stop string: truncate as usual; the caller can read `stop_str_hit` to learn of it.
            self._stop_in_new_text(self._append(self._decode_step(flush=True)))
        length = self._num_chars if finished else max(0, self._num_chars - self._stop_buffer_length)
        if not delta:
            text = self.output_text
            return text if length == len(text) else text[:length]
        if length <= self._sent:
            return ""
        out = self._tail(self._num_chars - self._sent)[: length - self._sent]
        self._sent = length
        return out

    # -------------------------------------------------------------- internals
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self._decode_kwargs)

    def _decode_step(self, flush: bool) -> str:
        """New text of the window's unread ids, or "" while it ends in an incomplete character.

        `flush` emits whatever is pending, incomplete bytes included (as U+FFFD, like a full decode).
        """
        if self._read >= len(self._window):
            return ""
        text = self._decode(self._window)
        if not flush and (len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR)):
            return ""  # nothing new yet (e.g. skipped special tokens) or a character still incomplete
        new_text = text[len(self._prefix_text):]
        # Slide: the unread ids become the next window's prefix context.
        del self._window[: self._read]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return new_text

    def _append(self, text: str) -> int:
        if text:
            self._chunks.append(text)
            self._num_chars += len(text)
        return len(text)

    def _tail(self, n: int) -> str:
        """Last `n` chars of the output text, in O(n)."""
        if n <= 0:
            return ""
        parts: list[str] = []
        for chunk in reversed(self._chunks):
            if len(chunk) >= n:
                parts.append(chunk[len(chunk) - n:])
                break
            parts.append(chunk)
            n -= len(chunk)
        return "".join(reversed(parts))

    def _stop_in_new_text(self, added: int) -> str | None:
        """The stop string the last `added` chars complete (the text truncated there), if any; the text of
        the first min_tokens ids may not hold one."""
        if not added or not self.stop or len(self._token_ids) <= self.min_tokens:
            return None
        return self._check_stop_strings(added)

    def _check_stop_strings(self, added: int) -> str | None:
        """Find the stop string that completes first within the last `added` chars; truncate there.

        Only the new text plus len(longest stop)-1 chars before it can hold a new match. Among matches the
        one ending earliest wins (what char-by-char streaming would see first, so the result does not depend
        on how tokens were batched); on a tie the one starting earliest (it cuts more).
        """
        region = self._tail(added + self._max_stop_len - 1)
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stop:
            # Only matches ending in the new text (one ending earlier lay within min_tokens).
            start = region.find(stop, max(0, len(region) - added - len(stop) + 1))
            if start != -1:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        if best is None:
            return None
        end, start, stop = best
        region_start = self._num_chars - len(region)
        cut = region_start + (end if self.include_stop_str_in_output else start)
        text = self.output_text[:cut]
        self._chunks = [text]
        self._num_chars = len(text)
        self.stop_str_hit = stop
        return stop
