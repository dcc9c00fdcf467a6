from kvprobe.models.arch import ArchSpec, RopeSpec, arch_spec
from kvprobe.models.loading import LoadedModel, load_model
from kvprobe.models.registry import REGISTRY, ModelEntry, resolve

__all__ = ["REGISTRY", "ArchSpec", "LoadedModel", "ModelEntry", "RopeSpec", "arch_spec", "load_model", "resolve"]
