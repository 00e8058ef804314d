"""``python -m vllm_lens.cli``: the ``vllm-lens`` command without its console script (runs in:
caller).
"""

import sys

from vllm_lens.cli.main import main

sys.exit(main())
