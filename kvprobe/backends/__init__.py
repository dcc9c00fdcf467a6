"""Model backends beyond transformers: ``llamacpp`` runs the paper's cache operations in a real engine."""
