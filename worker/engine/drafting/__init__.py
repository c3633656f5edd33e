"""Each request's drafting state for speculative decoding: its n-gram index (`drafter`) and its
draft length (`adaptive`). A leaf below `worker.engine.sequence`, which holds it per request;
the step-level logic that uses it is `worker.engine.speculation`, above the sequence."""
