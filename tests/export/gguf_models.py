"""The models the GGUF tests run in llama.cpp, built here (never downloaded): random ones with every weight drawn
(a swapped, untransposed or wrongly permuted matrix changes every logit), and small ones trained for a
few seconds on a text with a structure to learn, whose next-token choices are confident enough that agreement
between f32 and a quantized file measures the quantization, not noise between near-equal logits."""

from __future__ import annotations

import json
import math
import random

import torch

from minigpt.core.chat_template import ChatTokenizer
from minigpt.core.config import GPTConfig
from minigpt.core.model import GPT
from minigpt.core.tokenizers import HFTokenizer

WORDS = (
    "the quick brown fox jumps over a lazy dog while cats sit on warm mats and birds sing "
    "héllo wörld café naïve señor straße ☃ über déjà vu"
).split()


def words_text(n_lines: int = 300, seed: int = 0) -> str:
    """Lines of words drawn from a small vocabulary (with non-ASCII ones): learnable in a few hundred steps."""
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(n_lines)) + "\n"


def random_model(seed: int = 0, **config) -> GPT:
    """Every weight drawn: matrices at std 2/sqrt(fan-in) (greedy text then varies from token to token, where init
    scale repeats one token), biases at std 0.2, norm gains at 1 +- 0.2, so that each one shows in the logits."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 96, "vocab_size": 256, **config}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 2 / math.sqrt(p.shape[-1]))
            elif name.endswith("bias"):
                p.normal_(0, 0.2)
            else:
                p.normal_(1, 0.2)
    return model.eval()


def trained_model(
    ids: list[int], vocab_size: int, mask: list[bool] | None = None, steps: int = 150, seed: int = 0, **config
) -> GPT:
    """A small model trained on the token stream `ids` (AdamW, batches of 8 windows of block_size tokens; with
    `mask`, only tokens where it is True are predicted), in eval mode."""
    torch.manual_seed(seed)
    model = GPT(
        GPTConfig(**{"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 128, "vocab_size": vocab_size, **config})
    )
    data = torch.tensor(ids)
    targets = data.masked_fill(~torch.tensor(mask), -1) if mask is not None else data
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    T = model.config.block_size
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matrices this small: one thread is as fast, and never waits for a busy second core
    try:
        for _ in range(steps):
            starts = torch.randint(0, len(data) - T - 1, (8,))
            x = torch.stack([data[s : s + T] for s in starts])
            y = torch.stack([targets[s + 1 : s + T + 1] for s in starts])
            loss = model(x, y)[1]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def trained_chat_model(
    tokenizer: ChatTokenizer, conversations: list[list[dict[str, str]]], steps: int = 250, **config
) -> GPT:
    """A small model trained on the assistant turns of `conversations` (shuffled, repeated): it learns to answer
    each one and to end its turn."""
    rng = random.Random(0)
    ids: list[int] = []
    mask: list[bool] = []
    for _ in range(40):
        for messages in rng.sample(conversations, len(conversations)):
            turn_ids, turn_mask = tokenizer.encode_chat(messages)
            ids += turn_ids
            mask += turn_mask
    return trained_model(ids, tokenizer.vocab_size, mask, steps=steps, **config)


# the tokenizer tests' texts: contractions, digit runs, whitespace runs, non-ASCII letters, CJK, emoji, CRLF and
# control characters
TEXTS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\n",
    "  héllo wörld ☃ 'tis 12345\tdone\n",
    "It's I'LL they'Re WE'VE you'd 1 12 123 1234 12345678 3.14159 $1,000,000!!! ...?!",
    "a\nb  c   d\n\n\n  x\r\ny \t z    \n  \n",
    "naïve café Straße Ünïcödé — “quotes” ‘single’ déjà-vu señor",
    "日本語のテキスト 中文 한국어 Привет мир Ελληνικά العربية",
    "emoji 👍🏽 🇫🇷 ❤️ and math ∑∫√ and tabs\t\tend   ",
    "CamelCaseWords HTTPServer getX2Y3 snake_case_name kebab-case/path/to/file.py",
    # CRLF lines, and control and space characters: \v \f, the separators \x1c-\x1f, NEL, NBSP, LS, PS, the
    # ideographic space, a zero-width space, a BOM, NUL, DEL
    "Line one.\r\nLine two:\r\n\r\n\tTabbed\x0bvt\x0cff\x1cfs\x1d\x1e\x1f \x85nel\xa0nbsp\u2028ls\u2029ps"
    "\u3000ideo\u200bzw\ufeffbom\x00nul\x7fdel\x01\r\r\n \r\n",
]
CORPUS = "".join(TEXTS)
# the split patterns as their sources write them: Llama 3's and Qwen2's tokenizer.json, tiktoken's cl100k_base and
# o200k_base (tiktoken_ext/openai_public.py; their functions download the ranks, so the patterns are copied here),
# and the original GPT-2 release's
GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3 = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
QWEN2 = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
CL100K = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s"""
)
O200K = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


def byte_pair_ranks() -> dict[bytes, int]:
    """The 256 bytes, then every adjacent byte pair of the texts (the merges that can cross any split)."""
    data = CORPUS.encode()
    pairs = sorted({data[i : i + 2] for i in range(len(data) - 1)})
    return {bytes([i]): i for i in range(256)} | {p: 256 + i for i, p in enumerate(pairs)}


