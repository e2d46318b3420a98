"""`python -m tpfuse`: the `tpfuse` console script without the installed entry point."""

from tpfuse.cli.main import main

raise SystemExit(main())
