"""The OpenAI-compatible HTTP surface: `openai` validates request bodies, `formats` shapes
responses and SSE chunks, `server` is the aiohttp app, `metrics` the Prometheus registry.
Nothing here touches a worker: handlers talk to `luced.engine.core.Engine` only."""
