"""Tensor parallelism: the process group (``parallel_state``) and how the
Llama weights are split over it (``tensor_parallel``)."""