def hf_tokenizer(pre_tokenizer: str) -> HFTokenizer:
    """A byte-level BPE tokenizer.json made with `tokenizers`, with one of the pre-tokenizers llama.cpp knows."""
    import tokenizers as t

    from minigpt.hf.tokenizer_files import bytes_to_unicode

    alphabet = bytes_to_unicode()
    spell = lambda b: "".join(alphabet[x] for x in b)  # noqa: E731
    ranks = byte_pair_ranks()
    merges = [(spell(p[:1]), spell(p[1:])) for p, _ in sorted(ranks.items(), key=lambda kv: kv[1]) if len(p) == 2]
    backend = t.Tokenizer(t.models.BPE({spell(b): i for b, i in ranks.items()}, merges))
    byte_level = t.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre_tokenizer == "bytelevel")
    split = {"llama3": LLAMA3, "qwen2": QWEN2}.get(pre_tokenizer)
    backend.pre_tokenizer = {
        "bytelevel": byte_level,
        "smollm": t.pre_tokenizers.Sequence(
            [t.pre_tokenizers.Digits(individual_digits=True), t.pre_tokenizers.ByteLevel(add_prefix_space=False)]
        ),
    }.get(pre_tokenizer) or t.pre_tokenizers.Sequence(
        [t.pre_tokenizers.Split(t.Regex(split), behavior="isolated"), byte_level]
    )
    backend.decoder = t.decoders.ByteLevel()
    backend.add_special_tokens([t.AddedToken("<|endoftext|>", special=True, normalized=False)])
    return HFTokenizer(backend.to_str(), eos_id=backend.token_to_id("<|endoftext|>"))


# SentencePiece-style tokenizers (test_gguf_spm.py, and the Gemma 3 and Phi-3 GGUF tests)
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # Gemma's first ids
ADDED = ["<start_of_turn>", "<end_of_turn>"]
PHI3_SPECIALS = ["<unk>", "<s>", "</s>"]  # Llama 2's and Phi-3's first ids; then Phi-3's added tokens: rstrip or not
PHI3_ADDED = {"<|endoftext|>": False, "<|assistant|>": True, "<|end|>": True, "<|user|>": True, "<|system|>": True}
# how each family's tokenizer.json writes spaces as "▁": (normaliser steps, pre-tokenizer, llama.cpp's prefix)
SPACES = {
    "gemma": (["replace"], None, False),  # no dummy prefix
    "gemma-split": (["replace"], "split", False),  # as transformers converts Gemma's: a Split at " " after it
    "llama2": (["prepend", "replace"], None, True),  # the "legacy" files: "▁" before each text
    "metaspace-never": ([], "never", False),
}


def spm_tokenizer(
    spaces: str, vocab_size: int = 600, post_bos: bool = False, phi3: bool = False, converted: bool = False
) -> HFTokenizer:
    """A SentencePiece-style tokenizer.json trained with `tokenizers` on the texts: Gemma's first ids, the 256
    <0xNN> pieces, then the trained BPE (merges over "▁"-pieces, byte fallback for the rest); the specials and
    the chat markers as added special tokens; `post_bos`: a post-processor that writes the BOS first; `phi3`:
    Phi-3's specials and added tokens instead, most of which take in the whitespace after them (rstrip);
    `converted`: the merges transformers writes converting a SentencePiece model (every split of each piece into two
    pieces, in the order of the pieces), as Llama 2's and Gemma's tokenizer.json hold them."""
    import tokenizers as t

    steps, metaspace, _ = SPACES[spaces]
    normalizers = {"replace": t.normalizers.Replace(" ", "▁"), "prepend": t.normalizers.Prepend("▁")}
    trainer = t.Tokenizer(t.models.BPE())
    if steps:
        trainer.normalizer = t.normalizers.Sequence([normalizers[s] for s in steps])
    if metaspace == "split":
        trainer.pre_tokenizer = t.pre_tokenizers.Split(" ", "merged_with_previous")
    elif metaspace:
        trainer.pre_tokenizer = t.pre_tokenizers.Metaspace(prepend_scheme=metaspace, split=False)
    trainer.train_from_iterator(  # no NUL piece (refused: llama.cpp's token texts end at one): NUL falls back
        (words_text(200) + CORPUS.replace("\0", "")).splitlines(True),
        t.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False),
    )
    trained = json.loads(trainer.to_str())["model"]
    specials = PHI3_SPECIALS if phi3 else SPECIALS
    pieces = specials + [f"<0x{i:02X}>" for i in range(256)]
    pieces += [p for p, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1])]
    merges = [tuple(m) for m in trained["merges"]]
    if converted:
        from transformers.tokenization_utils_base import generate_merges

        merges = generate_merges({p: i for i, p in enumerate(pieces)})
    backend = t.Tokenizer(
        t.models.BPE({p: i for i, p in enumerate(pieces)}, merges, byte_fallback=True, unk_token="<unk>")
    )
    backend.normalizer = trainer.normalizer
    backend.pre_tokenizer = trainer.pre_tokenizer
    strip = [t.decoders.Strip(" ", 1, 0)] if SPACES[spaces][2] else []  # Llama 2's: the prefix space goes again
    backend.decoder = t.decoders.Sequence(
        [t.decoders.Replace("▁", " "), t.decoders.ByteFallback(), t.decoders.Fuse(), *strip]
    )
    if phi3:
        added = {"<unk>": False, "<s>": False, "</s>": True, **PHI3_ADDED}
        backend.add_special_tokens(
            [t.AddedToken(a, special=True, normalized=False, rstrip=r) for a, r in added.items()]
        )
    else:
        backend.add_special_tokens(SPECIALS + ADDED)
    bos, eos = ("<s>", "<|endoftext|>") if phi3 else ("<bos>", "<eos>")
    if post_bos:
        bos_id = backend.token_to_id(bos)
        backend.post_processor = t.processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    assert sum(len(p) > 1 and p not in pieces[: len(specials) + 256] for p in pieces) > 150  # merges exercised
    return HFTokenizer(backend.to_str(), bos_id=backend.token_to_id(bos), eos_id=backend.token_to_id(eos))
