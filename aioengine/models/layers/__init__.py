"""The building blocks every model family is made of (nano-vllm's ``layers/``):
RMSNorm (``norm``), rotary embeddings (``rotary``), paged attention with sliding
windows and soft-capping (``attention``), gated MLP activations (``activation``)."""
