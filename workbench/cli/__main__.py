"""``python -m workbench.cli``: the ``workbench`` command (what :class:`~workbench.server.launcher.ServerProcess` runs)."""

import sys

from workbench.cli.main import main

sys.exit(main())
