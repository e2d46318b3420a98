"""fusegate inside serving engines, through their plugin seams; nothing of an engine is patched on disk.

- `fusegate.integrations.sglang`: hooks for sglang >= 0.5.23 (entry point `sglang.srt.plugins`).
- `fusegate.integrations.sglang_legacy`: the same routes for sglang 0.5.10 (no plugin system),
  installed by an import hook that `python -m fusegate.integrations.sglang_legacy` re-installs
  in every spawned worker.
- `fusegate.integrations.vllm`: a post-grad pass for vLLM 0.33 (entry point `vllm.general_plugins`).
- `fusegate.integrations.runtime`: the Communicator registry and the op keyed by group name.
- `fusegate.integrations.doctor`: the rows `fusegate doctor` prints for each installed engine.

Every plugin is inert unless FUSEGATE_ENGINES names its engine. Importing this package imports
nothing else.
"""
