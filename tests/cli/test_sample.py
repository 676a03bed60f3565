"""Generation (minigpt.core.generation): KV cache vs full recompute, long generation, seeds, top-k/top-p, stop tokens;
and sample.py (minigpt.cli.sample) end to end: streaming, stdin, batches, YAML config, unsafe or broken
checkpoints, bad flags."""

from __future__ import annotations

import io
import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import tiktoken
import torch

from minigpt import GPT, GPTConfig
from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.loading import load_model
from minigpt.core.errors import UserError
from minigpt.cli.errors import run_cli
from minigpt.core.generation import filter_logits, generate, prompt_ids, refill_length, sample_next
from minigpt.cli.sample import TextStreamer, main
from minigpt.core.tokenizers import ByteTokenizer, CharTokenizer, TiktokenTokenizer

REPO = Path(__file__).resolve().parents[2]
PATHS = ["sdpa", "manual", "einops"]
# "Z" is left out on purpose: a prompt with it must be refused
CHARS = "\n !',.:;?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXY"
BLOCK = 32


def tiny(arch: str = "gpt", n_kv_head: int = 4, attention: str = "sdpa", vocab_size: int = len(CHARS),
         **kw) -> GPTConfig:
    return GPTConfig(arch=arch, n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=32, block_size=BLOCK,
                     vocab_size=vocab_size, attention=attention, **kw)


