from tpfuse.cli.main import main

raise SystemExit(main())
