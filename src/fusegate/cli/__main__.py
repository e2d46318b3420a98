from fusegate.cli.main import main

raise SystemExit(main())
