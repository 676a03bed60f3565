"""The chat page at `/`, in headless Chromium: a user types a message, sees the reply stream in, sends a second turn;
the page loads nothing from the network."""

from __future__ import annotations

import itertools
import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.resources import files

import httpx
import pytest
from serve_support import BLOCK, alone, free_port, serving

from browser import Browser, chromium_path
from minigpt import ChatSession
from minigpt.serve.app import create_app

needs_chromium = pytest.mark.skipif(
    chromium_path() is None, reason="chromium is not installed (apt-get install chromium; .ci/run installs it)"
)

# tiny models run faster on one torch thread; the server's event loop and the clients get the other core
pytestmark = pytest.mark.usefixtures("one_thread")

# the reply as the user saw it grow: the last assistant bubble's text at every change of the conversation
WATCH = """window.seen = [];
new MutationObserver(() => {
  const replies = document.querySelectorAll('.assistant');
  if (replies.length) window.seen.push(replies[replies.length - 1].textContent);
}).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});"""
LAST_REPLY = "[...document.querySelectorAll('.assistant')].at(-1).textContent"


def test_the_page_is_one_file_that_names_no_other_site():
    page = (files("minigpt.serve") / "static" / "index.html").read_text(encoding="utf-8")
    for outside in ("http://", "https://", "//cdn", "src=", "@import"):
        assert outside not in page, outside


@needs_chromium
def test_a_user_chats_two_turns_in_chromium_and_the_replies_stream(chat_model):
    model, tok = chat_model
    session = ChatSession(model, tok, system="You are a poet.", max_new_tokens=30, temperature=0, top_k=None)
    with serving(create_app(model, tok, "tiny-chat")) as url, Browser() as page:
        assert "default-src 'none'" in httpx.get(f"{url}/").headers["content-security-policy"]
        page.goto(f"{url}/")
        page.wait_for("document.getElementById('status').textContent.includes('tiny-chat')")
        page.type_text("#system", "You are a poet.")
        page.evaluate("document.getElementById('temperature').value = '0'")  # greedy, to compare with ChatSession
        page.type_text("#max_tokens", "30")
        for turn, text in enumerate(["tell me a story", "and then?"], start=1):
            page.evaluate(WATCH)
            page.type_text("#input", text)
            page.press("Enter")
            page.wait_for(
                f"document.querySelectorAll('.assistant').length === {turn} && document.body.dataset.busy === '0'"
            )
            expected = session.reply(text)
            assert page.evaluate(LAST_REPLY) == expected
            grew = [t for t in dict.fromkeys(page.evaluate("window.seen")) if t]  # distinct, in order
            assert len(grew) >= 3 and grew[-1] == expected, grew  # streamed: seen in parts before the whole
            assert all(expected.startswith(t) for t in grew)
        assert page.evaluate("document.querySelectorAll('.user').length") == 2
        assert page.evaluate("document.querySelectorAll('.error').length") == 0
        assert page.errors == []
    assert page.requests and all(r.startswith(f"{url}/") for r in page.requests), page.requests
    assert sum(r == f"{url}/v1/chat/completions" for r in page.requests) == 2


@needs_chromium
def test_a_base_model_page_continues_the_text_sent(base_model):
    """A base model has no chat template: the page said chat was not available yet kept Send, and every message
    was a 400.  Now it continues each text sent, through /v1/completions.  With Max tokens empty it asks for what
    surely fits the context (it asked for 200, a 400 in a context under 200 + the text: the default config's 128)."""
    model, tok = base_model
    with serving(create_app(model, tok, "tiny-base")) as url, Browser() as page:
        page.goto(f"{url}/")
        page.wait_for("document.getElementById('status').textContent.includes('continues the text you send')")
        assert page.evaluate("document.getElementById('send').textContent") == "Continue"
        assert page.evaluate("document.getElementById('system_row').hidden")
        page.evaluate("document.getElementById('temperature').value = '0'")
        page.type_text("#input", "the cat")  # Max tokens empty
        page.press("Enter")
        done = "document.querySelectorAll('.assistant, .error').length === 1 && document.body.dataset.busy === '0'"
        page.wait_for(done)
        assert page.evaluate("[...document.querySelectorAll('.error')].map(e => e.textContent)") == []
        expected = tok.decode(alone(model, tok, tok.encode("the cat"), BLOCK - len("the cat") - 2))  # 151 of 200
        assert page.evaluate(LAST_REPLY) == expected
        assert page.evaluate("document.querySelectorAll('.error').length") == 0 and page.errors == []
    assert sum(r == f"{url}/v1/completions" for r in page.requests) == 1


# the request bodies the page sends, as it sent them
SPY = """window.bodies = [];
const fetched = window.fetch;
window.fetch = (url, options) => {
  if (options && options.body) window.bodies.push(JSON.parse(options.body));
  return fetched(url, options);
};"""


