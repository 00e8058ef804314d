"""The activation dataset format: its names (``format``), the index, shard files, the writer, the
reader (public as ``vllm_lens.datasets``) and the sae-lens export (runs in: any).
"""
