"""Text from token ids as they come: incremental detokenization cut at stop strings (`TextStream`), and the stop
matcher the engine calls for a request with stop strings (`StopStrings`). Ray-free; the engine itself never sees
text, only a matcher's answer: how many generated ids to keep."""

from __future__ import annotations


class TextStream:
    """Incremental detokenization with stop strings.

    The concatenated output equals `tokenizer.decode(all_ids, skip_special_tokens=True)` cut before the
    first stop string. Each push decodes only a short window (vLLM's prefix/read offsets), so the cost
    per step does not grow with the output. Text that could be the start of a stop string is held back
    until it cannot be.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), min_ids: int = 0):
        self.tokenizer, self.stop = tokenizer, stop
        self.min_ids = min_ids     # stop strings are looked for once more ids than this are in (vLLM's min_tokens)
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0  # ids[prefix:read] decoded last time; ids[read:] are new
        self.text = ""
        self.sent = 0              # chars of `text` already returned
        self.stopped = False       # a stop string matched; `text` ends before it
        self.num_kept_ids = 0      # once stopped: the ids up to the one that completed the stop string
        self.matched = ""          # once stopped: the stop string

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the text that can now be released (all of it when `final`). With stop strings the
        tokens are matched one at a time: the first string to complete wins and `min_ids` counts tokens, however
        the tokens came in (a speculative step's several or target-only's one), so a row stops where it would
        have stopped without speculation."""
        if not self.stop:
            return self._push(token_ids, final)
        out = ""
        for t in token_ids:
            out += self._push([t], False)
            if self.stopped:
                return out
        return out + (self._push([], True) if final else "")

    def _push(self, token_ids: list[int], final: bool) -> str:
        if self.stopped:
            return ""
        decoded_before = self.prefix_offset  # ids before this one are already part of `text`
        self.ids.extend(token_ids)
        new = self._decode_new(final)
        if new:
            start = max(0, len(self.text) - max(map(len, self.stop), default=0) + 1)
            self.text += new
            hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stop)
                    if i >= 0 and len(self.ids) > self.min_ids]
            if hits:
                at, self.matched = min(hits)
                self.num_kept_ids = self._ids_through(self.text[:at + len(self.matched)], decoded_before)
                self.text, self.stopped = self.text[:at], True
                return self._release(len(self.text))
        return self._release(len(self.text) - (0 if final else self._held()))

    def finish(self) -> str:
        """No more tokens: release what was held back (a trailing partial character included)."""
        return self.push([], final=True)

    def _decode_new(self, final: bool) -> str:
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        after = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):  # maybe a partial UTF-8 char
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before):]

    def _ids_through(self, text: str, lo: int) -> int:
        """The fewest ids whose decode starts with `text` (at least `lo + 1`): the stop string's last token."""
        for n in range(lo + 1, len(self.ids) + 1):
            if self.tokenizer.decode(self.ids[:n], skip_special_tokens=True).startswith(text):
                return n
        return len(self.ids)

    def _held(self) -> int:
        """Length of the longest end of `text` that is a proper prefix of a stop string."""
        return max((h for s in self.stop for h in range(min(len(s) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(s[:h])), default=0)

    def _release(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out, self.sent = self.text[self.sent:upto], upto
        return out


class StopStrings:
    """What a `Request.stop_strings` holds: `push(new_ids)` with each step's committed ids (the stop token of a
    row that ended on one left out), returning None until a stop string completes, then the number of generated
    ids to keep: through the one that completed it (vLLM's rule; the text itself ends before the string unless
    `include_stop_str_in_output`, which the edge that makes the text applies: `row_text`)."""

    def __init__(self, tokenizer, stop: tuple[str, ...], min_tokens: int = 0):
        self.text = TextStream(tokenizer, tuple(stop), min_tokens)

    def push(self, new_ids: list[int]) -> int | None:
        self.text.push(new_ids)
        return self.text.num_kept_ids if self.text.stopped else None


def stop_matcher(tokenizer, params) -> StopStrings | None:
    """The matcher a Request carries for `params.stop` (SamplingParams), None without stop strings. As vLLM, a stop
    string is looked for only once more than `params.min_tokens` tokens are generated."""
    return StopStrings(tokenizer, params.stop, params.min_tokens) if params.stop else None


def row_text(tokenizer, token_ids: list[int], params, ended_on_stop: bool) -> str:
    """A finished row's text as every edge gives it (`params`: SamplingParams): ended at the stop string the engine's
    matcher found (the same token-by-token matching, `min_tokens` included), the string kept when
    `include_stop_str_in_output` (vLLM's rule); else the whole decode, without the stop token that ended a row
    `ended_on_stop` (finish_reason "stop") when no string did."""
    stream = TextStream(tokenizer, params.stop, params.min_tokens)
    text = stream.push(token_ids, final=True)
    if stream.stopped:
        return text + (stream.matched if params.include_stop_str_in_output else "")
    return tokenizer.decode(token_ids[:-1] if ended_on_stop and token_ids else token_ids, skip_special_tokens=True)
