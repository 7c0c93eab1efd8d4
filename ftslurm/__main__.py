import sys

from ftslurm.cli.main import main

sys.exit(main())
