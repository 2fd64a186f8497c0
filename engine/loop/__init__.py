"""The engine loop's room: everything between the front's calls and the core's steps.

- llm_engine.py: `LLMEngine`, the client the front drives (add, step, abort), with its core in this process or in
  its own (remote.py); output_processor.py turns the core's deltas into request outputs (detokenized, with stops);
- async_engine.py and engine_thread.py: the bridge between the HTTP server's asyncio handlers and the step loop,
  which runs on one thread of its own; it reports to an observer the server hands it (Prometheus is the server's);
- the core in its own process, behind a front that keeps the clients' requests when it dies: the front (the
  server process: HTTP, tokenization, detokenization, streams) talks to the core (scheduler and model,
  core_main.py) over a socket pair with plain-data messages (messages.py).  When the core dies (killed, a fatal
  device error, a hang the front detects), the front starts a new one and hands it every request in flight again,
  as its prompt plus the tokens already produced (remote.py, inflight.py): clients see a pause, not an error.

The scheduler and the step loop themselves live one layer down, in engine/core/ (token ids only).
"""
