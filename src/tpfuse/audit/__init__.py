"""Static audit of architecture gates in inference engines' Python (and report-only C++/CMake) source.

Never imports or executes the audited code and never imports torch. The modules and the path of an
audit through them: docs/ARCHITECTURE.md; the CLI is `tpfuse audit` / `patch` / `revert` (cli/audit.py).
"""
