"""The daemon: engine thread, HTTP API (FastAPI over uvicorn) and its httpx client."""
