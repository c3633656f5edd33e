"""Model-free speculative decoding: draft tokens by prompt lookup, verify them in the step.

A CPU decode step is memory-bound: it reads every weight once, whatever the few tokens it
multiplies, so a request that feeds its last token and k guesses of the tokens that follow
(one chunk of 1 + k tokens, like a small prefill after its context) pays about one token's
weight reads for k + 1 predictions. When the guesses are right, several tokens come out of one
step. The guesses cost no model: a request that edits, repeats or extracts from its prompt
(or repeats itself) mostly continues some earlier stretch of its own tokens, so the draft is
what followed the most recent earlier occurrence of its last few tokens
(`worker/engine/drafting/drafter.py`).

- `drafting.drafter.NgramIndex`: the lookup, an n-gram index per request updated as tokens are
  appended, so a draft costs O(k), never a scan of the context;
- `drafting.adaptive.DraftLength`: each request's draft length, following its recent acceptance;
- `speculator.Speculator`: which requests draft how many tokens in a step (none for a
  constrained request, one that opted out, or once the step is large enough to be
  compute-bound), and the counters the metrics and the heartbeat show;
- `verify.py`: the verification rows handed to the sampler and how many drafts stand.

The scheduler reserves pages for the drafts and counts only the accepted ones as computed
(worker/engine/scheduler.py), so rejected drafts' KV is never published to the prefix cache and
is overwritten by the next step; the engine emits the accepted drafts and the next token
(worker/engine/engine.py). The output is the tokens decoding without speculation would give:
see `verify.py` for greedy, sampled and seeded requests.
"""
