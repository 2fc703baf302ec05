"""What a model is, independent of files and runs: hyperparameters (config), architectures as data
(arch) and the storage dtypes of weights (tensor)."""
