"""tpfuse inside serving engines, through their plugin seams; nothing of an engine is patched on disk.

The modules (one per engine route, the runtime registry they share, start-up calibration and doctor's
rows): docs/ARCHITECTURE.md. Every plugin is inert unless TPFUSE_ENGINES names its engine. Importing
this package imports nothing else.
"""
