"""The ``vllm-lens`` command line (``main``), ``vllm-lens serve`` and ``vllm-lens extract``
(``extract/``) (runs in: caller).
"""
