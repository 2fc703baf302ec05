"""`flashllm serve`: an OpenAI-compatible HTTP server over one model (docs/SERVE.md).

model.py opens the model (one network per stream), worker.py is the one thread that runs it,
api.py checks requests and builds responses, app.py is the Starlette app, main.py runs it under
uvicorn. Only app.py and main.py import the HTTP stack (the `serve` extra).
"""
