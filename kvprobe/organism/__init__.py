"""Model organisms: small models fine-tuned (LoRA) to have the paper's gated-decision behaviour.

Training (:mod:`kvprobe.organism.train`) and the ``kvprobe organism`` command live here. The organism registry and
lineage readers are part of the models layer (:mod:`kvprobe.models.organisms`, :mod:`kvprobe.models.lineage`);
the selection study that chose the recommended organisms is a checkout's ``organisms/tooling/``."""
