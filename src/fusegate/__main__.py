"""`python -m fusegate`: the `fusegate` console script without the installed entry point."""

from fusegate.cli.main import main

raise SystemExit(main())
