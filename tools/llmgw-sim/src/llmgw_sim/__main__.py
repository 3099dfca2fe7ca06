import sys

from llmgw_sim.cli import main

sys.exit(main())