@contextmanager
def paused_after(model, calls: int):
    """The model's calls after the first `calls` wait until the event is set (at most 30 s): a reply stays mid-way,
    whatever the machine's speed, for as long as the test needs."""
    go, count = threading.Event(), itertools.count(1)

    def wait(module, args) -> None:
        if next(count) > calls:
            go.wait(30)

    hook = model.register_forward_pre_hook(wait)
    try:
        yield go
    finally:
        go.set()
        hook.remove()


@needs_chromium
def test_new_chat_while_a_reply_streams_starts_an_empty_conversation(chat_model):
    """New chat during a reply: the stopped reply's end came after the conversation was emptied and was added to the
    new one, so the next message was sent after an assistant turn the user no longer saw."""
    model, tok = chat_model
    with serving(create_app(model, tok, "tiny-chat")) as url, Browser() as page:
        page.goto(f"{url}/")
        page.wait_for("document.getElementById('status').textContent.includes('tiny-chat')")
        page.evaluate(SPY)
        page.evaluate("document.getElementById('temperature').value = '0'")
        page.type_text("#max_tokens", "30")
        with paused_after(model, 4) as go:  # the prompt's prefill and 3 steps: 4 characters shown
            page.type_text("#input", "tell me a story")
            page.press("Enter")
            page.wait_for(f"{LAST_REPLY}.length === 4")
            page.evaluate("document.getElementById('clear').click()")
            go.set()
        page.wait_for("document.body.dataset.busy === '0'")
        page.type_text("#input", "and then?")
        page.press("Enter")
        page.wait_for("document.querySelectorAll('.assistant').length === 1 && document.body.dataset.busy === '0'")
        assert page.evaluate("window.bodies.at(-1).messages") == [{"role": "user", "content": "and then?"}]
        fresh = ChatSession(model, tok, max_new_tokens=30, temperature=0, top_k=None).reply("and then?")
        assert page.evaluate(LAST_REPLY) == fresh
        assert page.evaluate("document.querySelectorAll('.msg').length") == 2 and page.errors == []


@needs_chromium
def test_a_server_with_an_api_key_says_where_the_page_takes_it(chat_model):
    """The page showed the server's 401 as it is for API clients ('send the header Authorization: Bearer KEY'), which
    its user cannot do; it now says to enter the key in the page's API key field, and then the page works."""
    model, tok = chat_model
    with serving(create_app(model, tok, "tiny-chat", api_key="s3cret")) as url, Browser() as page:
        page.goto(f"{url}/")
        page.wait_for("document.getElementById('status').textContent.includes('tiny-chat')")
        assert not page.evaluate("document.getElementById('key_row').hidden")
        page.type_text("#max_tokens", "5")
        page.type_text("#input", "hello")
        page.press("Enter")
        page.wait_for("document.querySelectorAll('.error').length === 1 && document.body.dataset.busy === '0'")
        assert "enter it in the API key field" in page.evaluate("document.querySelector('.error').textContent")
        page.type_text("#api_key", "s3cret")
        assert page.evaluate("document.getElementById('input').value") == "hello"  # not taken: back in the box
        page.evaluate("document.getElementById('input').focus()")
        page.press("Enter")
        page.wait_for("document.querySelectorAll('.assistant').length === 1 && document.body.dataset.busy === '0'")
        assert page.evaluate("document.querySelectorAll('.error').length") == 1 and page.errors == []
    assert all(r.startswith(f"{url}/") for r in page.requests), page.requests  # the key goes nowhere else


@needs_chromium
def test_a_conversation_past_the_context_says_new_chat_starts_over(chat_model):
    """A message that fits alone but not after the earlier turns got the server's 'send a shorter prompt', however
    short it was; the page now says that the earlier turns count and that New chat starts over (and it does)."""
    model, tok = chat_model
    long = "a" * (BLOCK - 30)  # fits the context alone, with a 1-token reply
    fits = len(tok.encode_prompt([{"role": "user", "content": long}])) < BLOCK
    assert (
        fits
        and len(
            tok.encode_prompt(
                [{"role": "user", "content": "tell me a story"}] * 2 + [{"role": "user", "content": long}]
            )
        )
        > BLOCK
    )
    with serving(create_app(model, tok, "tiny-chat")) as url, Browser() as page:
        page.goto(f"{url}/")
        page.wait_for("document.getElementById('status').textContent.includes('tiny-chat')")
        page.type_text("#max_tokens", "1")
        page.type_text("#input", "tell me a story")
        page.press("Enter")
        page.wait_for("document.body.dataset.busy === '0' && document.querySelectorAll('.assistant').length === 1")
        page.type_text("#input", long)
        page.press("Enter")
        page.wait_for("document.body.dataset.busy === '0' && document.querySelectorAll('.error').length === 1")
        assert "New chat starts an empty conversation" in page.evaluate("document.querySelector('.error').textContent")
        assert page.evaluate("document.getElementById('input').value") == long  # not taken: back in the box
        page.evaluate("document.getElementById('clear').click(); document.getElementById('input').focus()")
        page.press("Enter")
        page.wait_for("document.querySelectorAll('.assistant').length === 1 && document.body.dataset.busy === '0'")
        assert page.evaluate("document.querySelectorAll('.error').length") == 0 and page.errors == []


