"""Selection by measurement: tune (measure and choose per bucket), the dispatch table, verify (A/B).

Heavy imports (torch) happen in the submodules, not here:
- `measure`: the shared timing protocol (interleaved rounds, barriers, max over ranks);
- `correctness`: verify-before-time against `fusegate.reference`, verdict reduced across ranks;
- `candidates`: admitted strategies, their instances and timed calls;
- `tuner`: `tune_in_group(TuneSpec(...))`, collective, inside an existing process group;
- `table`: the persisted `DispatchTable` (schema, fingerprint, digest, load/save/lookup);
- `agree`: all ranks use the same table or none (digest agreement);
- `verify`: `verify_in_group(...)`, KEEP / REVERT per bucket and overall.
"""
