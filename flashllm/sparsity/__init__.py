"""FFN sparsity: activation scores and thresholds, calibration over a corpus, the hot-first
reordering of bundles, and the predictors that say which neurons a token needs."""
