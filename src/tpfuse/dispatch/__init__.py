"""Selection at run time: what every `Communicator` uses to choose a strategy for a call.

- `choice`: the choice rules (explicit, measured table with the do-no-harm guard, default) and `is_fused`;
- `table`: the persisted `DispatchTable`: fingerprint, digest, lookup, load, merge and atomic save;
- `schema`: typed validation of a dispatch table's JSON before any of its fields is used;
- `agree`: all ranks use the same table or none (digest agreement at construction).

Measuring what goes into a table is `tpfuse.tune`'s part. Importing this package imports no torch.
"""
