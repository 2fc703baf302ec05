"""Text in, text out: tokenizer, chat templates, sampler, generation verbs, speculative decoding,
multi-turn chat and perplexity."""
