"""`flashllm serve`: an OpenAI- and Ollama-compatible HTTP server over one model (docs/SERVE.md).

model.py opens the model (one network per stream), worker.py is the one thread that runs it,
api.py (with messages.py and tools.py) checks requests, responses.py and logprobs.py build the
answers, ollama.py translates Ollama's API, app.py and ollama_app.py are the Starlette routes
(relay.py what they share), main.py runs them under uvicorn. Only app.py, ollama_app.py,
relay.py and main.py import the HTTP stack (the `serve` extra).
"""
