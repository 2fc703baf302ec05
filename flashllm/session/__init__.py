"""The session layer: how a run is assembled, from one place, for the CLI (and a server).

cli/ parses options, calls these functions and prints what they return; nothing below this
layer is imported by cli/ except through here. A MODEL is resolved to a converted folder
(models.py), a run is planned, calibrated once, opened and tokenized, and its drafting chosen
(run.py); the other commands' work (convert, pull, models, inspect, profile, perplexity,
calibrate) is in models.py, quality.py and calibration.py. Light at import: the heavy modules
load inside the functions, so a run under --dram-budget measures its process before they do.

A run: the --dram-budget parsed where it is given (options.parse_budget), run.request(...) ->
RunRequest, run.assemble(request) -> Parts (the model opened once: its plan, FFN, dense weights,
tokenizer and network), then per stream a stream.Sampling's sampler, run.drafter(...) and
stream.complete or stream.chat_session.
"""
