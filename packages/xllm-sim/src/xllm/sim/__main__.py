import sys

from xllm.sim.cli import main

sys.exit(main())
