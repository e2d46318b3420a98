"""tpfuse inside serving engines, through their plugin seams; nothing of an engine is patched on disk.

- `tpfuse.integrations.sglang`: hooks for sglang >= 0.5.23 (entry point `sglang.srt.plugins`).
- `tpfuse.integrations.sglang_legacy`: the same routes for sglang 0.5.10 (no plugin system),
  installed by an import hook that `python -m tpfuse.integrations.sglang_legacy` re-installs
  in every spawned worker.
- `tpfuse.integrations.vllm`: a post-grad pass for vLLM 0.33 (entry point `vllm.general_plugins`).
- `tpfuse.integrations.runtime`: the Communicator registry and the op keyed by group name.
- `tpfuse.integrations.doctor`: the rows `tpfuse doctor` prints for each installed engine.

Every plugin is inert unless TPFUSE_ENGINES names its engine. Importing this package imports
nothing else.
"""
