"""Chat: one template turns a conversation into token ids and the mask of what the assistant says.

    tok = ChatTokenizer.for_base(base_tokenizer)           # ChatML, <|im_start|>/<|im_end|> added as special tokens
    ids, mask = tok.encode_chat([{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}])
    prompt = tok.encode_prompt(messages)                   # a conversation to reply to, its messages read as text

The template is Jinja, rendered here and nowhere else, the way transformers renders `chat_template`: jinja2's
ImmutableSandboxedEnvironment (templates from the hub are untrusted code), with a budget per render in steps and
characters (minigpt.core.template_sandbox), trim_blocks / lstrip_blocks,
loop controls, the `{% generation %}` tag and the same helpers (tojson, raise_exception, strftime_now).  Text
inside `{% generation %}` is what the assistant says: its tokens are the mask (transformers'
return_assistant_tokens_mask gives the same mask from the exported template).  A source model's own template
without that tag gets the mask from prefix renders: each assistant turn is what its render adds to the render of the
turns before it with the generation prompt, up to and including the end-of-turn token.

ChatTokenizer wraps any minigpt tokenizer (char, byte, tiktoken, Hugging Face): tokens it adds (the turn markers
a base lacks, and for a char base the characters its corpus never had) take the ids after the base's own, and are
split out of a text before the base encodes the rest, as `tokenizers` treats added tokens.  Its dict (to_dict)
holds the base's dict, the added tokens and the template, so a checkpoint carries the chat format whole.

Two ways to encode a conversation: encode_chat reads a marker wherever the rendered text has one, as transformers'
apply_chat_template does (training data: the exports' equality with transformers rests on it); encode_prompt, for
what a client or a user types (the server, sample.py --chat, ChatSession), reads the template's own markers as
special tokens and what people wrote (system, developer and user messages) as text, so '<|im_end|>' in a message
is its characters and no message can forge a turn (as OpenAI's API reads it); the assistant's messages are the
model's own words, read as encode_chat reads them.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes

from minigpt.core.chat_text import ESCAPE, MessageText
from minigpt.core.errors import DataError, UserError, first_line
from minigpt.core.template_sandbox import TemplateSandbox
from minigpt.core.tokenizer_base import Tokenizer

__all__ = ["ChatTokenizer", "DEFAULT_CHAT_TEMPLATE", "IM_START", "IM_END", "ROLES", "compile_template"]

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ROLES = ("system", "user", "assistant")
# ChatML (as SmolLM2-Instruct and Qwen write it), with the assistant's content and end-of-turn marked for the mask
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class AssistantTracker(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: records the character span of its output (transformers' tag)."""

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        environment.extend(track_generation=self.track)
        self._blocks: list[str] | None = None
        self._spans: list[tuple[int, int]] | None = None

    def parse(self, parser: Any) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation", []), [], [], body).set_lineno(lineno)

    def _generation(self, caller: Callable[[], str]) -> str:
        text = caller()
        if self._blocks is not None:
            start = sum(map(len, self._blocks))
            self._spans.append((start, start + len(text)))
        return text

    @contextmanager
    def track(self, blocks: list[str], spans: list[tuple[int, int]]):
        self._blocks, self._spans = blocks, spans
        try:
            yield
        finally:
            self._blocks = self._spans = None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(text: str) -> jinja2.Template:
    """A chat template compiled as transformers compiles it; a syntax error is one DataError line."""
    env = TemplateSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(
            f"the chat template does not compile (line {e.lineno}: {first_line(e)}); fix its Jinja syntax"
        ) from None


def _kind(tokenizer: Tokenizer) -> str:
    """char, byte, tiktoken or hf, read from the object (core.tokenizers imports this module, not the reverse)."""
    if hasattr(tokenizer, "backend"):
        return "hf"
    if hasattr(tokenizer, "encoding"):
        return "tiktoken"
    return "char" if hasattr(tokenizer, "chars") else "byte"


