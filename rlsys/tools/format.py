"""How the model calls a tool and how the answer comes back, as text.

The model writes `<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>`
(Hermes' tags, which Qwen2.5's chat template uses); its turn ends at the closing tag (with
tools.max_calls_per_turn > 1, at its end-of-turn token or its last call allowed), rlsys runs the calls and
appends the answers in call order, tokenized once and kept as ids from then on: as the model's chat template renders a tool
message (Qwen2.5: `<|im_end|>`, a user turn holding `<tool_response>...</tool_response>`, `<|im_start|>assistant`),
or inline as `<tool_response>...</tool_response>` for a model without one. A model whose chat template names other
tags of that shape gets those (`ToolFormat.from_chat_template`). An environment's answer to a turn without a call
is a user message, rendered as the template renders one after the model's turn (`user_ids`), or on a line of its
own for a model without a template.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
MAX_CALL_CHARS = 20_000  # a call longer than this is refused unread: JSON parsing is not free


class ToolCallError(ValueError):
    """The model's call cannot be read; `reason` says why, and becomes the tool's answer."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolFormat:
    """The four tags (the default is Hermes', Qwen2.5's) and, for a model whose chat template has a tool role,
    the template's text around a tool's answer: `turn_open` closes the model's turn and opens the tool's,
    `turn_close` closes the tool's and reopens the model's (ToolFormat.of)."""
    call_open: str = CALL_OPEN
    call_close: str = CALL_CLOSE
    response_open: str = RESPONSE_OPEN
    response_close: str = RESPONSE_CLOSE
    turn_open: str | None = None
    turn_close: str | None = None
    turn_between: str | None = None  # between two answers of one turn's calls, as the template renders them
    # the template's text from the end of the model's turn to a user message and from it to the model's next turn
    user_open: str = "\n"
    user_close: str = "\n"

    @classmethod
    def of(cls, tokenizer) -> "ToolFormat":
        """The format of the model's tokenizer: the tags of its chat template, and the template's tool turn when
        it renders one; the default tags, inline, otherwise."""
        template = getattr(tokenizer, "chat_template", None)
        fmt = cls.from_chat_template(template if isinstance(template, str) else None)
        turn = template_tool_turn(tokenizer) if template else None
        fmt = replace(fmt, turn_open=turn[0], turn_between=turn[1], turn_close=turn[2]) if turn else fmt
        user = template_user_turn(tokenizer) if template else None
        return replace(fmt, user_open=user[0], user_close=user[1]) if user else fmt

    @classmethod
    def from_chat_template(cls, template: str | None) -> "ToolFormat":
        """The tags a chat template writes around tool calls and tool answers (`<function_call>` ...
        `</function_call>`, say), where it has both pairs; else the default ones."""
        call = _tag_pair(template or "", r"(?:tool|function)_?calls?")
        response = _tag_pair(template or "", r"(?:tool|function)_?(?:response|result|output)s?")
        if not (call and response):
            return cls()
        return cls(*call, *response)

    def parse_call(self, text: str) -> ToolCall:
        """The call in `text`, the model's text from the opening tag to the closing one (either tag may be
        missing); ToolCallError with the reason when it is not a JSON object {"name": str, "arguments": {...}}."""
        if len(text) > MAX_CALL_CHARS:
            raise ToolCallError(f"the call is {len(text)} characters long, over the {MAX_CALL_CHARS} allowed")
        body = text.strip().removeprefix(self.call_open).removesuffix(self.call_close).strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"the call is not JSON ({e.msg} at character {e.pos})") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            raise ToolCallError('the call must be a JSON object {"name": "...", "arguments": {...}}')
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's API does
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            raise ToolCallError(f'"arguments" must be a JSON object, got {type(arguments).__name__}')
        extra = set(call) - {"name", "arguments"}
        if extra:
            raise ToolCallError(f"the call has keys besides name and arguments: {', '.join(sorted(extra))}")
        return ToolCall(call["name"], arguments)

    def split_calls(self, text: str) -> list[str]:
        """The calls of one model turn, in order: each from its opening tag (the last before its closing one) to
        its closing tag; text with no closing tag is one call (its error says why)."""
        pieces = text.split(self.call_close)[:-1]
        return [p[max(p.rfind(self.call_open), 0):] + self.call_close for p in pieces] or [text]

    def response_ids(self, tokenizer, result) -> list[int]:
        """One answer's token ids (see `responses_ids`)."""
        return self.responses_ids(tokenizer, [result])

    def responses_ids(self, tokenizer, results: list, turn_text: str = "") -> list[int]:
        """The answers to one turn's calls, in call order, as token ids appended to the model's own (never
        re-encoded): the template's text around and between tool turns (or the tags) with each tool's text in
        place, tokenized as the tokenizer reads the rendered conversation, so the ids are that span's ids, but the
        tool's text as plain text (`turn_ids`): a tool printing `</tool_response>`, `<eos>` or `<|im_end|>` cannot
        put an added token, special or not, into the conversation. `turn_text` is the model's turn from its first
        call on: what it wrote after its last call (its end-of-turn token, `<|im_end|>`) is its own and not
        written again."""
        if self.turn_open is not None:
            before, between, after = self.turn_open, self.turn_between or self.turn_close + self.turn_open, self.turn_close
        else:
            before, between, after = self.response_open, self.response_close + self.response_open, self.response_close
        written = turn_text.rpartition(self.call_close)[2].strip() if self.call_close in turn_text else ""
        if written and before.startswith(written):
            before = before[len(written):]
        parts = [(before, True)]
        for i, result in enumerate(results):
            parts += [(between, True)] * bool(i) + [(getattr(result, "text", result), False)]
        return turn_ids(tokenizer, parts + [(after, True)])

    def user_ids(self, tokenizer, result, turn_text: str) -> list[int]:
        """An environment's answer to a model turn without a call (`turn_text`, ended by the model's end-of-turn
        token), as a user message's token ids, tokenized as `responses_ids` does: the template's text around it
        (less what the model's turn already wrote of it, its `<|im_end|>`), the answer as plain text."""
        before = self.user_open
        written = next((k for k in range(len(before), 0, -1) if turn_text.endswith(before[:k])), 0)
        return turn_ids(tokenizer, [(before[written:], True), (getattr(result, "text", result), False),
                                    (self.user_close, True)])

    def render_response(self, result) -> str:
        """The text appended after the call: the tool's answer (a ToolResult's text, or a str) in its tags."""
        return f"{self.response_open}{getattr(result, 'text', result)}{self.response_close}"


