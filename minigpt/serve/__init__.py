"""minigpt serve: an OpenAI-compatible server (Chat Completions, Completions) with continuous batching, and a chat
page.  engine: the batching, no web code; text: streamed text and stop sequences; protocol: the request bodies;
app: the FastAPI app.  Its dependencies are the `serve` extra (pip install 'minigpt[serve]')."""
