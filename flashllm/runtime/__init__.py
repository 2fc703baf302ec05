"""A run in DRAM: the forward pass, the dense weights (resident or streamed), the FFN strategies
(dense, sparse flash), the neuron cache, what a pass reads and in which order, the DRAM budget, and
the per-token statistics. Bytes read from flash land here."""
