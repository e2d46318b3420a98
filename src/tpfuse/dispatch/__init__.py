"""Selection at run time: what every `Communicator` uses to choose a strategy for a call.

The modules and what each is for: docs/ARCHITECTURE.md. Measuring what goes into a table is
`tpfuse.tune`'s part. Importing this package imports no torch.
"""