class ChatTokenizer(Tokenizer):
    """A base tokenizer plus the tokens a chat format adds to it and the chat template (see the module docstring)."""

    def __init__(
        self,
        base: Tokenizer,
        template: str = DEFAULT_CHAT_TEMPLATE,
        added: Sequence[str] = (),
        specials: Iterable[str] = (),
        end_of_turn: str | None = IM_END,
    ) -> None:
        self.base, self.template, self.added = base, template, list(added)
        self.specials = sorted(set(specials))  # added tokens that are markers (special), not text characters
        self.end_of_turn = end_of_turn
        self.kind = _kind(base)
        self.name = base.name
        self.first_added = base.backend.get_vocab_size(with_added_tokens=True) if self.kind == "hf" else base.vocab_size
        self.added_ids = {t: self.first_added + i for i, t in enumerate(self.added)}
        self.vocab_size = max(base.vocab_size, self.first_added + len(self.added))
        if self.kind == "char":  # every character this vocabulary encodes (the attention probe filters by it)
            self.stoi = {**base.stoi, **{t: i for t, i in self.added_ids.items() if len(t) == 1}}
        # the start token as the export registers a base's (minigpt.hf.tokenizer_files): GPT-2's end-of-text, a char
        # vocabulary's newline (else its first character), so the harness scores a text as on the export
        self.bos_id = base.stoi.get("\n", 0) if self.kind == "char" else getattr(base, "bos_id", base.eot_id)
        self.eot_id = self.eos_id = self.token_id(end_of_turn) if end_of_turn is not None else None
        if self.eot_id is None:
            raise DataError(
                "the chat template writes no <|im_end|> and the tokenizer has no end-of-text token to end "
                "a turn with; end each turn with <|im_end|>"
                if end_of_turn is None
                else f"the chat template's end-of-turn token {end_of_turn!r} is not in the tokenizer; the model "
                "cannot end a reply"
            )
        # added tokens, longest first, are matched before the base sees the text
        self._split = (
            re.compile("(" + "|".join(map(re.escape, sorted(self.added, key=len, reverse=True))) + ")")
            if self.added
            else None
        )
        self._compiled: jinja2.Template | None = None
        self._message_text: MessageText | None = None  # encode_prompt's, built on first use

    # ------------------------------------------------------------------------------------- building and storing

    @classmethod
    def for_base(
        cls, base: Tokenizer, template: str | None = None, conversations: Iterable[list[dict[str, str]]] = ()
    ) -> ChatTokenizer:
        """A chat tokenizer over `base` (a ChatTokenizer keeps its own template and tokens): the default ChatML
        template with its markers added where the base lacks them, and, for a char base, every character of the
        rendered `conversations` its vocabulary lacks."""
        if isinstance(base, ChatTokenizer):
            chat = base
        else:
            template = template or DEFAULT_CHAT_TEMPLATE
            markers = [m for m in (IM_START, IM_END) if m in template]
            end = IM_END if IM_END in template else cls._end_of_turn(base, template)
            chat = cls(base, template, [m for m in markers if cls._base_token_id(base, m) is None], markers, end)
        if chat.kind != "char":
            return chat
        new: set[str] = set()
        for messages in conversations:
            text = chat._split.sub("", chat.render(messages)[0]) if chat._split else chat.render(messages)[0]
            new.update(c for c in set(text) if c not in chat.base.stoi)
        new -= set(chat.added)
        if not new:
            return chat
        return cls(chat.base, chat.template, chat.added + sorted(new), chat.specials, chat.end_of_turn)

    @staticmethod
    def _base_token_id(base: Tokenizer, token: str) -> int | None:
        kind = _kind(base)
        if kind == "hf":
            return base.backend.token_to_id(token)
        if kind == "tiktoken":
            return base.encoding._special_tokens.get(token) if hasattr(base.encoding, "_special_tokens") else None
        return None

    @classmethod
    def _end_of_turn(cls, base: Tokenizer, template: str) -> str | None:
        """The token a template without <|im_end|> ends a turn with: of the folder's ends (the EOS, then Gemma 3's
        <end_of_turn> whose EOS is <eos>, ...), the first the template writes after an assistant's reply (Phi-3's
        <|end|>: its generation_config lists <|assistant|> before it, and its template writes both); else the EOS
        where the template writes it, else the first other end it writes, else the EOS."""
        eos = getattr(base, "eos_id", None)
        ends = [cls._base_token(base, i) for i in (eos, *base.end_ids)]
        if ends[0] is not None:
            reply = "minigpt reply"
            try:
                text = cls(base, template, end_of_turn=ends[0]).render(
                    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": reply}]
                )[0]
            except UserError:  # a template that asks for other conversations: the rule below
                text = ""
            after = text[text.rfind(reply) + len(reply) :] if reply in text else ""
            written = sorted((after.find(t), k) for k, t in enumerate(ends) if t is not None and t in after)
            if written:
                return ends[written[0][1]]
        return next((t for t in ends if t is not None and t in template), ends[0])

    @staticmethod
    def _base_token(base: Tokenizer, i: int | None) -> str | None:
        return base.token(i) if i is not None and _kind(base) == "hf" else None

    def token_id(self, token: str) -> int | None:
        """The id of one whole token (an added one, or the base's own special token)."""
        return self.added_ids.get(token, self._base_token_id(self.base, token))

    def token(self, i: int | None) -> str | None:
        """The text of one token id, for the export's special tokens."""
        if i is None:
            return None
        if i >= self.first_added and i - self.first_added < len(self.added):
            return self.added[i - self.first_added]
        return self._base_token(self.base, i)

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "chat",
            "name": self.name,
            "base": self.base.to_dict(),
            "chat_template": self.template,
            "added_tokens": list(self.added),
            "special_tokens": list(self.specials),
            "end_of_turn": self.end_of_turn,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], base_from_dict: Callable[[Any], Tokenizer]) -> ChatTokenizer:
        """The inverse of to_dict (tokenizer_from_dict calls it, once it has checked the dict)."""
        return cls(
            base_from_dict(d["base"]), d["chat_template"], d["added_tokens"], d["special_tokens"], d["end_of_turn"]
        )

    # ------------------------------------------------------------------------------------- text <-> ids

    def encode_with_spans(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` and each token's character span (start, end) in it."""
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        pos = 0
        for piece in self._split.split(text) if self._split else [text]:
            if not piece:
                continue
            if piece in self.added_ids:
                ids.append(self.added_ids[piece])
                spans.append((pos, pos + len(piece)))
            else:
                piece_ids, piece_spans = self._base_encode(piece)
                ids += piece_ids
                spans += [(pos + a, pos + b) for a, b in piece_spans]
            pos += len(piece)
        return ids, spans

    def _base_encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        if self.kind == "hf":  # as transformers encodes a rendered chat: add_special_tokens=False
            encoding = self.base.encoding(text, add_special_tokens=False)
            return list(encoding.ids), [tuple(o) for o in encoding.offsets]
        ids = self.base.encode(text)
        if self.kind == "char":
            return ids, [(i, i + 1) for i in range(len(ids))]
        if self.kind == "byte":
            lengths = [1] * len(ids)
        else:
            lengths = [len(self.base.encoding.decode_single_token_bytes(i)) for i in ids]
        char_starts = [0]  # byte offset where each character starts
        for c in text:
            char_starts.append(char_starts[-1] + len(c.encode("utf-8", "surrogatepass")))
        spans, at = [], 0
        for n in lengths:
            first = bisect.bisect_right(char_starts, at) - 1
            last = bisect.bisect_right(char_starts, at + n - 1) - 1
            spans.append((first, last + 1))
            at += n
        return ids, spans

    def encode(self, text: str) -> list[int]:
        return self.encode_with_spans(text)[0]

    @property
    def stop_ids(self) -> frozenset[int]:
        """Its end of turn and every end its base lists (Phi-3's generation_config: <|endoftext|>, <|assistant|>)."""
        return self.base.stop_ids | {self.eot_id}

    @property
    def textless(self) -> frozenset[int]:
        """Its markers (special tokens in the export, which transformers' skip_special_tokens leaves out of a reply),
        but for those of one character, and the base's tokens that stand for no text."""
        markers = (self.token_id(t) for t in self.specials if len(t) != 1)
        return self.base.textless | {i for i in (*markers, self.eot_id) if i is not None}

    def encode_text(self, text: str) -> list[int]:
        """A text of its own (a completion's prompt) as the base encodes one: with the tokens a Hugging Face base's
        post-processor writes around a text (Llama's and Gemma's BOS), which `encode` leaves out, as it reads a
        rendered chat whose template writes its own (transformers' `tokenizer(text)` against `apply_chat_template`)."""
        ids = self.encode(text)
        if self.kind != "hf" or not ids:
            return ids
        start, end = self.base.frame
        return start + ids + end

    def decode(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            token = self.token(i) if i >= self.first_added else None
            if token is None:
                run.append(i)
                continue
            if run:
                out.append(self.base.decode(run))
                run = []
            out.append(token)
        if run:
            out.append(self.base.decode(run))
        return "".join(out)

    # ------------------------------------------------------------------------------------- conversations

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> tuple[str, list]:
        """The template's text for `messages`, and the character spans its `{% generation %}` blocks wrote."""
        if self._compiled is None:
            self._compiled = compile_template(self.template)
        specials = {
            f"{k}_token": self._base_token(self.base, getattr(self.base, f"{k}_id", None)) or "" for k in ("bos", "eos")
        }
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        env = self._compiled.environment
        chars = sum(len(m.get("content") or "") for m in messages if isinstance(m, dict))
        try:
            with env.budget(chars) as budget, env.track_generation(blocks, spans):
                for block in self._compiled.generate(
                    messages=messages, add_generation_prompt=add_generation_prompt, **specials
                ):
                    budget.emit(block)
                    blocks.append(block)
        except UserError:
            raise
        except Exception as e:  # a template is the user's (or the hub's) code: any failure in it is theirs
            raise DataError(
                f"the chat template fails to render it ({type(e).__name__}: {first_line(e)}); fix the "
                "conversation or the template"
            ) from None
        return "".join(blocks), spans

    def assistant_spans(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of what the assistant says (content and end-of-turn)."""
        text, spans = self.render(messages)
        if spans or re.search(r"\{%-?\s*generation\b", self.template):
            return text, spans
        spans = []  # a template without the tag: each assistant turn is what its render adds
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(self.render(messages[:k], add_generation_prompt=True)[0])
            end = len(self.render(messages[: k + 1])[0])
            cut = text.find(self.end_of_turn, start, end)
            spans.append((start, cut + len(self.end_of_turn) if cut >= 0 else end))
        return text, spans

    def encode_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids of a conversation for the model to reply to (the generation prompt added), what people wrote read
        as text: a marker in a system, developer or user message ('<|im_end|>', a Hugging Face base's special tokens)
        is encoded as its characters, as OpenAI's API reads what a client sends, while the template's own markers
        stay special tokens.  An assistant message is what the model said, read as encode_chat reads it, so a reply
        sent back gives the model's own tokens again (a model may write a marker's token; a char vocabulary may not
        hold its characters).  Without a marker in any message, the ids are encode_chat's (minigpt.core.chat_text
        says how)."""
        if self._message_text is None:
            self._message_text = MessageText(self.kind, self.base, self.specials, self.added_ids, self.template)
        text = self.render(self._message_text.escape(messages), add_generation_prompt=True)[0]
        ids: list[int] = []
        for piece in self._split.split(text) if self._split else [text]:
            if piece in self.added_ids:  # a marker the template wrote (or an added character)
                ids.append(self.added_ids[piece])
            elif ESCAPE in piece:  # a message's marker in it: read as text
                ids += self._message_text.ids(piece)
            elif piece:  # as encode_chat reads it
                ids += self._base_encode(piece)[0]
        return ids

    def encode_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = False, train_on_prompt: bool = False
    ) -> tuple[list[int], list[bool]]:
        """(ids, mask): mask[i] is True where token i is trained on (what the assistant says, or everything with
        train_on_prompt).  A token is the assistant's if its characters overlap an assistant span (as
        transformers' char_to_token mapping makes it)."""
        if add_generation_prompt:
            text = self.render(messages, add_generation_prompt=True)[0]
            ids = self.encode_with_spans(text)[0]
            return ids, [train_on_prompt] * len(ids)
        text, assistant = self.assistant_spans(messages)
        ids, token_spans = self.encode_with_spans(text)
        if train_on_prompt:
            return ids, [True] * len(ids)
        starts = [a for a, _ in assistant]
        mask = []
        for a, b in token_spans:
            b = max(b, a + 1)
            k = bisect.bisect_right(starts, b - 1) - 1  # the last span starting before the token ends
            mask.append(k >= 0 and a < assistant[k][1])
        return ids, mask
