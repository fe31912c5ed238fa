"""The OpenAI-compatible HTTP surface: `openai` validates request bodies, `formats` shapes
responses and SSE chunks, `server` is the aiohttp app (its Prometheus registry is
`luced.engine.metrics`). Nothing here touches a worker: handlers talk to
`luced.engine.core.Engine` only."""
