"""Compute engines: the interface, the in-process torch engine, the child-process wrapper, vllm.

Only the interface is imported here; ``node.compute.torch_engine`` (torch) and
``node.compute.vllm_engine`` (vllm, optional extra ``gpu``) are imported where they are used.
"""

from node.compute.engine import Engine, EngineInfo, FinishReason, Generation, Prefill

__all__ = ["Engine", "EngineInfo", "FinishReason", "Generation", "Prefill"]
