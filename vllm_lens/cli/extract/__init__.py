"""``vllm-lens extract``: its flags and checks, prompt files, and one job run through a local
engine, vLLM's data-parallel engines, Ray Data actors or a lens-enabled server (runs in: caller).
"""
