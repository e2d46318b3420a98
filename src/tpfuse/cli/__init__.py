"""The `tpfuse` command line: one console script, one module per subcommand."""
