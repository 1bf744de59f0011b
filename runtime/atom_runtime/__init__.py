"""ATOM runtime: the inference engine, its server and model code.

from atom_runtime import LLM, SamplingParams
"""

from atom_runtime.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; importing the package for SamplingParams alone stays light.
    if name == "LLM":
        from atom_runtime.llm import LLM

        return LLM
    raise AttributeError(name)
