"""`offload serve`: an OpenAI-compatible HTTP server over the engine loop. app (the routes), protocol (OpenAI's
shapes and the body checks), engine_thread (the thread that owns the model), metrics (Prometheus). Needs the
offload[serve] extra (FastAPI, uvicorn, prometheus_client)."""
