from kvprobe.tasks.gated import GatedInstance, GatedTemplate, TokenizedPair, generate_instances, load_template, tokenize_pair

__all__ = ["GatedInstance", "GatedTemplate", "TokenizedPair", "generate_instances", "load_template", "tokenize_pair"]
