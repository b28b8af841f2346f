import sys

from xllm.gateway.cli import main

sys.exit(main())
