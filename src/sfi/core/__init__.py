"""The engine-neutral core of Slow-Fast Inference, shared by the transformers path and the vLLM
plugin: the configuration, one sequence's policy, the Selector and its scorers, pages, coverage
maths, the selection of a refresh and the attention kernels. Nothing here imports transformers or
vLLM."""