def build(cfg: GPTConfig, seed: int = 0) -> GPT:
    """A random model with larger-than-init weights: its greedy output varies from token to token, so a
    cache that fed wrong positions or keys would change it (at init scale greedy repeats one token)."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
            elif p.dim() >= 2:
                p.normal_(0, 2 / math.sqrt(p.shape[-1]))
    return model.eval()


def write_ckpt(path: Path, model: GPT, tokenizer) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(model_checkpoint(model, tokenizer), path)
    return path


def prompts(batch: int = 2, length: int = 5, vocab: int = len(CHARS), seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run faster on one thread, and the CLI subprocesses get the other core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def char_ckpt(tmp_path_factory) -> Path:
    return write_ckpt(tmp_path_factory.mktemp("run") / "checkpoints" / "best.ckpt",
                      build(tiny("llama", 2)), CharTokenizer(CHARS))


def greedy_text(ckpt: Path, prompt: str, n: int) -> str:
    """What sample.py must print for a greedy run, computed in-process."""
    model, tok = load_model(ckpt)
    ids = torch.tensor([tok.encode(prompt)])
    return tok.decode(generate(model, ids, n, temperature=0)[0, ids.size(1):].tolist())


# --------------------------------------------------------------------------------------------------
# The generation loop


@pytest.mark.parametrize("attention", PATHS)
@pytest.mark.parametrize("arch,n_kv_head", [("gpt", 4), ("gpt", 2), ("llama", 4), ("llama", 2)])
def test_greedy_with_cache_equals_without(arch, n_kv_head, attention):
    model = build(tiny(arch, n_kv_head, attention))
    idx = prompts()
    n = BLOCK - idx.size(1)  # fill the block exactly: no refill, so both must compute the same function
    with_cache = generate(model, idx, n, temperature=0, use_kv_cache=True)
    without = generate(model, idx, n, temperature=0, use_kv_cache=False)
    assert with_cache.shape == (2, BLOCK)
    assert torch.equal(with_cache[:, :5], idx)
    assert torch.equal(with_cache, without)
    assert len(set(with_cache[0, 5:].tolist())) > 4  # varied output, so the comparison means something


def test_attention_override_at_load_gives_same_greedy_output(tmp_path):
    ckpt = write_ckpt(tmp_path / "a.ckpt", build(tiny("llama", 2, "sdpa")), CharTokenizer(CHARS))
    idx = prompts()
    outputs = {}
    for attention in [None, *PATHS]:
        model, _ = load_model(ckpt, attention=attention)
        assert model.config.attention == (attention or "sdpa")
        assert all(b.attn.attention == model.config.attention for b in model.transformer.h)
        outputs[attention] = generate(model, idx, 20, temperature=0)
    for attention in PATHS:
        assert torch.equal(outputs[attention], outputs[None]), attention
    assert not torch.equal(outputs[None], generate(build(tiny("llama", 2), seed=5), idx, 20, temperature=0))


@pytest.mark.parametrize("use_kv_cache", [True, False])
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_generation_longer_than_block_size(arch, use_kv_cache):
    model = build(tiny(arch, 2))
    idx = prompts(length=7)
    n = 2 * BLOCK + 5  # past the block twice: three refills of the cache
    out = generate(model, idx, n, temperature=0.8, use_kv_cache=use_kv_cache,
                   generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 7 + n)
    assert torch.equal(out[:, :7], idx)
    assert out.min() >= 0 and out.max() < model.config.vocab_size
    # a prompt longer than the block is cropped to its last block_size tokens, and kept in the output
    long_prompt = prompts(batch=1, length=BLOCK + 10)
    out = generate(model, long_prompt, 10, temperature=0, use_kv_cache=use_kv_cache)
    assert out.shape == (1, BLOCK + 20) and torch.equal(out[:, :BLOCK + 10], long_prompt)
    cropped = generate(model, long_prompt[:, -BLOCK:], 1, temperature=0, use_kv_cache=use_kv_cache)
    assert out[0, BLOCK + 10] == cropped[0, -1]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_cache_refill_is_a_fresh_prefill_of_the_last_tokens(arch):
    """When the cache is full, the loop re-fills it from the last block_size // 2 tokens at positions 0..
    and decodes on from there: until it is full again, every token is what a plain forward over the
    window starting at the refill point predicts."""
    model = build(tiny(arch, 2))
    keep = refill_length(BLOCK)
    assert keep == BLOCK // 2
    idx = prompts(batch=1, length=4)
    # the cache holds tokens 0..BLOCK-1 when token BLOCK is sampled; the next step is the refill
    n = BLOCK + 1 + keep - 4  # fill the block, refill, then fill it again
    out = generate(model, idx, n, temperature=0)
    assert torch.equal(out[:, :BLOCK + 1], generate(model, idx, BLOCK + 1 - 4, temperature=0, use_kv_cache=False))
    start = BLOCK + 1 - keep  # the refill sees out[start:BLOCK+1] at positions 0..keep-1
    with torch.inference_mode():
        expected = model(out[:, start:BLOCK + keep])[0].argmax(-1)  # predicts tokens start+1 .. BLOCK+keep
    assert torch.equal(out[0, BLOCK + 1:], expected[0, keep - 1:])


def test_same_seed_same_samples_different_seed_different():
    model = build(tiny("gpt", 4))
    idx = prompts()

    def sample(seed, **kw):
        return generate(model, idx, 25, temperature=1.0, generator=torch.Generator().manual_seed(seed), **kw)

    a, b, c = sample(1337), sample(1337), sample(7)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(sample(3, top_k=5, top_p=0.9), sample(3, top_k=5, top_p=0.9))
    # with the cache or without, the same seed draws the same tokens (within the block)
    assert torch.equal(sample(1337, use_kv_cache=False), a)


def test_stop_token_stops_pads_and_streams():
    model = build(tiny("gpt", 4))
    idx = prompts(batch=3, length=3, seed=4)
    free = generate(model, idx, 20, temperature=0)[:, 3:]
    stop = int(free[0, 4])  # row 0 produces it at step 4
    firsts = [row.index(stop) if stop in row else None for row in free.tolist()]
    seen = []
    out = generate(model, idx, 20, temperature=0, stop_token=stop, on_token=lambda t: seen.append(t.clone()))
    gen = out[:, 3:]
    # every row is the free-running output up to its first stop token, then padding with the stop token
    expected_len = 20 if None in firsts else max(firsts) + 1
    assert gen.size(1) == expected_len
    for row, first in enumerate(firsts):
        if first is None:
            assert torch.equal(gen[row], free[row, :expected_len])
        else:
            assert torch.equal(gen[row, :first + 1], free[row, :first + 1])
            assert (gen[row, first:] == stop).all()
    assert torch.equal(torch.stack(seen, dim=1), gen)  # on_token saw every step, in order
    # a single sequence ends right at its stop token
    one = generate(model, idx[:1], 20, temperature=0, stop_token=stop)
    assert one.size(1) == 3 + 5 and one[0, -1] == stop


def test_vocab_size_limits_sampled_ids():
    model = build(tiny("gpt", 4))
    out = generate(model, prompts(), 40, temperature=2.0, generator=torch.Generator().manual_seed(0),
                   vocab_size=3)
    assert out[:, 5:].max() < 3


# --------------------------------------------------------------------------------------------------
# Logit filters


def test_top_k_keeps_exactly_k_even_with_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 2.0], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    out = filter_logits(logits, top_k=2)
    kept = torch.isfinite(out)
    assert kept.sum(dim=1).tolist() == [2, 2]
    assert set(kept[0].nonzero().flatten().tolist()) <= {1, 2, 3}  # two of the three tied maxima
    assert kept[1].nonzero().flatten().tolist() == [0, 1]
    assert torch.equal(out[kept], logits[kept])  # kept logits unchanged
    out = filter_logits(logits, top_k=4)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [1, 2, 3, 5]
    assert torch.isfinite(filter_logits(logits, top_k=1)).sum().item() == 2
    assert torch.equal(filter_logits(logits, top_k=100), logits)  # k past the vocabulary keeps everything
    with pytest.raises(UserError, match="top_k must be >= 1"):
        filter_logits(logits, top_k=0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # shuffled: sorted it is 0.5, 0.3, 0.15, 0.05
    logits = probs.log().repeat(2, 1)
    logits[1] = logits[1] * 2 + 1  # a sharper second row: probs 0.735, 0.265... of the same order

    def kept(top_p):
        return [torch.isfinite(row).nonzero().flatten().tolist() for row in filter_logits(logits, top_p=top_p)]

    assert kept(0.8)[0] == [1, 3]  # 0.5 + 0.3 reaches 0.8 exactly
    assert kept(0.81)[0] == [0, 1, 3]
    assert kept(0.95)[0] == [0, 1, 3]
    assert kept(0.951)[0] == [0, 1, 2, 3]
    assert kept(1.0)[0] == [0, 1, 2, 3]
    assert kept(0.1)[0] == [1]  # the top token always stays
    sharp = (logits[1]).softmax(-1)
    assert sharp[1] < 0.8 < sharp[1] + sharp[3]
    assert kept(0.8)[1] == [1, 3]
    out = filter_logits(logits, top_p=0.8)
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])
    # both filters: top-k first, then the nucleus of what is left
    assert torch.isfinite(filter_logits(logits, top_k=3, top_p=0.99)[0]).nonzero().flatten().tolist() == [0, 1, 3]
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(UserError, match="top_p must be in"):
            filter_logits(logits, top_p=bad)


# --------------------------------------------------------------------------------------------------
# Text: prompt start, streaming


def test_empty_prompt_starts_from_newline_or_end_of_text():
    assert prompt_ids(CharTokenizer(CHARS), "") == CharTokenizer(CHARS).encode("\n")
    assert prompt_ids(ByteTokenizer(), "") == [10]
    bpe = TiktokenTokenizer(tiny_bpe())
    assert prompt_ids(bpe, "") == [bpe.eot_id] == [256]
    assert prompt_ids(CharTokenizer("ab"), "") == [0]  # no newline in the vocabulary: token 0


def test_streamer_holds_back_partial_utf8():
    text = "héllo € 🙂 ok"
    buf = io.StringIO()
    stream = TextStreamer(ByteTokenizer(), buf)
    writes = []
    for b in text.encode("utf-8"):
        before = buf.getvalue()
        stream.push([b])
        writes.append(buf.getvalue()[len(before):])
    stream.flush()
    assert buf.getvalue() == text
    assert "\ufffd" not in buf.getvalue()
    assert "🙂" in writes  # printed whole once its 4th byte arrived
    # a stop token ends the stream; nothing after it is printed
    buf = io.StringIO()
    stream = TextStreamer(CharTokenizer(CHARS), buf, stop_token=0)
    stream.push(CharTokenizer(CHARS).encode("ab"))
    stream.push([0])
    stream.push(CharTokenizer(CHARS).encode("cd"))
    stream.flush()
    assert buf.getvalue() == "ab"


def tiny_bpe() -> tiktoken.Encoding:
    """A byte-level BPE with no merges and an end-of-text token 256, built in-process (no download)."""
    return tiktoken.Encoding("tiny-bpe", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                             special_tokens={"<|endoftext|>": 256})


def test_bpe_model_stops_at_end_of_text_unless_no_stop(tmp_path, capsys):
    """A model that always predicts end-of-text: BPE sampling stops there; --no-stop keeps going."""
    model = build(tiny("gpt", 4, vocab_size=257, tie_embeddings=False))
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.normal_()
        model.lm_head.weight[256] = 100 * model.transformer.ln_f.bias
    ckpt = write_ckpt(tmp_path / "bpe.ckpt", model, TiktokenTokenizer(tiny_bpe()))
    out = io.StringIO()
    main(["--ckpt", str(ckpt), "--prompt", "héllo", "--max_new_tokens", "5"], stdout=out)
    assert out.getvalue() == "héllo\n"
    out = io.StringIO()
    main(["--ckpt", str(ckpt), "--prompt", "héllo", "--max_new_tokens", "3", "--no-stop"], stdout=out)
    assert out.getvalue() == "héllo" + "<|endoftext|>" * 3 + "\n"
    out = io.StringIO()
    main(["--ckpt", str(ckpt), "--num_samples", "2", "--max_new_tokens", "4"], stdout=out)
    assert out.getvalue() == "---------- sample 1/2 ----------\n\n---------- sample 2/2 ----------\n\n"


def test_default_checkpoint_is_the_newest_run_under_out(tmp_path, monkeypatch, char_ckpt):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "out" / "run1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(char_ckpt.read_bytes())
    class Recorder(io.StringIO):
        writes = 0

        def write(self, text):
            self.writes += bool(text)
            return super().write(text)

    out = Recorder()
    main(["--prompt", "hello", "--temperature", "0", "--max_new_tokens", "12"], stdout=out)
    assert out.getvalue() == "hello" + greedy_text(char_ckpt, "hello", 12) + "\n"
    assert out.writes == 1 + 12 + 1  # streamed: the prompt, then every token as it came, then the newline
    out2 = io.StringIO()
    main(["--ckpt", str(run), "--prompt", "hello", "--temperature", "0", "--max_new_tokens", "12",
          "--no-kv-cache", "--attention", "manual"], stdout=out2)
    assert out2.getvalue() == out.getvalue()


# --------------------------------------------------------------------------------------------------
# sample.py as a user runs it.  Each subprocess spends seconds importing torch and lightning, so all of them
# start at once (module fixture) and the tests read their results.


class Malicious:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module", autouse=True)
def cli_started(request, tmp_path_factory, char_ckpt):
    """Starts every sample.py subprocess before the first test, so their imports overlap the in-process tests."""
    if not any("cli_runs" in getattr(item, "fixturenames", ()) for item in request.session.items):
        yield None  # no CLI test selected (-k ...): start nothing
        return
    tmp = tmp_path_factory.mktemp("cli")
    prompt_file = tmp / "prompt.txt"
    prompt_file.write_text("the king:\n", encoding="utf-8")
    marker = tmp / "PWNED"
    evil = tmp / "evil.ckpt"
    torch.save({"state_dict": {}, "minigpt": {"payload": Malicious(marker)}}, evil)
    assert not marker.exists()
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}
    runs = {
        "file_batch": (["--ckpt", str(char_ckpt), "--prompt-file", str(prompt_file), "--num_samples", "3",
                        "--temperature", "0", "--max_new_tokens", "15"], None),
        "stdin_stream": (["--ckpt", str(char_ckpt.parent.parent), "--prompt", "-", "--temperature", "0",
                          "--max_new_tokens", "20"], "to be, or not"),
        "malicious": (["--ckpt", str(evil), "--prompt", "a"], None),
    }
    procs = {name: subprocess.Popen([sys.executable, "sample.py", *args], cwd=REPO, env=env, text=True,
                                    encoding="utf-8", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)
             for name, (args, _) in runs.items()}
    for name, proc in procs.items():  # small inputs: they fit the pipe buffer, nothing blocks
        proc.stdin.write(runs[name][1] or "")
        proc.stdin.close()
    yield procs, dict(marker=marker, ckpt=char_ckpt)
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def cli_runs(cli_started):
    procs, info = cli_started
    results = {}
    for name, proc in procs.items():
        out, err = proc.stdout.read(), proc.stderr.read()  # a few hundred bytes each: no pipe fills up
        results[name] = (proc.wait(timeout=120), out, err)
    return results, info


def test_cli_prompt_file_and_sample_batch(cli_runs):
    results, info = cli_runs
    code, out, err = results["file_batch"]
    assert code == 0, err
    expected = "the king:\n" + greedy_text(info["ckpt"], "the king:\n", 15) + "\n"
    assert out == "".join(f"---------- sample {i}/3 ----------\n" + expected for i in (1, 2, 3))


def test_cli_prompt_from_stdin_streams_greedy_text(cli_runs):
    results, info = cli_runs
    code, out, err = results["stdin_stream"]
    assert code == 0, err
    assert out == "to be, or not" + greedy_text(info["ckpt"], "to be, or not", 20) + "\n"


def test_cli_refuses_a_malicious_checkpoint_without_running_it(cli_runs):
    results, info = cli_runs
    code, out, err = results["malicious"]
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert "refusing to load" in err
    assert not info["marker"].exists()
    # the file is a real exploit: unrestricted unpickling would have created the marker
    decoy = info["marker"].with_name("DECOY")
    torch.save({"payload": Malicious(decoy)}, info["marker"].with_name("decoy.ckpt"))
    torch.load(info["marker"].with_name("decoy.ckpt"), weights_only=False)
    assert decoy.exists()


def test_cli_sampling_is_seeded_and_batch_rows_differ(char_ckpt):
    args = ["--ckpt", str(char_ckpt), "--prompt", "a", "--max_new_tokens", "30", "--temperature", "1.0",
            "--num_samples", "2"]

    def run(*extra):
        buf = io.StringIO()
        main([*args, *extra], stdout=buf)
        return buf.getvalue()

    out = run("--seed", "5")
    parts = out.split("---------- sample 2/2 ----------\n")
    assert len(parts) == 2 and parts[0].startswith("---------- sample 1/2 ----------\na")
    first, second = parts[0].split("\n", 1)[1], parts[1]
    assert first != second and len(first) == len(second) == 1 + 30 + 1
    assert run("--seed", "5") == out
    assert run("--seed", "6") != out
    assert run("--seed", "5", "--no-kv-cache") == out  # 31 tokens fit in the block: same function


# --------------------------------------------------------------------------------------------------
# Bad input, in-process (same code path as sample.py: main wraps everything in run_cli)


def bad_files(tmp: Path, good: Path) -> dict[str, Path]:
    """Damaged checkpoints: the dicts are hand-made on purpose, to test that loading refuses them."""
    truncated = tmp / "truncated.ckpt"
    data = good.read_bytes()
    truncated.write_bytes(data[:len(data) // 2])
    text = tmp / "notes.txt"
    text.write_text("not a checkpoint\n")
    plain = tmp / "plain.ckpt"
    torch.save({"weights": torch.zeros(3), "epoch": 1}, plain)
    no_weights = tmp / "no_weights.ckpt"  # our section, but no weights
    torch.save({"state_dict": {}, "minigpt": {"model_config": tiny().to_dict()}}, no_weights)
    hollow = tmp / "hollow.ckpt"  # weights and config, but no tokenizer
    torch.save(model_checkpoint(build(tiny()), None), hollow)
    wrong = tmp / "wrong.ckpt"  # config and tokenizer, but the weights of another shape
    ckpt = model_checkpoint(build(tiny()), CharTokenizer(CHARS))
    ckpt["minigpt"]["model_config"]["n_embd"] = 64
    torch.save(ckpt, wrong)
    bad_config = tmp / "bad_config.ckpt"  # a model config that cannot work
    ckpt = model_checkpoint(build(tiny()), CharTokenizer(CHARS))
    ckpt["minigpt"]["model_config"]["n_head"] = 5
    torch.save(ckpt, bad_config)
    future = tmp / "future.ckpt"  # written by a newer minigpt
    ckpt = model_checkpoint(build(tiny()), CharTokenizer(CHARS))
    ckpt["minigpt"]["format"] = 99
    torch.save(ckpt, future)
    return dict(missing=tmp / "missing.ckpt", truncated=truncated, text=text, plain=plain, no_weights=no_weights,
                hollow=hollow, wrong=wrong, bad_config=bad_config, future=future, empty_dir=tmp)


def one_error_line(capsys, exc: pytest.ExceptionInfo) -> str:
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("case,needle", [("missing", "not found"), ("truncated", "truncated"),
                                         ("text", "not a checkpoint"), ("plain", "not a minigpt checkpoint"),
                                         ("no_weights", "its weights do not match its config"), ("hollow", "no tokenizer"),
                                         ("wrong", "config gives (60, 64), weights hold (60, 32)"), ("bad_config", "not divisible"),
                                         ("future", "checkpoint format 99"),
                                         ("empty_dir", "no checkpoint in run directory")])
def test_bad_checkpoint_is_one_error_line(tmp_path, capsys, char_ckpt, case, needle):
    path = bad_files(tmp_path, char_ckpt)[case]
    with pytest.raises(SystemExit) as e:
        main(["--ckpt", str(path), "--prompt", "a", "--max_new_tokens", "2"], stdout=io.StringIO())
    assert needle in one_error_line(capsys, e)


@pytest.mark.parametrize("args,needle", [
    (["--prompt", "Zebra? Zed!"], "'Z'"),
    (["--prompt", "caf\u00e9"], "'\u00e9'"),
    (["--temperature", "-1"], "temperature must be >= 0 (0 = greedy), got -1.0"),
    (["--temperature", "nan"], "temperature"),
    (["--top_k", "0"], "top_k must be >= 1"),
    (["--top_k", "many"], "invalid top_k value: 'many'"),
    (["--top_p", "0"], "top_p must be in (0, 1]"),
    (["--top_p", "1.5"], "top_p must be in (0, 1]"),
    (["--max_new_tokens", "-1"], "max_new_tokens must be >= 0"),
    (["--num_samples", "0"], "--num_samples must be >= 1"),
    (["--num_samples", "two"], "num_samples"),
    (["--attention", "flash"], "attention: unknown value 'flash'; choose one of sdpa, manual, einops"),
    (["--device", "gpu"], "device 'gpu' is not a device"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "prompt file not found"),
    (["--prompt", "a", "--prompt_file", "/nonexistent/prompt.txt"], "--prompt or --prompt-file, not both"),
    (["--bogus", "1"], "unrecognized arguments: --bogus"),
    (["--config", "/nonexistent/sample.yaml"], "sample.yaml"),
])
def test_bad_input_is_one_error_line(capsys, char_ckpt, args, needle):
    with pytest.raises(SystemExit) as e:
        main(["--ckpt", str(char_ckpt), "--max_new_tokens", "2", *args], stdout=io.StringIO())
    assert needle in one_error_line(capsys, e)


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "mps"])
def test_unavailable_device_is_one_error_line(capsys, char_ckpt, device):
    kind = device.split(":")[0]
    if (torch.cuda.is_available() if kind == "cuda" else torch.backends.mps.is_available()):
        pytest.skip(f"{kind} is available here")
    with pytest.raises(SystemExit) as e:
        main(["--ckpt", str(char_ckpt), "--device", device], stdout=io.StringIO())
    err = one_error_line(capsys, e)
    assert f"device {device}: {'CUDA' if kind == 'cuda' else 'MPS'} is not available here" in err


def test_unknown_prompt_characters_are_all_named(capsys, char_ckpt):
    with pytest.raises(SystemExit) as e:
        main(["--ckpt", str(char_ckpt), "--prompt", "Zoë"], stdout=io.StringIO())
    err = one_error_line(capsys, e)
    assert "the prompt has 2 character(s) outside the model's char vocabulary" in err
    assert "'Z'" in err and "'ë'" in err and "'o'" not in err


def test_nan_weights_are_a_user_error_not_a_crash(tmp_path, capsys):
    """A checkpoint whose weights are NaN (training diverged) is bad input: one line, not a traceback."""
    model = build(tiny())
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    ckpt = write_ckpt(tmp_path / "nan.ckpt", model, CharTokenizer(CHARS))
    with pytest.raises(SystemExit) as e:
        main(["--ckpt", str(ckpt), "--prompt", "a", "--max_new_tokens", "3"], stdout=io.StringIO())
    assert "NaN/inf logits" in one_error_line(capsys, e)
    with pytest.raises(UserError, match="NaN/inf"):
        sample_next(torch.full((1, 4), float("nan")))


def test_programming_errors_keep_their_traceback(capsys):
    """run_cli flattens only UserError: a caller's bug (idx of the wrong shape) propagates as it is."""
    model = build(tiny())
    for idx in (torch.zeros(3, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)):
        with pytest.raises(ValueError, match="idx must be"):
            run_cli(lambda idx=idx: generate(model, idx, 1))
    assert capsys.readouterr().err == ""  # no 'error:' line: the exception went on, traceback and all
    with pytest.raises(UserError) as e:  # a user's setting, by contrast, is a UserError naming the concept
        generate(model, prompts(), 1, temperature=-1.0)
    assert not isinstance(e.value, ValueError)
    assert str(e.value) == "temperature must be >= 0 (0 = greedy), got -1.0"


