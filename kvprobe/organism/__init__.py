"""Model organisms: small models fine-tuned (LoRA) to have the paper's gated-decision behaviour."""
