"""llama.cpp, run in this process through xllamacpp (prebuilt llama.cpp with Python bindings): its own server on
127.0.0.1 (a free port it picks), asked over HTTP for what the GGUF tests compare with minigpt: its tokenization of
a text, its greedy tokens, its next-token log-probabilities and its chat replies.  Shared by the tests and
benchmarks/bench_gguf.py."""

from __future__ import annotations

import gc
import json
import urllib.request
from pathlib import Path


class LlamaCpp:
    """One GGUF file loaded by llama.cpp's server (CPU, greedy unless asked otherwise); use as a context manager."""

    def __init__(self, path: str | Path, n_ctx: int = 0, threads: int = 1, f32_cache: bool = True) -> None:
        import xllamacpp

        params = xllamacpp.CommonParams()
        params.model.path = str(path)
        params.n_ctx = n_ctx  # 0: the model's context_length
        params.n_parallel = 1
        params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
        params.warmup = False
        params.sampling.temp = 0.0
        params.sampling.top_k = 1
        if f32_cache:  # keys and values as computed (llama.cpp's default rounds them to f16): compare the export only
            params.cache_type_k = params.cache_type_v = xllamacpp.ggml_type.GGML_TYPE_F32
            params.flash_attn_type = xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.server = xllamacpp.Server(params)
        self.url = self.server.listening_address
        # one request through the server's task loop before anything else: a server closed before that loop was
        # running waited forever in its destructor (the loop started after the stop it was sent; seen with a test
        # that only tokenized, which the HTTP thread answers alone)
        self.completion([0], 1)

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.server = None  # its destructor stops the HTTP server and frees the model
        gc.collect()

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        """llama.cpp's ids for `text`, as a prompt is tokenized (special markers parsed; BOS only if asked)."""
        return self.post("/tokenize", {"content": text, "add_special": add_special, "parse_special": True})["tokens"]

    def detokenize(self, ids: list[int]) -> str:
        """llama.cpp's text for `ids` (special tokens written out)."""
        return self.post("/detokenize", {"tokens": ids})["content"]

    def completion(self, ids: list[int], n: int, **options) -> dict:
        body = {
            "prompt": ids,
            "n_predict": n,
            "temperature": 0.0,
            "top_k": 1,
            "return_tokens": True,
            "cache_prompt": True,
            **options,
        }
        return self.post("/completion", body)

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """Up to n tokens llama.cpp picks greedily after `ids` (it stops early at its end-of-sequence token)."""
        return self.completion(ids, n)["tokens"]

    def argmax_along(self, ids: list[int], continuation: list[int]) -> list[int]:
        """llama.cpp's greedy choice after ids + continuation[:t], for each t: equal to `continuation` exactly when
        its own greedy run would write it (end-of-sequence or not, which its --ignore-eos would forbid)."""
        return [
            max(lp, key=lp.get)
            for lp in (self.next_logprobs(ids + continuation[:t], 1) for t in range(len(continuation)))
        ]

    def next_logprobs(self, ids: list[int], k: int) -> dict[int, float]:
        """token id -> log-probability of the k likeliest next tokens after `ids` (softmax of the raw logits).

        The server reports probabilities with the text it writes, and holds text back while it ends inside a UTF-8
        character (a byte token); so one token that is a whole character is forced by a logit bias, applied after
        the raw distribution the probabilities come from."""
        result = self.completion(ids, 1, n_probs=k, post_sampling_probs=False, logit_bias=[[self.whole_char, 1e9]])
        return {p["id"]: p["logprob"] for p in result["completion_probabilities"][0]["top_logprobs"]}

    def scores(self, ids: list[int], start: int, n_vocab: int) -> tuple[list[int], list[float]]:
        """For each position t >= start of `ids`: llama.cpp's greedy choice after ids[:t] and the log-probability it
        gives ids[t] (teacher forcing, as a perplexity is measured)."""
        choices, logprobs = [], []
        for t in range(start, len(ids)):
            lp = self.next_logprobs(ids[:t], n_vocab)
            choices.append(max(lp, key=lp.get))
            logprobs.append(lp[ids[t]])
        return choices, logprobs

    @property
    def whole_char(self) -> int:
        if not hasattr(self, "_whole_char"):
            self._whole_char = next(
                ids[0] for text in ("a", "e", " ", ".", "\n", "0", "x") if len(ids := self.tokenize(text)) == 1
            )
        return self._whole_char

    def chat(self, messages: list[dict[str, str]], max_tokens: int = 64) -> tuple[str, str]:
        """(reply, finish_reason) of llama.cpp's chat API, which renders the GGUF's own chat template."""
        result = self.server.handle_chat_completions(
            {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
        )
        choice = result["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
