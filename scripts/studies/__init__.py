"""Studies behind design choices: sparsity, predictors, the tokenizer's memory (docs/PREDICTOR.md,
docs/MEASUREMENTS.md)."""