@needs_chromium
def test_enter_sends_and_shift_enter_or_an_input_methods_enter_does_not(chat_model):
    """Enter that confirms an input method's word (Chinese, Japanese, Korean typing) sent the half-typed message."""
    model, tok = chat_model
    with serving(create_app(model, tok, "tiny-chat")) as url, Browser() as page:
        page.goto(f"{url}/")
        page.wait_for("document.getElementById('status').textContent.includes('tiny-chat')")
        page.type_text("#max_tokens", "3")
        page.type_text("#input", "one")
        enter = "{key: 'Enter', bubbles: true, cancelable: true, isComposing: true}"
        page.evaluate(f"document.getElementById('input').dispatchEvent(new KeyboardEvent('keydown', {enter}))")
        page.press("Enter", shift=True)  # a new line in the message
        page.type_text("#input", "two")
        assert page.evaluate("document.querySelectorAll('.msg').length") == 0  # nothing sent yet
        assert page.evaluate("document.getElementById('input').value") == "one\ntwo"
        page.press("Enter")
        page.wait_for("document.querySelectorAll('.assistant').length === 1 && document.body.dataset.busy === '0'")
        assert page.evaluate("document.querySelector('.user').textContent") == "one\ntwo" and page.errors == []


@needs_chromium
def test_stop_before_any_text_says_so_and_sends_no_empty_turn(chat_model):
    """Stop before the reply's first text left an empty bubble showing "…" for good, and the next message went out
    after an empty assistant turn; now the bubble says it stopped, and the asked message stays, with no reply."""
    model, tok = chat_model
    with serving(create_app(model, tok, "tiny-chat")) as url, Browser() as page:
        page.goto(f"{url}/")
        page.wait_for("document.getElementById('status').textContent.includes('tiny-chat')")
        page.evaluate(SPY)
        page.type_text("#max_tokens", "3")
        with paused_after(model, 0):  # the prompt's prefill waits: no text can come
            page.type_text("#input", "tell me a story")
            page.press("Enter")
            page.wait_for("window.bodies.length === 1")
            page.evaluate("document.getElementById('stop').click()")
            page.wait_for("document.body.dataset.busy === '0'")
        assert page.evaluate(LAST_REPLY) == "stopped before any text"
        page.type_text("#input", "and then?")
        page.press("Enter")
        page.wait_for("document.querySelectorAll('.assistant').length === 2 && document.body.dataset.busy === '0'")
        asked = [{"role": "user", "content": "tell me a story"}, {"role": "user", "content": "and then?"}]
        assert page.evaluate("window.bodies.at(-1).messages") == asked
        assert page.evaluate("document.querySelectorAll('.error').length") == 0 and page.errors == []


@needs_chromium
def test_a_temperature_or_max_tokens_it_cannot_read_is_refused_in_the_page(chat_model):
    """Temperature left empty, or unreadable ("1e": a number field reads it as empty), went out as 0, greedy,
    unsaid (and an unreadable Max tokens as empty); now the page says what to enter and sends nothing."""
    model, tok = chat_model
    with serving(create_app(model, tok, "tiny-chat")) as url, Browser() as page:
        page.goto(f"{url}/")
        page.wait_for("document.getElementById('status').textContent.includes('tiny-chat')")
        page.evaluate(SPY)
        bad = [("temperature", "", "Temperature must be a number from 0 to 2")]
        bad += [("temperature", t, "Temperature must be a number from 0 to 2") for t in ("1e", "2.5", "-1")]
        bad += [("max_tokens", m, "Max tokens must be a whole number from 1") for m in ("1e", "0", "1.5")]
        for errors, (field, value, said) in enumerate(bad, start=1):
            page.evaluate("for (const f of ['temperature', 'max_tokens']) document.getElementById(f).value = ''")
            page.evaluate("document.getElementById('temperature').value = '0.7'")
            page.evaluate(f"document.getElementById('{field}').value = ''")
            page.type_text(f"#{field}", value)  # typed: a number field keeps "1e" as typed, and reads ""
            page.type_text("#input", "hello" if errors == 1 else "")
            page.evaluate("document.getElementById('input').focus()")
            page.press("Enter")
            page.wait_for(f"document.querySelectorAll('.error, .user').length === {errors}")
            assert page.evaluate("document.querySelectorAll('.user').length") == 0, f"{field} {value!r} was sent"
            assert said in page.evaluate("[...document.querySelectorAll('.error')].at(-1).textContent"), value
            assert page.evaluate("document.getElementById('input').value") == "hello"
        assert page.evaluate("window.bodies") == [] and page.evaluate("document.querySelectorAll('.user').length") == 0
        page.evaluate("document.getElementById('max_tokens').value = '2'; document.getElementById('input').focus()")
        page.press("Enter")
        page.wait_for("document.querySelectorAll('.assistant').length === 1 && document.body.dataset.busy === '0'")
        assert {k: page.evaluate(f"window.bodies[0].{k}") for k in ("temperature", "max_tokens")} == {
            "temperature": 0.7,
            "max_tokens": 2,
        }
        assert page.errors == []