MODEL_MARK, TOOL_MARK, NEXT_MARK = "\x00model-turn\x00", "\x00tool-answer\x00", "\x00next-answer\x00"  # no template's


def template_tool_turn(tokenizer) -> tuple[str, str, str] | None:
    """(the text a chat template writes from the end of the model's turn to a tool's answer, the text between two
    answers to calls of one turn, the text from the last answer to the model's next turn, the assistant
    reopened), read off the template's rendering of a conversation; None when it renders no tool message."""
    return template_gaps(tokenizer, [{"role": "tool", "content": TOOL_MARK}, {"role": "tool", "content": NEXT_MARK}])


def template_user_turn(tokenizer) -> tuple[str, str] | None:
    """(the text a chat template writes from the end of the model's turn to a user message's content, the text from
    that content to the model's next turn), read off its rendering; None when it renders no such conversation."""
    return template_gaps(tokenizer, [{"role": "user", "content": TOOL_MARK}])


def template_gaps(tokenizer, answers: list[dict]) -> tuple[str, ...] | None:
    """The text a chat template writes between the model's turn and each of `answers` (messages whose contents are
    marks) and from the last to the model's next turn, read off its rendering of the conversation; None when it
    refuses the conversation (raise_exception) or leaves a mark out."""
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": MODEL_MARK}, *answers]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that refuses the roles: the inline forms
        return None
    marks = [MODEL_MARK] + [m["content"] for m in answers]
    if not isinstance(text, str) or not re.search(".*".join(marks), text, re.S):
        return None
    gaps, rest = [], text.partition(MODEL_MARK)[2]
    for mark in marks[1:]:
        gap, _, rest = rest.partition(mark)
        gaps.append(gap)
    return (*gaps, rest)


def turn_ids(tokenizer, parts: list[tuple[str, bool]]) -> list[int]:
    """The ids of the parts' text joined, each part (text, whether it is the template's own): added tokens (special
    or not) are read in the template's text only, and the text between two of them, tools' text included, is
    tokenized as one piece, as the tokenizer reads a whole rendered conversation (a tool's `42.` and the
    template's `\n` after it may be one token)."""
    added = tokenizer.get_added_vocab()
    tag = _added_pattern(added)
    pieces: list[str | int] = [""]  # plain text and added tokens' ids, in order
    for text, own in parts:
        at = 0
        for match in (tag.finditer(text) if own and tag else ()):
            pieces[-1] += text[at:match.start()]
            pieces += [added[match.group()], ""]
            at = match.end()
        pieces[-1] += text[at:]
    names = {i: t for t, i in added.items()}
    ids = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, int):
            ids.append(piece)
        elif piece:
            ids += _text_ids(tokenizer, piece, added, names.get(pieces[i - 1], "") if i else "",
                             names.get(pieces[i + 1], "") if i + 1 < len(pieces) else "")
    return ids


def plain_ids(tokenizer, result) -> list[int]:
    """A tool's answer (a ToolResult's text, or a str) tokenized as plain text: no added token (special or not)
    comes of it."""
    text = getattr(result, "text", result)
    return _text_ids(tokenizer, text, tokenizer.get_added_vocab()) if text else []


def _text_ids(tokenizer, text: str, added: dict[str, int], before: str = "", after: str = "") -> list[int]:
    """`text`'s ids as the tokenizer reads it between the added tokens `before` and `after` (their strings; "" for
    none), tokenized with them and then left out: a tokenizer may read text after an added token otherwise than
    at the start (SentencePiece's `prepend_scheme: first` adds no word mark there). Text holding an added token's
    string is cut inside each such string instead, and its pieces tokenized apart, so none is read as the token."""
    tag = _added_pattern(added)
    if tag is None or not tag.search(text):
        bounds = [added[before]] if before else [], [added[after]] if after else []
        ids = tokenizer(before + text + after, add_special_tokens=False)["input_ids"]
        inner = ids[len(bounds[0]):len(ids) - len(bounds[1])]
        if bounds[0] + inner + bounds[1] == ids and not set(inner) & set(added.values()):
            return inner
    cuts = sorted({m.start() + 1 for a in added for m in re.finditer(re.escape(a), text)})
    return [i for start, end in zip([0, *cuts], [*cuts, len(text)])
            for i in tokenizer(text[start:end], add_special_tokens=False)["input_ids"]]


def _added_pattern(added: dict[str, int]) -> re.Pattern | None:
    """The regular expression matching any of the added tokens' strings, the longest first."""
    return re.compile("|".join(map(re.escape, sorted(added, key=len, reverse=True)))) if added else None


def _tag_pair(template: str, name: str) -> tuple[str, str] | None:
    match = re.search(rf"<({name})>", template)
    if match and f"</{match.group(1)}>" in template:
        return f"<{match.group(1)}>", f"</{match.group(1)}>"
    return None


DEFAULT = ToolFormat()
parse_call = DEFAULT.parse_call
render_response = DEFAULT.render_response
