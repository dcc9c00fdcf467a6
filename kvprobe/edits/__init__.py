"""Weight edits, the baselines the KV edits are compared against (paper Table 1, Appendix I): ROME
(:mod:`kvprobe.edits.rome`) and a LoRA fine-tune (:mod:`kvprobe.edits.lora`), with weight checksums
(:mod:`kvprobe.edits.weights`)."""
