"""hydrad: a serving daemon for multimodal (vision-language) LLMs.

The offline API mirrors vLLM's::

    from hydrad import LLM, SamplingParams
    llm = LLM("path/to/model")
    outs = llm.chat(conversations, SamplingParams(max_tokens=32, temperature=0.0))
"""

from hydrad.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and transformers; keep `import hydrad` cheap for the CLI.
    if name in ("LLM", "RequestOutput"):
        from hydrad import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'hydrad' has no attribute {name!r}")