@needs_chromium
def test_a_message_sent_while_the_server_is_down_says_so_and_stays_in_the_box(chat_model):
    """A message sent while the server was down said the browser's 'Failed to fetch', and was gone from the box."""
    model, tok = chat_model
    with Browser() as page:
        with serving(create_app(model, tok, "tiny-chat")) as url:
            page.goto(f"{url}/")
            page.wait_for("document.getElementById('status').textContent.includes('tiny-chat')")
        page.type_text("#input", "hello")
        page.press("Enter")
        page.wait_for("document.querySelectorAll('.error').length === 1 && document.body.dataset.busy === '0'")
        said = page.evaluate("document.querySelector('.error').textContent")
        assert said == "the server could not be reached (is minigpt serve still running?)"
        assert page.evaluate("document.getElementById('input').value") == "hello"
        assert page.evaluate("document.querySelectorAll('.msg:not(.error)').length") == 0 and page.errors == []


@needs_chromium
def test_a_server_restarted_with_another_model_is_said_and_followed(chat_model, base_model):
    """After a restart with another model the page still named the old one, and every message was a 404 for it
    (reload the page, it did not say); now it says what the server serves, takes it up, and sending again works."""
    model, tok = chat_model
    port = free_port()
    with Browser() as page:
        with serving(create_app(model, tok, "tiny-chat"), port=port) as url:
            page.goto(f"{url}/")
            page.wait_for("document.getElementById('status').textContent.includes('tiny-chat')")
            page.evaluate(SPY)
            page.type_text("#max_tokens", "3")
        with serving(create_app(*base_model, "tiny-base"), port=port) as url:
            page.type_text("#input", "hello")
            page.press("Enter")
            page.wait_for("document.querySelectorAll('.error').length === 1 && document.body.dataset.busy === '0'")
            assert "it now serves 'tiny-base'" in page.evaluate("document.querySelector('.error').textContent")
            assert "tiny-base" in page.evaluate("document.getElementById('status').textContent")
            assert page.evaluate("document.getElementById('send').textContent") == "Continue"
            assert page.evaluate("document.getElementById('input').value") == "hello"
            page.press("Enter")
            page.wait_for("document.querySelectorAll('.assistant').length === 1 && document.body.dataset.busy === '0'")
        assert page.evaluate("window.bodies.at(-1)")["model"] == "tiny-base"
        assert page.evaluate("document.querySelectorAll('.error').length") == 1 and page.errors == []
        assert f"{url}/v1/completions" in page.requests


class CutOff(BaseHTTPRequestHandler):
    """A server that serves the page, then cuts each reply off after its first words (a server killed mid-reply)."""

    protocol_version = "HTTP/1.1"
    health = {"model": "tiny-chat", "chat": True, "context_length": BLOCK, "api_key_required": False}

    def do_GET(self) -> None:
        page = (files("minigpt.serve") / "static" / "index.html").read_bytes()
        body, kind = (page, "text/html") if self.path == "/" else (json.dumps(self.health).encode(), "application/json")
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        event = b'data: {"choices": [{"index": 0, "delta": {"content": "Once"}}]}\n\n'
        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))  # and no last chunk: the body ends mid-way
        self.close_connection = True

    def log_message(self, *args) -> None:
        pass


@needs_chromium
def test_a_reply_cut_off_by_the_server_going_away_says_so():
    """A reply cut off mid-way showed the browser's bare 'network error'."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), CutOff)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with Browser() as page:
            page.goto(f"http://127.0.0.1:{server.server_port}/")
            page.wait_for("document.getElementById('status').textContent.includes('tiny-chat')")
            page.type_text("#input", "tell me a story")
            page.press("Enter")
            page.wait_for("document.querySelectorAll('.error').length === 1 && document.body.dataset.busy === '0'")
            said = page.evaluate("document.querySelector('.error').textContent")
            assert said == "the connection to the server was lost (is minigpt serve still running?)"
            assert page.errors == []
    finally:
        server.shutdown()
        server.server_close()
