"""``python -m vllm_lens.cli``: the ``vllm-lens`` command without its console script (runs in:
caller).
"""

import sys

from vllm_lens.cli.main import main

if __name__ == "__main__":  # importing it (the suite's docstring walk does) runs nothing
    sys.exit(main())
