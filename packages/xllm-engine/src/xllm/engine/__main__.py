"""``python -m xllm.engine``: one engine instance process (see :mod:`xllm.engine.instance`)."""

import sys

from xllm.engine.instance import main

sys.exit(main())