# --------------------------------------------------------------------------------------------------
# The command's machinery: --help, --config YAML, --print_config


def test_help_runs_the_entry_script_and_exits_0(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["sample.py", "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(REPO / "sample.py"), run_name="__main__")
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    for flag in ("--ckpt", "--prompt", "--prompt-file", "--num_samples", "--max_new_tokens", "--temperature",
                 "--top_k", "--top_p", "--seed", "--device", "--attention", "--no-kv-cache", "--no-stop",
                 "--config", "--print_config"):
        assert flag in out, flag
    assert "sdpa,manual,einops" in out  # the choices, from minigpt.core.config.ATTENTIONS


def test_yaml_config_sets_options_and_flags_override_it(tmp_path, capsys, char_ckpt):
    config = tmp_path / "sample.yaml"
    config.write_text(f"ckpt: {char_ckpt}\nprompt: hello\ntemperature: 0\nmax_new_tokens: 12\n"
                      "kv_cache: false\nattention: manual\ntop_k: none\n", encoding="utf-8")
    out = io.StringIO()
    main(["--config", str(config)], stdout=out)
    assert out.getvalue() == "hello" + greedy_text(char_ckpt, "hello", 12) + "\n"
    out = io.StringIO()
    main(["--config", str(config), "--max_new_tokens", "4"], stdout=out)  # later flags win
    assert out.getvalue() == "hello" + greedy_text(char_ckpt, "hello", 4) + "\n"
    with pytest.raises(SystemExit) as e:
        main(["--config", str(config), "--print_config"])
    assert e.value.code in (0, None)
    printed = capsys.readouterr().out
    for line in ("prompt: hello", "max_new_tokens: 12", "kv_cache: false", "stop: true", "attention: manual",
                 "top_k: null"):
        assert line in printed.splitlines(), line
    config.write_text("temprature: 0\n", encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        main(["--config", str(config)], stdout=io.StringIO())
    assert "temprature" in one_error_line(capsys, e)
