"""Static audit of architecture gates in inference engines' Python (and report-only C++/CMake) source.

Never imports or executes the audited code and never imports torch. Entry points: `engine.audit`
(find and evaluate gates), `plan.Planner` + `patch.build_changes` (minimal edits at ast positions, re-audited),
`manifest.apply` / `manifest.revert` (atomic writes, byte-exact revert); the CLI is
`tpfuse audit` (cli/audit.py).
"""
