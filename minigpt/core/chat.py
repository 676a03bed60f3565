"""Talking to a chat model: multi-turn replies that stream, stop at the end-of-turn token, and keep earlier turns in
the KV cache.

    session = ChatSession(model, tokenizer, system="Answer briefly.", temperature=0)
    session.reply("What is 12 + 30?")                 # "42"; on_text=print streams it
    session.reply("And 42 + 1?")                      # only the new turn's tokens are run through the model

    chat(model, tokenizer, "What is 12 + 30?")        # one reply, to a text or a list of messages

Each turn renders the whole conversation with the chat template (minigpt.core.chat_template's encode_prompt: a
message's text is text, so '<|im_end|>' typed by a user is its characters, not the end of a turn) and compares its ids
with those already in the cache: the common prefix stays, and only the rest is run through the model (when the
template re-tokenizes an earlier reply differently, the cache is overwritten from the first difference); a reply's
own tokens then run one at a time.  When a reply no longer has room in block_size, the oldest turns (after the
system prompt) are dropped until the conversation fills at most half of it, and the cache is filled again from the
first dropped turn: once per half a block of conversation, so a long chat costs the same per token throughout
(benchmarks/bench_long_context.py), instead of refilling the whole block at every turn.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minigpt.core.chat_template import ROLES, ChatTokenizer
from minigpt.core.errors import UnknownCharactersError, UserError
from minigpt.core.generation import Sampling, sample_next
from minigpt.core.model import GPT
from minigpt.core.tokenizer_base import IncrementalDecoder, Tokenizer

__all__ = ["ChatSession", "chat", "NO_CHAT_TEMPLATE"]

NO_CHAT_TEMPLATE = (
    "has no chat template; fine-tune it on conversations first (train.py --init_from MODEL "
    "--data.format chat --data.source CHATS.jsonl), or use a model that ships one (an Instruct model)"
)


EMPTY_TURN = {"role": "user", "content": ""}


class ChatSession:
    """One conversation with a model (see the module docstring)."""

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        system: str | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.8,
        top_k: int | None = 200,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        use_kv_cache: bool = True,
    ) -> None:
        if not isinstance(tokenizer, ChatTokenizer):
            raise UserError(f"this model {NO_CHAT_TEMPLATE}")
        if system is not None and not isinstance(system, str):
            raise UserError(f"the system prompt is {type(system).__name__}, not text; give a string (or None)")
        Sampling(temperature, top_k, top_p, max_new_tokens)  # refuses a setting that cannot work
        self.model, self.tokenizer = model, tokenizer
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.settings = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        self.max_new_tokens, self.use_kv_cache = max_new_tokens, use_kv_cache
        self.cache = model.new_kv_cache(1) if use_kv_cache else None
        self.cached: list[int] = []  # the ids whose keys and values the cache holds, at positions 0..
        self.prefilled = 0  # tokens run through the model so far (what the cache saves shows here)

    def _prompt(self, messages: list[dict[str, str]]) -> tuple[list[int], list[dict[str, str]]]:
        """The ids (with the generation prompt) of `messages`, the conversation and the new user message, and the
        messages they hold.  When a reply no longer has room (min(max_new_tokens, block_size / 2) tokens), the oldest
        turns are dropped until it fills at most half the block: the cache is then filled again from the first
        dropped turn on, once per half a block of conversation, not every turn.  A message the model cannot read
        raises UserError, and the caller's list is left as it was (no turn dropped for it)."""
        block_size = self.model.config.block_size
        room = min(self.max_new_tokens, block_size // 2)
        first = 1 if messages[0]["role"] == "system" else 0
        fits = block_size - room  # the prompt's bound until turns are dropped; then half the block
        messages = list(messages)  # turns are dropped from a copy, kept only when the new message fits
        while True:
            try:
                ids = self.tokenizer.encode_prompt(messages)  # the messages' text is text, never a marker
            except UnknownCharactersError as e:
                fix = "a char-level model reads only the characters it was trained on, so remove or replace them"
                raise e.about("the message", fix) from None
            if len(ids) <= fits or (len(ids) < block_size and len(messages) - first <= 1):
                return ids, messages
            if len(messages) - first <= 1:  # only the new message is left, and it does not fit
                if first and len(self.tokenizer.encode_prompt(messages[first:])) < block_size:
                    alone = len(self.tokenizer.encode_prompt(messages[:first] + [EMPTY_TURN]))
                    raise UserError(  # the message would fit without the system prompt: name that, not the message
                        f"the system prompt takes {alone} tokens with the chat markup, and the model reads at most "
                        f"{block_size - 1} before its reply; write a shorter system prompt (--system)"
                    )
                raise UserError(
                    f"the message is {len(ids)} tokens with the chat markup, and the model reads at most "
                    f"{block_size - 1} before its reply; write a shorter message"
                )
            del messages[first : min(first + 2, len(messages) - 1)]  # the oldest user turn and its reply, never the new
            fits = block_size // 2

    def _run(self, ids: list[int]) -> torch.Tensor:
        """Logits of the last of `ids` (the whole conversation), running only what the cache does not hold."""
        same = 0
        if self.cache is not None:
            for a, b in zip(self.cached, ids):
                if a != b:
                    break
                same += 1
            same = min(same, len(ids) - 1)  # at least one token runs, to give the next token's logits
            if not all(layer.resumable(same) for layer in self.cache):  # a sliding layer dropped what `same` needs
                same = 0
        self.cached = self.cached[:same] + ids[same:]
        return self._forward(same)

    def _next(self, token: int) -> torch.Tensor:
        """Logits after one more token of the reply: one position through the cache (the reply's tokens need no
        comparison with the cache, unlike a new turn's)."""
        self.cached.append(token)
        return self._forward(len(self.cached) - 1 if self.cache is not None else 0)

    def _forward(self, start: int) -> torch.Tensor:
        """Run self.cached[start:] (through the cache from position `start`, or all of it without one)."""
        new = torch.tensor([self.cached[start:]], device=self.model.lm_head.weight.device)
        self.prefilled += new.size(1)
        if self.cache is None:
            return self.model(new)[0][0, -1]
        return self.model(new, kv_cache=self.cache, input_pos=start)[0][0, -1]

    @torch.inference_mode()
    def reply(self, text: str, on_text: Callable[[str], object] | None = None) -> str:
        """The assistant's reply to the user's `text` (streamed to on_text as it grows), added to the conversation.
        A message the model cannot read (too long for the block, characters a char model lacks) raises UserError and
        leaves the conversation as it was; so does a reply cut short (Ctrl-C, an error in on_text)."""
        if not isinstance(text, str):
            raise UserError(f"the message is {type(text).__name__}, not text; give a string")
        ids, kept = self._prompt([*self.messages, {"role": "user", "content": text}])
        budget = min(self.max_new_tokens, self.model.config.block_size - len(ids))
        reply: list[int] = []
        decoder = IncrementalDecoder(self.tokenizer)  # the reply's text as it grows, decoded on its own
        logits = self._run(ids) if budget > 0 else None
        for step in range(budget):
            token = int(sample_next(logits[None, : self.tokenizer.vocab_size], **self.settings)[0])
            if token in self.tokenizer.stop_ids:  # its end of turn, or another end its folder lists
                break
            reply.append(token)
            if (piece := decoder.push(token)) and on_text is not None:
                on_text(piece)
            if step + 1 < budget:
                logits = self._next(token)
        answer = self.tokenizer.decode_text(reply)  # the decoder's text: a marker the model wrote is no text
        if (rest := decoder.finish()) and on_text is not None:
            on_text(rest)
        # the turn joins the conversation only whole: a user turn left without its reply made the next render two
        # user turns in a row, which templates that insist on alternating roles (Llama 2's, Mistral's) refuse
        kept.append({"role": "assistant", "content": answer})
        self.messages[:] = kept  # in place: a list the caller holds stays the conversation
        return answer


def chat(
    model: GPT,
    tokenizer: Tokenizer,
    messages: str | list[dict[str, str]],
    system: str | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
) -> str:
    """The model's reply to `messages` (a user's text, or a conversation ending with a user turn); greedy by
    default.  For several turns that reuse the KV cache, use ChatSession."""
    if not isinstance(messages, str):
        _check_messages(messages)
        if system is not None and any(m["role"] == "system" for m in messages):  # it rendered two system turns
            raise UserError("chat: the system prompt is given twice (system= and a system message); give one of them")
    generator = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed) if seed is not None else None
    session = ChatSession(model, tokenizer, system, max_new_tokens, temperature, top_k, top_p, generator)
    if isinstance(messages, str):
        return session.reply(messages)
    session.messages += [dict(m) for m in messages[:-1]]
    return session.reply(messages[-1]["content"])


def _check_messages(messages: object) -> None:
    """Refuse, in one line, a conversation the chat template cannot take: what chat() is given, checked as training's
    chat data is (minigpt.data.conversations, a layer above core), less the assistant turn a reply does not need."""
    fix = 'give a list of {"role": ..., "content": "..."} dicts'
    if not isinstance(messages, (list, tuple)):
        raise UserError(f"chat: the messages are {type(messages).__name__}, not a text or a list of messages; {fix}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UserError(f"chat: message {i} is {type(m).__name__}, not a message; {fix}")
        for key in ("role", "content"):
            if key not in m:
                raise UserError(f'chat: message {i} has no "{key}"; give every message a "role" and a "content"')
        if m["role"] not in ROLES:
            raise UserError(f"chat: message {i} has the unknown role {m['role']!r}; use one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise UserError(f"chat: message {i}'s content is {type(m['content']).__name__}, not text; give a string")
    if not messages or messages[-1]["role"] != "user":
        raise UserError("chat: the conversation must end with a user message for the model to answer")
